"""The per-layer pool tensors the kernels read and write (the pool layout contract).

A :class:`LayerStore` holds one layer's INT2 rows and its BF16 side pool; a
:class:`DeviceRotation` holds one layer's rotation state.  The SGLang pool owns
the tensors; these classes only name them (building one is free, no copies).

INT2 rows (format of ``oscar_sglang.format``), per slot and KV head::

    k_codes, v_codes  uint8 [num_slots, kv_heads, d // 4]
    k_scale, k_zero   fp16  [num_slots, kv_heads, d // G]    (v_scale, v_zero likewise)

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
    """One layer's INT2 rows, BF16 side pool and the shared ``hot_index``."""

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
        return self.k_codes.shape[2] * fmt.CODES_PER_BYTE

    @property
    def group_size(self) -> int:
        return self.head_dim // self.k_scale.shape[2]

    def clone(self) -> "LayerStore":
        """A deep copy (tests and benchmarks)."""
        return LayerStore(**{f: getattr(self, f).clone() for f in self.__dataclass_fields__})

    def check(self) -> None:
        """Raise ``ValueError`` naming the first tensor that breaks the layout."""
        n, h, d = self.num_slots, self.kv_heads, self.head_dim
        ng = self.k_scale.shape[-1]
        if ng == 0 or d % ng:
            raise ValueError(f"k_scale has {ng} groups per row, which does not divide head_dim {d}")
        fmt.check_shape(d, d // ng)
        want = {
            "k_codes": ((n, h, d // 4), torch.uint8), "v_codes": ((n, h, d // 4), torch.uint8),
            "k_scale": ((n, h, ng), torch.float16), "k_zero": ((n, h, ng), torch.float16),
            "v_scale": ((n, h, ng), torch.float16), "v_zero": ((n, h, ng), torch.float16),
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

    k_rot: torch.Tensor
    v_rot: torch.Tensor
    k_mean: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor

    def check(self, kv_heads: int, head_dim: int) -> None:
        h, d = kv_heads, head_dim
        _expect("k_rot", self.k_rot, (h, d, d), torch.float32)
        _expect("v_rot", self.v_rot, (h, d, d), torch.float32)
        _expect("k_mean", self.k_mean, (h, d), torch.float32)
        _expect("k_clip", self.k_clip, (h,), torch.float32)
        _expect("v_clip", self.v_clip, (h,), torch.float32)


def require_contiguous(store: LayerStore, rot: DeviceRotation) -> None:
    """The Triton kernels index the pool and rotation tensors as dense arrays."""
    for obj in (store, rot):
        for name in obj.__dataclass_fields__:
            if not getattr(obj, name).is_contiguous():
                raise ValueError(f"{name} must be contiguous for the Triton kernels")


def triton_unsupported(head_dim: int, group_size: int | None = None) -> str | None:
    """Why the Triton kernels cannot serve this shape, or None when they can.

    All three kernels need a power-of-two ``head_dim >= 64``; the write kernel
    also needs a power-of-two ``group_size`` (pass None to skip that check).
    """
    if head_dim < 64 or head_dim & (head_dim - 1):
        return f"the Triton kernels need a power-of-two head_dim >= 64, got {head_dim}"
    if group_size is not None and (group_size < 4 or group_size & (group_size - 1)):
        return f"the Triton write kernel needs a power-of-two group size, got {group_size}"
    return None


def _expect(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def empty_store(num_slots: int, kv_heads: int, head_dim: int, group_size: int | None = None,
                hot_entries: int = 0, device: torch.device | str = "cpu") -> LayerStore:
    """A zeroed store with every slot cold (``hot_index = -1``); for tests and benchmarks."""
    g = head_dim if group_size is None else group_size
    fmt.check_shape(head_dim, g)
    n, h, d, ng = num_slots, kv_heads, head_dim, head_dim // g

    def z(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return LayerStore(
        k_codes=z(n, h, d // 4, dtype=torch.uint8), k_scale=z(n, h, ng, dtype=torch.float16),
        k_zero=z(n, h, ng, dtype=torch.float16),
        v_codes=z(n, h, d // 4, dtype=torch.uint8), v_scale=z(n, h, ng, dtype=torch.float16),
        v_zero=z(n, h, ng, dtype=torch.float16),
        k_hot=z(hot_entries, h, d, dtype=torch.bfloat16), v_hot=z(hot_entries, h, d, dtype=torch.bfloat16),
        hot_index=torch.full((n,), -1, dtype=torch.int32, device=device),
    )
