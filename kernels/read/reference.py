"""Read path in plain torch: the rotated K/V rows at some slots, dequantized (BF16 copies where hot), in a dtype."""

from __future__ import annotations

import torch

from ..common.reference import read_rotated
from ..layout import LayerStore


def read_rows(store: LayerStore, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``k', v' [n, kv_heads, d]`` in ``dtype`` at ``slots [n]``: the hot rows' BF16 copies, the others
    dequantized in fp32 (``zero + code * scale``, keys and values each in their format), then rounded once."""
    k, v = read_rotated(store, slots)
    return k.to(dtype), v.to(dtype)
