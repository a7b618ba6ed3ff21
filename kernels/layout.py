"""The per-layer pool tensors the kernels read and write (the pool layout contract).

A :class:`LayerStore` holds one layer's quantized rows and its BF16 side pool; a
:class:`DeviceRotation` holds one layer's rotation state.  The SGLang pool owns
the tensors; these classes only name them (building one is free, no copies).

Quantized rows (format of ``oscar_sglang.format``), per slot and KV head; keys
and values each have their own format (``bits`` b in {2, 4, 8}, group ``G``),
read off the tensor shapes (:attr:`LayerStore.k_format`, :attr:`LayerStore.v_format`)::

    k_codes           uint8 [num_slots, kv_heads, d * b_K // 8]
    k_scale, k_zero   fp16  [num_slots, kv_heads, d // G_K]
    v_codes           uint8 [num_slots, kv_heads, d * b_V // 8]
    v_scale, v_zero   fp16  [num_slots, kv_heads, d // G_V]

Symmetric rows (``RowFormat(..., symmetric=True)``) store no zero: their
``k_zero``/``v_zero`` are ``[num_slots, kv_heads, 0]`` (that empty last
dimension is how a store says its rows are symmetric).

The references take any such format; the Triton kernels need a power-of-two
``d >= 64`` and groups ``G >= 4`` (:func:`triton_unsupported`).

Hot side pool (rotated rows ``k' = (k - mu) R_K``, ``v' = v R_V``, unclipped)::

    k_hot, v_hot      bf16  [hot_entries, kv_heads, d]
    hot_index         int32 [num_slots]   entry of the slot or -1 (shared by all layers)

Rotation state (rows rotate on the right, ``x' = x @ R``)::

    k_rot, v_rot      fp32 [kv_heads, d, d]
    k_mean            fp32 [kv_heads, d]
    k_clip, v_clip    fp32 [kv_heads]    clip ratios in (0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_sglang import format as fmt


@dataclass(frozen=True)
class LayerStore:
    """One layer's quantized rows, BF16 side pool and the shared ``hot_index``.

    The row formats of keys and values (:attr:`k_format`, :attr:`v_format`)
    follow from the shapes: ``head_dim`` from the side pool's rows, the bits
    from the codes' width, the group from the number of scales.
    """

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_hot: torch.Tensor
    v_hot: torch.Tensor
    hot_index: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.k_codes.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_hot.shape[2]

    @property
    def k_format(self) -> fmt.RowFormat:
        return _format_of(self.k_codes, self.k_scale, self.k_zero, self.head_dim, "k")

    @property
    def v_format(self) -> fmt.RowFormat:
        return _format_of(self.v_codes, self.v_scale, self.v_zero, self.head_dim, "v")

    def row_args(self) -> tuple[torch.Tensor, ...]:
        """``k_codes, k_scale, k_zero, v_codes, v_scale, v_zero`` as the kernels take them: a symmetric side's
        (empty) zero is replaced by its scale, a valid pointer the kernel never reads."""
        kz = self.k_scale if self.k_zero.shape[-1] == 0 else self.k_zero
        vz = self.v_scale if self.v_zero.shape[-1] == 0 else self.v_zero
        return self.k_codes, self.k_scale, kz, self.v_codes, self.v_scale, vz

    def clone(self) -> "LayerStore":
        """A deep copy (tests and benchmarks)."""
        return LayerStore(**{f: getattr(self, f).clone() for f in self.__dataclass_fields__})

    def check(self) -> None:
        """Raise ``ValueError`` naming the first tensor that breaks the layout."""
        n, h, d = self.num_slots, self.kv_heads, self.head_dim
        kf, vf = self.k_format, self.v_format
        kg, vg = d // kf.group, d // vf.group
        want = {
            "k_codes": ((n, h, d * kf.bits // 8), torch.uint8), "v_codes": ((n, h, d * vf.bits // 8), torch.uint8),
            "k_scale": ((n, h, kg), torch.float16), "k_zero": ((n, h, 0 if kf.symmetric else kg), torch.float16),
            "v_scale": ((n, h, vg), torch.float16), "v_zero": ((n, h, 0 if vf.symmetric else vg), torch.float16),
            "hot_index": ((n,), torch.int32),
        }
        for name, (shape, dtype) in want.items():
            _expect(name, getattr(self, name), shape, dtype)
        e = self.k_hot.shape[0]
        _expect("k_hot", self.k_hot, (e, h, d), torch.bfloat16)
        _expect("v_hot", self.v_hot, (e, h, d), torch.bfloat16)


@dataclass(frozen=True)
class DeviceRotation:
    """One layer's rotations, key mean and clip ratios per KV head, as the kernels read them (float32,
    contiguous, on the pool's device); built by the pool from the artifacts' ``artifacts.LayerRotation``."""

    k_rot: torch.Tensor  # write-path key matrix R_K diag(s): stored key rows are (k - k_mean) @ k_rot
    v_rot: torch.Tensor
    k_mean: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    q_rot: torch.Tensor | None = None  # read-path query matrix R_K diag(1/s); None: k_rot (no key scaling)

    def __post_init__(self):
        if self.q_rot is None:
            object.__setattr__(self, "q_rot", self.k_rot)  # frozen dataclass

    def check(self, kv_heads: int, head_dim: int) -> None:
        h, d = kv_heads, head_dim
        _expect("k_rot", self.k_rot, (h, d, d), torch.float32)
        _expect("q_rot", self.q_rot, (h, d, d), torch.float32)
        _expect("v_rot", self.v_rot, (h, d, d), torch.float32)
        _expect("k_mean", self.k_mean, (h, d), torch.float32)
        _expect("k_clip", self.k_clip, (h,), torch.float32)
        _expect("v_clip", self.v_clip, (h,), torch.float32)


def require_contiguous(*objs: LayerStore | DeviceRotation) -> None:
    """The Triton kernels index the pool and rotation tensors as dense arrays."""
    for obj in objs:
        for name in obj.__dataclass_fields__:
            if not getattr(obj, name).is_contiguous():
                raise ValueError(f"{name} must be contiguous for the Triton kernels")


def triton_unsupported(head_dim: int, *formats: fmt.RowFormat | int | None) -> str | None:
    """Why the Triton kernels cannot serve rows of this shape and these formats, or None when they can.

    All three kernels need a power-of-two ``head_dim >= 64``.  Each of
    ``formats`` (a :class:`~oscar_sglang.format.RowFormat`, e.g. a store's
    ``k_format`` and ``v_format``; an int is an INT2 group size, the pool's
    older form; None is skipped) must have 2, 4 or 8 bits and a group size
    ``G`` dividing ``head_dim`` with ``G >= 4``, i.e. a power of two >= 4: the
    kernels handle rows in words of four consecutive codes, which must not
    straddle two groups.
    """
    if head_dim < 64 or head_dim & (head_dim - 1):
        return f"the Triton kernels need a power-of-two head_dim >= 64, got {head_dim}"
    for f in formats:
        if f is None:
            continue
        if isinstance(f, int) and not isinstance(f, bool):
            f = fmt.RowFormat(2, f) if f > 0 else None
        if not isinstance(f, fmt.RowFormat):
            return f"the Triton kernels need positive group sizes, got {f!r}"
        g = f.group_for(head_dim)
        if g < 4 or g & (g - 1) or head_dim % g:
            return (f"the Triton kernels need a power-of-two group size >= 4 dividing head_dim {head_dim}, "
                    f"got {g} ({f.name(head_dim)})")
    return None


def _format_of(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, d: int, which: str) -> fmt.RowFormat:
    width, ng = codes.shape[-1], scale.shape[-1]
    if d <= 0 or (8 * width) % d or (8 * width) // d not in fmt.BITS:
        raise ValueError(f"{which}_codes rows of {width} bytes do not hold {d} codes of {fmt.BITS} bits")
    if ng == 0 or d % ng:
        raise ValueError(f"{which}_scale has {ng} groups per row, which does not divide head_dim {d}")
    if zero.shape[-1] not in (0, ng):
        raise ValueError(f"{which}_zero has {zero.shape[-1]} groups per row: {ng} (as the scale) or 0 (symmetric)")
    return fmt.RowFormat(8 * width // d, d // ng, zero.shape[-1] == 0).resolved(d)


def _expect(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def row_tensors(num_slots: int, kv_heads: int, head_dim: int, form: fmt.RowFormat,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Zeroed ``codes, scale, zero`` of one side (K or V) of one layer in ``form``."""
    f = form.resolved(head_dim)
    n, h, d = num_slots, kv_heads, head_dim
    codes = torch.zeros(n, h, d * f.bits // 8, dtype=torch.uint8, device=device)
    scale = torch.zeros(n, h, d // f.group, dtype=torch.float16, device=device)
    zero = torch.zeros(n, h, 0 if f.symmetric else d // f.group, dtype=torch.float16, device=device)
    return codes, scale, zero


def empty_store(num_slots: int, kv_heads: int, head_dim: int, group_size: int | None = None,
                hot_entries: int = 0, device: torch.device | str = "cpu", *,
                k_format: fmt.RowFormat | None = None, v_format: fmt.RowFormat | None = None) -> LayerStore:
    """A zeroed store with every slot cold (``hot_index = -1``); for tests and benchmarks.

    ``k_format``/``v_format`` default to INT2 rows with ``group_size`` (None: one group per row).
    """
    kf = k_format or fmt.RowFormat(2, group_size)
    vf = v_format or fmt.RowFormat(2, group_size)
    n, h, d = num_slots, kv_heads, head_dim
    k_codes, k_scale, k_zero = row_tensors(n, h, d, kf, device)
    v_codes, v_scale, v_zero = row_tensors(n, h, d, vf, device)
    return LayerStore(
        k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes, v_scale=v_scale, v_zero=v_zero,
        k_hot=torch.zeros(hot_entries, h, d, dtype=torch.bfloat16, device=device),
        v_hot=torch.zeros(hot_entries, h, d, dtype=torch.bfloat16, device=device),
        hot_index=torch.full((n,), -1, dtype=torch.int32, device=device),
    )
