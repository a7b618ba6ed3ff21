"""Decode attention in plain torch: dequantize each request's rows, attend in rotated space."""

from __future__ import annotations

import torch

from oscar_sglang.rotation import derotate_output, rotate_queries

from ..common.reference import expand_groups, read_rotated
from ..layout import DeviceRotation, LayerStore


def decode_attention(q: torch.Tensor, store: LayerStore, rot: DeviceRotation, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """One query token per request: ``q [batch, q_heads, d]`` -> output ``[batch, q_heads, d]`` in ``q.dtype``.

    Request ``b`` attends to the ``seq_lens[b]`` tokens at slots
    ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` (its new token included).
    A request of length 0 gets a zero output.
    """
    bsz, q_heads, _ = q.shape
    qr = rotate_queries(q, rot.q_rot)  # fp32 [B, Hq, d]
    out = torch.zeros_like(qr)
    lens = seq_lens.tolist()
    reqs = req_pool_indices.tolist()
    live = [b for b in range(bsz) if lens[b] > 0]
    if not live:
        return derotate_output(out, rot.v_rot).to(q.dtype)
    # one read of every live request's rows (fewer, larger ops than a read per request)
    slots = torch.cat([req_to_token[reqs[b], : lens[b]] for b in live])
    k_all, v_all = read_rotated(store, slots)
    start = 0
    for b in live:
        k, v = k_all[start:start + lens[b]], v_all[start:start + lens[b]]
        start += lens[b]
        k, v = expand_groups(k, q_heads), expand_groups(v, q_heads)  # [T, Hq, d]
        logits = torch.einsum("hd,thd->ht", qr[b], k) * sm_scale
        out[b] = torch.einsum("ht,thd->hd", logits.softmax(-1), v)
    return derotate_output(out, rot.v_rot).to(q.dtype)
