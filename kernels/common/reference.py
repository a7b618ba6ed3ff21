"""Read rotated K/V rows from the store by slot, in plain torch (the readers' reference)."""

from __future__ import annotations

import torch

from oscar_sglang import format as fmt
from oscar_sglang.rotation import group_index

from ..layout import LayerStore


def read_rotated(store: LayerStore, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated rows ``k', v'`` fp32 ``[n, kv_heads, d]`` at ``slots``: BF16 where hot, dequantized elsewhere
    (keys in ``store.k_format``, values in ``store.v_format``)."""
    slots = slots.long()
    kf, vf = store.k_format, store.v_format
    k = fmt.dequantize(fmt.QuantRows(store.k_codes[slots], store.k_scale[slots],
                                     None if kf.symmetric else store.k_zero[slots], kf.bits))
    v = fmt.dequantize(fmt.QuantRows(store.v_codes[slots], store.v_scale[slots],
                                     None if vf.symmetric else store.v_zero[slots], vf.bits))
    entry = store.hot_index[slots].long()
    hot = entry >= 0
    if bool(hot.any()):
        k[hot] = store.k_hot[entry[hot]].float()
        v[hot] = store.v_hot[entry[hot]].float()
    return k, v


def expand_groups(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``x[..., kv_heads, d]`` -> ``[..., q_heads, d]``: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``."""
    return x.index_select(-2, group_index(q_heads, x.shape[-2], x.device))
