"""The quantized row format: the one definition every other part follows.

A tensor ``x[..., d]`` is quantized row by row in groups of ``G`` consecutive
channels (``G`` divides ``d``; default ``G = d``, one group per row), with
``b`` bits per code, ``b`` in :data:`BITS` (2: the INT2 cache; 4 and 8: the
wider rows a precision policy may give a layer's keys or values):

1. **Clip** (optional).  With ratio ``r`` in (0, 1] for the group, the group's
   range ``[min, max]`` shrinks about its midpoint to
   ``mid ± r * (max - min) / 2`` and the values are clamped to it.  ``r = 1``
   leaves the group untouched.  Shrinking about the midpoint (rather than
   about zero) keeps the clip independent of a constant offset, as the
   asymmetric quantizer itself is.
2. **Scale and zero**, stored as fp16: ``zero = fp16(lo)``,
   ``scale = fp16((hi - zero) / L)`` with ``L = 2^b - 1`` (3 for INT2).
   Codes are computed against these *stored* values, so dequantization
   reproduces exactly what the encoder meant.
   *Symmetric* rows (``RowFormat(b, G, symmetric=True)``, named ``int2sym``)
   clip about 0 instead (the group's largest magnitude ``a`` becomes ``r * a``;
   codes beyond it saturate), and
   store the scale only: ``scale = fp16(2 * a / L)`` and the
   zero is implied, ``zero = -(L / 2) * scale`` in float32 (exact: 1.5 times
   an fp16 value fits a float32), so the grid is symmetric about 0.  Meant
   for centered rows (keys after mean removal), it saves 16 bits per group.
3. **Codes** ``c = clamp(round((x - zero) / scale), 0, L)``; a constant group
   (``scale == 0``) gets all-zero codes and dequantizes to ``zero`` exactly.
   ``round`` is round-half-to-even (``torch.round``).
4. **Packing**: ``8 / b`` codes per ``uint8``, little-endian within the byte:
   element ``j`` of a row lives in byte ``j * b // 8`` at bits ``b * (j % (8 / b))``
   (INT2: element ``4i`` in bits 0-1 of byte ``i``, ``4i+1`` in bits 2-3,
   ``4i+2`` in bits 4-5, ``4i+3`` in bits 6-7; INT4: element ``2i`` in the
   low nibble of byte ``i``, ``2i+1`` in the high one; INT8: one byte each).
   Packing is per row and ignores groups.

Dequantized value: ``x_hat = zero + c * scale`` (computed in float32).
Storage per row: ``d * b / 8`` bytes of codes plus ``4 * d / G`` bytes of
scale and zero, i.e. ``b + 32 / G`` bits per element (symmetric rows:
``2 * d / G`` bytes of scale, ``b + 16 / G`` bits per element).  ``d`` must be a
multiple of 4 for every ``b`` (the kernels read rows in four pieces).

Plain torch only: kernels, the CPU serving path, the calibration's simulated
cache and the tests all use or are tested against this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8)
LEVELS = 4  # INT2 code values (the default format)
CODES_PER_BYTE = 4  # INT2


def max_code(bits: int = 2) -> int:
    """Largest code ``L = 2^bits - 1``; the quantization step is ``(max - min) / L``."""
    check_bits(bits)
    return (1 << bits) - 1


def codes_per_byte(bits: int = 2) -> int:
    check_bits(bits)
    return 8 // bits


def check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"codes must have one of {BITS} bits, got {bits!r}")


@dataclass(frozen=True)
class RowFormat:
    """How one layer stores its key (or value) rows: ``bits`` per code, one fp16 scale and zero per ``group``."""

    bits: int = 2
    group: int | None = None  # None: one group per row (G = head_dim)
    symmetric: bool = False  # True: scale only, zero implied (-(L/2) * scale)

    def __post_init__(self):
        check_bits(self.bits)
        if self.group is not None and (type(self.group) is not int or self.group <= 0):
            raise ValueError(f"group size must be a positive integer, got {self.group!r}")
        if type(self.symmetric) is not bool:
            raise ValueError(f"symmetric must be a bool, got {self.symmetric!r}")

    def group_for(self, dim: int) -> int:
        return dim if self.group is None else self.group

    def resolved(self, dim: int) -> "RowFormat":
        """The same format with ``group`` spelled out for rows of ``dim`` (checked)."""
        g = self.group_for(dim)
        check_shape(dim, g, self.bits)
        return RowFormat(self.bits, g, self.symmetric)

    def bits_per_element(self, dim: int) -> float:
        return bits_per_element(self.group_for(dim), self.bits, self.symmetric)

    def bytes_per_row(self, dim: int) -> int:
        return bytes_per_row(dim, self.group_for(dim), self.bits, self.symmetric)

    def name(self, dim: int | None = None) -> str:
        g = self.group if dim is None else self.group_for(dim)
        return f"int{self.bits}" + ("sym" if self.symmetric else "") + (f"/g{g}" if g is not None and g != dim else "")

    def to_json(self) -> dict:
        out = {"bits": self.bits, "group": self.group}
        if self.symmetric:
            out["symmetric"] = True
        return out

    def quantize(self, x: torch.Tensor, clip_ratio: torch.Tensor | float | None = None) -> "QuantRows":
        return quantize(x, self.group, clip_ratio, self.bits, self.symmetric)

    def fake_quantize(self, x: torch.Tensor, clip_ratio: torch.Tensor | float | None = None) -> torch.Tensor:
        """Round trip of ``x`` through this format (see :func:`fake_quantize`)."""
        return fake_quantize(x, self.group, clip_ratio, self.bits, self.symmetric)


@dataclass(frozen=True)
class QuantRows:
    """Quantized rows: ``codes[..., d * bits // 8]`` uint8, ``scale``/``zero[..., d // G]`` fp16
    (symmetric rows: ``zero`` is None, implied by the scale)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int = 2

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def zero_f32(self) -> torch.Tensor:
        """The zero as float32: the stored one, or ``-(L/2) * scale`` for symmetric rows."""
        if self.zero is None:
            return self.scale.float() * (-0.5 * max_code(self.bits))
        return self.zero.float()

    @property
    def dim(self) -> int:
        return self.codes.shape[-1] * codes_per_byte(self.bits)

    @property
    def group_size(self) -> int:
        return self.dim // self.scale.shape[-1]


def bits_per_element(group_size: int, bits: int = 2, symmetric: bool = False) -> float:
    """Storage cost of the format: ``bits`` of code plus fp16 scale and zero per group (scale only if symmetric)."""
    check_bits(bits)
    return bits + (16.0 if symmetric else 32.0) / group_size


def bytes_per_row(dim: int, group_size: int | None = None, bits: int = 2, symmetric: bool = False) -> int:
    group_size = dim if group_size is None else group_size
    check_shape(dim, group_size, bits)
    return dim * bits // 8 + (2 if symmetric else 4) * (dim // group_size)


def check_shape(dim: int, group_size: int, bits: int = 2) -> None:
    check_bits(bits)
    if dim % 4:
        raise ValueError(f"quantized rows need a dimension divisible by 4, got {dim}")
    if group_size <= 0 or dim % group_size:
        raise ValueError(f"group size {group_size} must divide the row dimension {dim}")


def pack(codes: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Pack codes ``[..., d]`` (values ``0..2^bits - 1``, any integer dtype) into ``uint8[..., d * bits // 8]``."""
    per = codes_per_byte(bits)
    if codes.shape[-1] % per:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes of {bits} bits: need a multiple of {per}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8[..., n]`` -> codes ``uint8[..., n * 8 // bits]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    per = codes_per_byte(bits)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & max_code(bits)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def _ratios(clip_ratio, device) -> torch.Tensor:
    r = torch.as_tensor(clip_ratio, dtype=torch.float32, device=device)
    if torch.any((r <= 0) | (r > 1)):
        raise ValueError("clip ratios must lie in (0, 1]")
    return r


def clip_groups(x: torch.Tensor, clip_ratio: torch.Tensor | float | None, group_size: int) -> torch.Tensor:
    """Apply the format's clip (step 1) in float32; returns ``x`` grouped ``[..., d // G, G]``."""
    g = _grouped(x.float(), group_size)
    if clip_ratio is None:
        return g
    r = _ratios(clip_ratio, x.device)
    lo = g.amin(dim=-1, keepdim=True)
    hi = g.amax(dim=-1, keepdim=True)
    mid = (hi + lo) * 0.5
    half = (hi - lo) * 0.5 * r.unsqueeze(-1)
    return torch.minimum(torch.maximum(g, mid - half), mid + half)


def _codes(x: torch.Tensor, group_size: int | None, clip_ratio, bits: int, symmetric: bool):
    """The format's steps 1-3 on ``x[..., d]``: float codes grouped ``[..., d // G, G]``, the fp16 scale and
    zero (None for symmetric rows) and the float32 zero every code is read against."""
    d = x.shape[-1]
    group_size = d if group_size is None else group_size
    check_shape(d, group_size, bits)
    top = max_code(bits)
    if symmetric:  # clip about 0: the group's largest magnitude a shrinks to r * a
        g = _grouped(x.float(), group_size)
        a = g.abs().amax(dim=-1)
        if clip_ratio is not None:
            a = a * _ratios(clip_ratio, x.device)
        scale = (a * (2.0 / top)).to(torch.float16)
        zero = None
        zf = (scale.float() * (-0.5 * top)).unsqueeze(-1)
    else:
        g = clip_groups(x, clip_ratio, group_size)
        lo = g.amin(dim=-1)
        hi = g.amax(dim=-1)
        zero = lo.to(torch.float16)
        scale = ((hi - zero.float()) / top).clamp_min(0).to(torch.float16)
        zf = zero.float().unsqueeze(-1)
    sf = scale.float().unsqueeze(-1)
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    return torch.round((g - zf) * inv).clamp_(0, top), scale, zero, zf


def quantize(
    x: torch.Tensor,
    group_size: int | None = None,
    clip_ratio: torch.Tensor | float | None = None,
    bits: int = 2,
    symmetric: bool = False,
) -> QuantRows:
    """Quantize ``x[..., d]`` to rows of ``bits``-bit codes (``symmetric``: scale only, zero implied).

    ``clip_ratio`` is a float or a tensor broadcastable to ``x.shape[:-1] + (d // G,)``
    (one ratio per row-group; e.g. shape ``[kv_heads, 1]`` for one level per head).
    """
    codes, scale, zero, _ = _codes(x, group_size, clip_ratio, bits, symmetric)
    return QuantRows(pack(codes.reshape(x.shape), bits), scale, zero, bits)


def dequantize(q: QuantRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``x_hat[..., d] = zero + code * scale`` for every element."""
    codes = unpack(q.codes, q.bits).float()
    g = _grouped(codes, q.group_size)
    x = q.zero_f32().unsqueeze(-1) + g * q.scale.float().unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    group_size: int | None = None,
    clip_ratio: torch.Tensor | float | None = None,
    bits: int = 2,
    symmetric: bool = False,
) -> torch.Tensor:
    """Round trip through the format, returned in ``x``'s dtype (for simulation and error reports).

    The values :func:`dequantize` reads back from :func:`quantize`'s rows, bit for bit, without packing
    the codes into bytes and out again (the calibration's clip search calls this thousands of times).
    """
    codes, scale, _, zf = _codes(x, group_size, clip_ratio, bits, symmetric)
    return (zf + codes * scale.float().unsqueeze(-1)).reshape(x.shape).to(x.dtype)
