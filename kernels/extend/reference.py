"""Extend (prefill) attention in plain torch: the CPU serving path and the kernels' reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oscar_sglang.rotation import derotate_output, rotate_kv, rotate_queries

from ..common.reference import read_rotated
from ..layout import DeviceRotation, LayerStore


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, rot: DeviceRotation,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float,
                     extend_start_loc: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens attend to their cached prefix (from the store) and, causally, to each other (exact).

    ``q [N, q_heads, d]``, ``k, v [N, kv_heads, d]``: the new tokens of all
    requests, request ``b``'s ``extend_lens[b]`` rows starting at
    ``extend_start_loc[b]`` (default: packed in order).  Its prefix is the
    ``prefix_lens[b]`` tokens at ``req_to_token[req_pool_indices[b], :prefix_lens[b]]``.
    Scores are computed in the rotated, centred space: ``q'`` against the
    stored ``k'`` and against ``(k_new - mu) R_K``; output ``[N, q_heads, d]`` in ``q.dtype``.
    """
    n, q_heads, d = q.shape
    kv = rot.k_rot.shape[0]
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, 0) - extend_lens
    qr = rotate_queries(q, rot.q_rot)
    kn = rotate_kv(k.reshape(n, kv, d), rot.k_rot, rot.k_mean)
    vn = rotate_kv(v.reshape(n, kv, d), rot.v_rot)
    out = torch.zeros_like(qr)
    for b, (req, pre, ext, first) in enumerate(zip(req_pool_indices.tolist(), prefix_lens.tolist(),
                                                   extend_lens.tolist(), extend_start_loc.tolist())):
        if ext == 0:
            continue
        kp, vp = read_rotated(store, req_to_token[req, :pre])
        keys = torch.cat([kp, kn[first:first + ext]]).transpose(0, 1)  # [kv, pre + ext, d]
        vals = torch.cat([vp, vn[first:first + ext]]).transpose(0, 1)
        seen = torch.arange(pre + ext, device=q.device)[None, :] <= pre + torch.arange(ext, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qr[first:first + ext].transpose(0, 1), keys, vals, attn_mask=seen,
                                           scale=sm_scale, enable_gqa=q_heads != kv)  # [Hq, ext, d]
        out[first:first + ext] = o.transpose(0, 1)
    return derotate_output(out, rot.v_rot).to(q.dtype)
