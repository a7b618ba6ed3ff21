"""Query rotation and output de-rotation for the kernels' torch pre/epilogue.

Same math as ``oscar_sglang.rotation.rotate_queries`` / ``derotate_output``
(tested equal), computed as one batched matmul per KV head group instead of
gathering a ``[q_heads, d, d]`` copy of the rotations.
"""

from __future__ import annotations

import torch


def rotate_queries(q: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """``q[n, q_heads, d] -> q'`` fp32 with ``q'_h = q_h @ R_K[h // (q_heads // kv_heads)]``."""
    n, hq, d = q.shape
    kv = k_rot.shape[0]
    return torch.matmul(q.float().reshape(n, kv, hq // kv, d), k_rot.float()).reshape(n, hq, d)


def derotate_output(o: torch.Tensor, v_rot: torch.Tensor) -> torch.Tensor:
    """``o'[n, q_heads, d] -> o`` fp32 with ``o_h = o'_h @ R_V[group(h)]^T``."""
    n, hq, d = o.shape
    kv = v_rot.shape[0]
    return torch.matmul(o.float().reshape(n, kv, hq // kv, d), v_rot.float().transpose(-1, -2)).reshape(n, hq, d)
