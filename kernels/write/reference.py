"""Write path in plain torch: rotate, clip, quantize (each side in its format), scatter to slots, copy hot rows."""

from __future__ import annotations

import torch

from oscar_sglang.rotation import rotate_kv

from ..layout import DeviceRotation, LayerStore


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, store: LayerStore, rot: DeviceRotation,
             hot_loc: torch.Tensor | None = None) -> None:
    """Store new tokens ``k, v [n, kv_heads, d]`` at ``slots [n]`` (in place).

    Keys are quantized in ``store.k_format``, values in ``store.v_format``
    (bits and group of each side, read off the store's shapes).

    ``hot_loc [n]``: hot entry of each token or -1; where >= 0 the rotated,
    unclipped rows are also written to ``k_hot``/``v_hot`` as BF16.  The
    caller (the pool) keeps ``hot_index`` in step.
    """
    slots = slots.long()
    k_rot = rotate_kv(k, rot.k_rot, rot.k_mean)
    v_rot = rotate_kv(v, rot.v_rot)
    for x, clip, form, codes, scale, zero in (
            (k_rot, rot.k_clip, store.k_format, store.k_codes, store.k_scale, store.k_zero),
            (v_rot, rot.v_clip, store.v_format, store.v_codes, store.v_scale, store.v_zero)):
        q = form.quantize(x, clip.unsqueeze(-1))
        codes[slots] = q.codes
        scale[slots] = q.scale
        if q.zero is not None:  # symmetric rows store no zero
            zero[slots] = q.zero
    if hot_loc is not None:
        hot = hot_loc >= 0
        entry = hot_loc[hot].long()
        store.k_hot[entry] = k_rot[hot].to(torch.bfloat16)
        store.v_hot[entry] = v_rot[hot].to(torch.bfloat16)
