"""The INT2 row format: the one definition every other part follows.

A tensor ``x[..., d]`` is quantized row by row in groups of ``G`` consecutive
channels (``G`` divides ``d``; default ``G = d``, one group per row):

1. **Clip** (optional).  With ratio ``r`` in (0, 1] for the group, the group's
   range ``[min, max]`` shrinks about its midpoint to
   ``mid ± r * (max - min) / 2`` and the values are clamped to it.  ``r = 1``
   leaves the group untouched.  Shrinking about the midpoint (rather than
   about zero) keeps the clip independent of a constant offset, as the
   asymmetric quantizer itself is.
2. **Scale and zero**, stored as fp16: ``zero = fp16(lo)``,
   ``scale = fp16((hi - zero) / 3)``.  Codes are computed against these
   *stored* values, so dequantization reproduces exactly what the encoder
   meant.
3. **Codes** ``c = clamp(round((x - zero) / scale), 0, 3)``; a constant group
   (``scale == 0``) gets all-zero codes and dequantizes to ``zero`` exactly.
   ``round`` is round-half-to-even (``torch.round``).
4. **Packing**: four codes per ``uint8``, little-endian within the byte:
   element ``j`` of a row lives in byte ``j // 4`` at bits ``2 * (j % 4)``
   (element ``4i`` in bits 0-1, ``4i+1`` in bits 2-3, ``4i+2`` in bits 4-5,
   ``4i+3`` in bits 6-7).  Packing is per row and ignores groups.

Dequantized value: ``x_hat = zero + c * scale`` (computed in float32).
Storage per row: ``d / 4`` bytes of codes plus ``4 * d / G`` bytes of scale
and zero, i.e. ``2 + 32 / G`` bits per element.

Plain torch only: kernels, the CPU serving path, the calibration's simulated
cache and the tests all use or are tested against this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = 4
CODES_PER_BYTE = 4


@dataclass(frozen=True)
class Int2Rows:
    """Quantized rows: ``codes[..., d // 4]`` uint8, ``scale``/``zero[..., d // G]`` fp16."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def dim(self) -> int:
        return self.codes.shape[-1] * CODES_PER_BYTE

    @property
    def group_size(self) -> int:
        return self.dim // self.scale.shape[-1]


def bits_per_element(group_size: int) -> float:
    """Storage cost of the format: 2 bits of code plus fp16 scale and zero per group."""
    return 2.0 + 32.0 / group_size


def bytes_per_row(dim: int, group_size: int | None = None) -> int:
    group_size = dim if group_size is None else group_size
    check_shape(dim, group_size)
    return dim // CODES_PER_BYTE + 4 * (dim // group_size)


def check_shape(dim: int, group_size: int) -> None:
    if dim % CODES_PER_BYTE:
        raise ValueError(f"INT2 rows need a dimension divisible by 4, got {dim}")
    if group_size <= 0 or dim % group_size:
        raise ValueError(f"group size {group_size} must divide the row dimension {dim}")


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., d]`` (values 0..3, any integer dtype) into ``uint8[..., d // 4]``."""
    if codes.shape[-1] % CODES_PER_BYTE:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes: need a multiple of 4")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, CODES_PER_BYTE)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8[..., n]`` -> codes ``uint8[..., 4 n]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * CODES_PER_BYTE)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def clip_groups(x: torch.Tensor, clip_ratio: torch.Tensor | float | None, group_size: int) -> torch.Tensor:
    """Apply the format's clip (step 1) in float32; returns ``x`` grouped ``[..., d // G, G]``."""
    g = _grouped(x.float(), group_size)
    if clip_ratio is None:
        return g
    r = torch.as_tensor(clip_ratio, dtype=torch.float32, device=x.device)
    if torch.any((r <= 0) | (r > 1)):
        raise ValueError("clip ratios must lie in (0, 1]")
    lo = g.amin(dim=-1, keepdim=True)
    hi = g.amax(dim=-1, keepdim=True)
    mid = (hi + lo) * 0.5
    half = (hi - lo) * 0.5 * r.unsqueeze(-1)
    return torch.minimum(torch.maximum(g, mid - half), mid + half)


def quantize(
    x: torch.Tensor,
    group_size: int | None = None,
    clip_ratio: torch.Tensor | float | None = None,
) -> Int2Rows:
    """Quantize ``x[..., d]`` to INT2 rows.

    ``clip_ratio`` is a float or a tensor broadcastable to ``x.shape[:-1] + (d // G,)``
    (one ratio per row-group; e.g. shape ``[kv_heads, 1]`` for one level per head).
    """
    d = x.shape[-1]
    group_size = d if group_size is None else group_size
    check_shape(d, group_size)
    g = clip_groups(x, clip_ratio, group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / (LEVELS - 1)).clamp_min(0).to(torch.float16)
    zf = zero.float().unsqueeze(-1)
    sf = scale.float().unsqueeze(-1)
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    codes = torch.round((g - zf) * inv).clamp_(0, LEVELS - 1)
    return Int2Rows(pack(codes.reshape(x.shape)), scale, zero)


def dequantize(q: Int2Rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``x_hat[..., d] = zero + code * scale`` for every element."""
    codes = unpack(q.codes).float()
    g = _grouped(codes, q.group_size)
    x = q.zero.float().unsqueeze(-1) + g * q.scale.float().unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    group_size: int | None = None,
    clip_ratio: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Round trip through the format, returned in ``x``'s dtype (for simulation and error reports)."""
    return dequantize(quantize(x, group_size, clip_ratio), dtype=x.dtype)
