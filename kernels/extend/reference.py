"""Extend (prefill) attention in plain torch: the CPU serving path and the kernels' reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from oscar_sglang.rotation import derotate_output, rotate_kv, rotate_queries

from ..layout import DeviceRotation, LayerStore
from ..read.reference import read_rows


def rotated_requests(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, rot: DeviceRotation,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, extend_start_loc: torch.Tensor | None, dtype: torch.dtype,
                     read: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], object] | None = None,
                     ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per request with new tokens: its rows of ``q`` and, in ``dtype``, the rotated queries ``[ext, q_heads, d]``
    and keys, values ``[pre + ext, kv_heads, d]`` (the cached prefix read from the store, then the new tokens
    rotated exactly); a host loop over the requests (prefill only).  ``read(slots, out)`` writes the prefix's
    rows into ``out``, the first ``pre`` rows of the keys and values (default: ``read_rotated`` in fp32, then
    a cast): no concatenated copy."""
    n, _, d = q.shape
    kv = rot.k_rot.shape[0]
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, 0) - extend_lens
    read = read or (lambda slots, out: read_rows(store, slots, dtype, out))  # read_rotated (fp32), cast into out
    qr = rotate_queries(q, rot.q_rot).to(dtype)
    kn = rotate_kv(k.reshape(n, kv, d), rot.k_rot, rot.k_mean).to(dtype)
    vn = rotate_kv(v.reshape(n, kv, d), rot.v_rot).to(dtype)
    for req, pre, ext, first in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist(),
                                    extend_start_loc.tolist()):
        if ext == 0:
            continue
        rows = slice(first, first + ext)
        keys = torch.empty(pre + ext, kv, d, dtype=dtype, device=q.device)
        vals = torch.empty_like(keys)
        read(req_to_token[req, :pre], (keys[:pre], vals[:pre]))
        keys[pre:], vals[pre:] = kn[rows], vn[rows]
        yield rows, qr[rows], keys, vals


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
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(n, q_heads, d, dtype=work, device=q.device)
    for rows, qr, keys, vals in rotated_requests(q, k, v, store, rot, req_to_token, req_pool_indices, prefix_lens,
                                                 extend_lens, extend_start_loc, work):
        ext, total = qr.shape[0], keys.shape[0]
        pre = total - ext
        seen = torch.arange(total, device=q.device)[None, :] <= pre + torch.arange(ext, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qr.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                           attn_mask=seen, scale=sm_scale, enable_gqa=q_heads != kv)  # [Hq, ext, d]
        out[rows] = o.transpose(0, 1)
    return derotate_output(out, rot.v_rot).to(q.dtype)
