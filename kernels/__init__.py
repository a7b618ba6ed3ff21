"""Triton kernels for the quantized KV cache (INT2 rows; INT4/INT8 keys or values per layer), each beside
a plain-torch reference.

Entry points (dispatching on device) are in :mod:`oscar_sglang.kernels.api`;
the pool tensors they take are named in :mod:`oscar_sglang.kernels.layout`.
See docs/KERNELS.md.
"""

from .api import decode_attention, extend_attention, write_kv
from .layout import DeviceRotation, LayerStore, empty_store

__all__ = ["DeviceRotation", "LayerStore", "decode_attention", "empty_store", "extend_attention", "write_kv"]
