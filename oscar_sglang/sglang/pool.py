"""The INT2 token-to-KV pool that replaces SGLang's MHA pool under ``--kv-cache-dtype oscar-int2``.

Layout (the contract the kernels are written against, see
``oscar_sglang.kernels.layout``), per layer, ``num_slots = size + page_size``,
keys and values each in the layer's row format (bits b, group G) from the
artifact (INT2 with one group per row unless it carries a precision policy)::

    k_codes, v_codes           uint8 [num_slots, kv_heads, d * b / 8]
    k_scale, k_zero, v_scale, v_zero
                               fp16  [num_slots, kv_heads, d / G]
    k_hot, v_hot               bf16  [hot_entries, kv_heads, d]   rotated, unclipped rows
    hot_index                  int32 [num_slots]                  shared by all layers
    k_rot, v_rot               fp32  [kv_heads, d, d]             k_rot = R_K diag(s) (key write)
    q_rot                      fp32  [kv_heads, d, d]             R_K diag(1/s) (query read)
    k_mean                     fp32  [kv_heads, d]
    k_clip, v_clip             fp32  [kv_heads]

Every written token goes through the write path (rotate, clip, quantize,
pack, store); tokens the forward pass marked hot also get BF16 copies.  The
pool has no dense K/V buffers: only the ``oscar_int2`` attention backend reads it.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.memory_pool import KVCache, unwrap_write_loc

from oscar_sglang.kernels import api as kernels
from oscar_sglang.kernels.layout import DeviceRotation, LayerStore, row_tensors

from . import sizing
from .hot import HotSet
from .settings import ServingConfig

logger = logging.getLogger(__name__)

# "auto": the Triton kernels on CUDA, the plain-torch reference on CPU (same numerics, tested equal).
KERNEL_BACKEND = "auto"


class OscarInt2Pool(KVCache):
    """INT2 rows per slot, a BF16 hot side pool, and each layer's rotation state, on the pool's device."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, config: ServingConfig, hot_requests: int | None = None,
                 start_layer: int | None = None, end_layer: int | None = None):
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver=False,
                         start_layer=start_layer, end_layer=end_layer, allocation_label="oscar-int2")
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, head_dim
        self.config = config
        self.kernel_backend = KERNEL_BACKEND  # oscar_sglang.kernels.api backend: auto | torch | triton
        self.layer_formats = config.layer_formats[self.start_layer:self.start_layer + layer_num]
        reason = kernels.triton_unsupported(head_dim, *{f for lf in self.layer_formats for f in (lf.k, lf.v)})
        if reason and torch.device(device).type == "cuda":
            logger.warning("oscar-int2: %s; serving with the plain-torch path (slow)", reason)
            self.kernel_backend = "torch"
        self.num_slots = size + page_size
        # requests whose windows the side pool holds (default: the setting; the server passes it capped)
        self.hot_requests = config.hot_requests if hot_requests is None else hot_requests
        hot = sizing.hot_plan(self.hot_requests, config.sink, config.recent, size)
        self.hot = HotSet(self.num_slots, hot.sink_entries, hot.recent_entries, config.sink, config.recent, device)
        self._allocate(layer_num)
        self.rotations = [self._rotation(config, self.start_layer + i) for i in range(layer_num)]
        self._finalize_allocation_log(size)

    def _allocate(self, layers: int) -> None:
        """Each layer's rows in its own formats (one allocation per layer and tensor), the hot rows stacked."""
        n, h, d, e = self.num_slots, self.head_num, self.head_dim, self.hot.entries
        self.k_hot, self.v_hot = (torch.zeros(layers, e, h, d, dtype=torch.bfloat16, device=self.device)
                                  for _ in range(2))
        self.stores = []
        for i, lf in enumerate(self.layer_formats):
            k = row_tensors(n, h, d, lf.k, self.device)
            v = row_tensors(n, h, d, lf.v, self.device)
            self.stores.append(LayerStore(*k, *v, self.k_hot[i], self.v_hot[i], self.hot.hot_index))

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's quantized K and V rows over this pool's layers (the cell SGLang sizes by)."""
        return sizing.rows_bytes_per_token(self.layer_formats, self.head_num, self.head_dim)

    def _rotation(self, config: ServingConfig, layer_id: int) -> DeviceRotation:
        src = config.artifacts.layers[layer_id].to(self.device, torch.float32)
        rot = DeviceRotation(src.k_transform.contiguous(), src.v_rotation.contiguous(), src.k_mean.contiguous(),
                             src.k_clip.contiguous(), src.v_clip.contiguous(), src.q_transform.contiguous())
        rot.check(self.head_num, self.head_dim)
        return rot

    def attach_requests(self, req_to_token_pool) -> None:
        """Follow SGLang's request rows: their lengths per pass, and their end (``free_rows``) and flush (``clear``).

        The plugin's hooks on ``ReqToTokenPool.free_rows``/``clear`` find this
        pool through the attribute set here (one pool per scheduler process).
        """
        self.hot.track_requests(req_to_token_pool.req_to_token.shape[0])
        req_to_token_pool.oscar_pool = self

    def end_requests(self, rows, req_to_token: torch.Tensor) -> None:
        """Request rows being freed: their windows' BF16 entries go out of window (``HotSet.end_requests``)."""
        self.hot.end_requests(rows, req_to_token)

    @property
    def hot_index(self) -> torch.Tensor:
        return self.hot.hot_index

    def layer(self, layer_id: int) -> tuple[LayerStore, DeviceRotation]:
        """The store and rotation state of a model layer (global layer id)."""
        i = layer_id - self.start_layer
        return self.stores[i], self.rotations[i]

    def begin_pass(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                   seq_lens: torch.Tensor, req_to_token: torch.Tensor, *, decode: bool = False,
                   live: torch.Tensor | None = None) -> torch.Tensor:
        """Update the hot side pool for one forward pass (all layers); returns ``hot_loc`` per new token.

        Request ``b`` (row ``req_pool_indices[b]`` of ``req_to_token``) grows
        from ``prefix_lens[b]`` to ``seq_lens[b]`` tokens (``[batch]`` device
        tensors, e.g. SGLang's ``extend_prefix_lens`` and ``seq_lens``); its new
        tokens are at ``out_cache_loc``, in request order (``decode``: one per
        request; ``live``: which rows are not a CUDA graph's padding).  Tensor
        ops only: no loop over requests, no device sync (``HotSet.begin_pass``).
        """
        return self.hot.begin_pass(out_cache_loc, req_pool_indices, prefix_lens, seq_lens, req_to_token,
                                   decode=decode, live=live)

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              hot_loc: torch.Tensor | None) -> None:
        """Write path for one layer: ``k, v [n, kv_heads, d]`` at slots ``loc``; BF16 copies where ``hot_loc >= 0``.

        ``hot_index`` must already be updated for this pass (``HotSet.update``).
        """
        store, rot = self.layer(layer_id)
        k = k.reshape(-1, self.head_num, self.head_dim)
        v = v.reshape(-1, self.head_num, self.head_dim)
        kernels.write_kv(k, v, loc, store, rot, hot_loc, backend=self.kernel_backend)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs) -> None:
        """SGLang's generic write door: a cold write (INT2 only); the slots drop any old BF16 copy."""
        loc = unwrap_write_loc(loc)[0]
        self.hot.release(loc)
        self.write(layer.layer_id, loc, cache_k, cache_v, None)

    def _no_dense_buffer(self, *_):
        raise RuntimeError("the oscar-int2 pool stores INT2 rows and has no dense K/V buffer; "
                           "it is read only by the oscar_int2 attention backend")

    get_key_buffer = get_value_buffer = get_kv_buffer = _no_dense_buffer

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """Bytes of the K side and of the V side (quantized rows plus hot rows)."""
        def nbytes(*ts):
            return sum(t.numel() * t.element_size() for t in ts)

        k = nbytes(self.k_hot, *(t for st in self.stores for t in (st.k_codes, st.k_scale, st.k_zero)))
        v = nbytes(self.v_hot, *(t for st in self.stores for t in (st.v_codes, st.v_scale, st.v_zero)))
        return k, v
