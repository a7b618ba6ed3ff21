"""Extend (prefill) attention through torch's SDPA over the dequantized prefix: a second GPU path.

The Triton kernel (``triton_kernel.py``) reads the INT2 prefix straight from
the store and dequantizes it in every query block; this path dequantizes each
request's prefix once (``reference.read_rotated``), rounds the rotated
queries, keys and values to ``q``'s dtype when it is 16-bit (a server's
bf16; fp32 inputs stay fp32) and runs ``scaled_dot_product_attention``
over prefix + new tokens with the lower-right causal mask, which torch serves with its flash
kernel on a GPU (a dense BF16 prefill's speed, plus the dequantization and
a copy).  The GQA heads are expanded first (flash and efficient attention
then take the shapes as they are).  Transient memory per request: the
prefix + new tokens' keys and values for every query head (32 heads x 32k
tokens x d 128 in bf16: 512 MiB).  Chosen on a server by
``OSCAR_SGLANG_EXTEND_KERNEL=sdpa``; the numerics are the reference's with
bf16 operands (``tests/test_kernels_extend.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oscar_sglang.rotation import derotate_output

from ..common.reference import expand_groups
from ..layout import DeviceRotation, LayerStore
from .reference import rotated_requests

# torch's lower-right CausalBias (flash attention serves it) on a GPU; the same mask as booleans elsewhere,
# since its module imports Triton, which a CPU server never does.  True / False: either everywhere (tests).
CAUSAL_BIAS: bool | None = None


def lower_right_causal(ext: int, total: int, device: torch.device):
    """Mask of ``ext`` new tokens after ``total - ext`` cached ones: token ``i`` sees keys ``<= total - ext + i``."""
    if CAUSAL_BIAS or (CAUSAL_BIAS is None and device.type == "cuda"):
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(ext, total)
    return torch.arange(total, device=device)[None, :] <= total - ext + torch.arange(ext, device=device)[:, None]


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, rot: DeviceRotation,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float,
                     extend_start_loc: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`oscar_sglang.kernels.extend.reference.extend_attention` with 16-bit operands through SDPA."""
    n, q_heads, d = q.shape
    work = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    out = torch.zeros(n, q_heads, d, dtype=work, device=q.device)

    def heads(x):  # [tokens, kv_heads, d] -> [1, q_heads, tokens, d]
        return expand_groups(x, q_heads).transpose(0, 1).unsqueeze(0)

    for rows, qr, keys, vals in rotated_requests(q, k, v, store, rot, req_to_token, req_pool_indices, prefix_lens,
                                                 extend_lens, extend_start_loc, work):
        ext, total = qr.shape[0], keys.shape[0]
        o = F.scaled_dot_product_attention(qr.transpose(0, 1).unsqueeze(0), heads(keys), heads(vals),
                                           attn_mask=lower_right_causal(ext, total, q.device), scale=sm_scale)
        out[rows] = o[0].transpose(0, 1)
    return derotate_output(out, rot.v_rot).to(q.dtype)
