"""Read path in plain torch: the rotated K/V rows at some slots, dequantized (BF16 copies where hot), in a dtype."""

from __future__ import annotations

import torch

from ..common.reference import read_rotated
from ..layout import LayerStore


def read_rows(store: LayerStore, slots: torch.Tensor, dtype: torch.dtype,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``k', v' [n, kv_heads, d]`` in ``dtype`` at ``slots [n]``: the hot rows' BF16 copies, the others
    dequantized in fp32 (``zero + code * scale``, keys and values each in their format), then rounded once.
    ``out``: two contiguous ``[n, kv_heads, d]`` tensors of ``dtype`` to write them into (and return)."""
    k, v = read_rotated(store, slots)
    if out is None:
        return k.to(dtype), v.to(dtype)
    check_out(out, k.shape, dtype)
    out[0].copy_(k)
    out[1].copy_(v)
    return out


def check_out(out: tuple[torch.Tensor, torch.Tensor], shape, dtype: torch.dtype) -> None:
    """``read_rows``' ``out``: two contiguous tensors of the rows' shape and ``dtype``, or a clear error."""
    for t in out:
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"out must be two contiguous {tuple(shape)} tensors of {dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}{'' if t.is_contiguous() else ', not contiguous'}")
