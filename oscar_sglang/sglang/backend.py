"""The ``oscar_int2`` attention backend: attention over the INT2 pool in rotated space.

Per forward pass, :meth:`OscarInt2AttnBackend.init_forward_metadata` updates
the hot side pool once for all layers (which new tokens get BF16 copies,
which slots left their recent window).  Per layer:

* every new token goes through the write path (rotate, clip, quantize, pack,
  store, BF16 copy where hot);
* queries are rotated once (``q' = q R_K``), scores and the weighted sum are
  taken against the stored rotated rows (BF16 where hot, INT2 elsewhere), and
  the output is de-rotated once (``o = o' R_V^T``);
* extend (prefill) attends to the exact new tokens plus the cached prefix as
  stored.

The numerics are those of ``oscar_sglang.kernels``: the Triton kernels on
CUDA, the plain-torch reference on CPU (``pool.kernel_backend``, "auto" by
default).  The host-side lengths SGLang already holds bound the kernels'
grids, so no pass synchronises on device lengths.  CUDA graphs are not
supported yet; the plugin disables them with this backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from oscar_sglang.kernels import api as kernels

from .pool import OscarInt2Pool


_EXTEND_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)


@dataclass
class ForwardMetadata:
    """Per-pass state shared by all layers."""

    hot_loc: torch.Tensor            # [new tokens] hot entry or -1
    prefix_lens: torch.Tensor | None  # [batch] extend only, on the device
    extend_lens: torch.Tensor | None  # [batch] extend only, on the device
    max_len: int                      # longest sequence (decode) or extension (extend), from host lists
    max_prefix: int = 0               # longest cached prefix (extend), from host lists: lets extend split it


class OscarInt2AttnBackend(AttentionBackend):
    """Extend and decode attention over :class:`OscarInt2Pool`."""

    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarInt2Pool):
            raise RuntimeError(f"the oscar_int2 attention backend needs --kv-cache-dtype oscar-int2 "
                               f"(the KV pool is a {type(pool).__name__})")
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = model_runner.device
        self.forward_metadata = None
        self._checked_layers: set[int] = set()

    # -- per pass -------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        """Once per pass: the hot side pool's update, from SGLang's device tensors (no loop, no sync)."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_decode():
            plan_seq = forward_batch.seq_lens
            plan_prefix = plan_seq - 1                       # one new token per request
            prefix_t = extend_t = None
            max_len = _host_max(forward_batch.seq_lens_cpu, plan_seq)
            max_prefix = 0
        elif mode in _EXTEND_MODES:
            prefix_t, extend_t = forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
            plan_prefix, plan_seq = prefix_t, prefix_t + extend_t
            max_len = _host_max(forward_batch.extend_seq_lens_cpu, extend_t)
            max_prefix = _host_max(forward_batch.extend_prefix_lens_cpu, prefix_t)
        else:
            raise NotImplementedError(f"the oscar_int2 attention backend does not serve forward mode {mode.name}")
        hot_loc = self.pool.begin_pass(forward_batch.out_cache_loc, forward_batch.req_pool_indices, plan_prefix,
                                       plan_seq, self.req_to_token, decode=mode.is_decode())
        self.forward_metadata = ForwardMetadata(hot_loc, prefix_t, extend_t, max_len, max_prefix)

    # -- per layer ------------------------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer)
        q3, k3, v3 = self._shape(q, k, v, layer)
        self._save(layer, forward_batch, k3, v3, save_kv_cache)
        store, rot = self.pool.layer(layer.layer_id)
        md = self.forward_metadata
        o = kernels.extend_attention(q3, k3, v3, store, rot, self.req_to_token, forward_batch.req_pool_indices,
                                     md.prefix_lens, md.extend_lens, layer.scaling,
                                     backend=self.pool.kernel_backend, max_extend_len=md.max_len,
                                     max_prefix_len=md.max_prefix)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer)
        q3, k3, v3 = self._shape(q, k, v, layer)
        self._save(layer, forward_batch, k3, v3, save_kv_cache)
        store, rot = self.pool.layer(layer.layer_id)
        o = kernels.decode_attention(q3, store, rot, self.req_to_token, forward_batch.req_pool_indices,
                                     forward_batch.seq_lens, layer.scaling, backend=self.pool.kernel_backend,
                                     max_seq_len=self.forward_metadata.max_len)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def support_triton(self):
        return False

    # -- helpers --------------------------------------------------------------

    def _save(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache:
            self.pool.write(layer.layer_id, forward_batch.out_cache_loc, k, v, self.forward_metadata.hot_loc)

    @staticmethod
    def _shape(q, k, v, layer):
        if k is None or v is None:
            raise NotImplementedError("the oscar_int2 attention backend needs the new tokens' K and V")
        d = layer.qk_head_dim
        return (q.reshape(-1, layer.tp_q_head_num, d), k.reshape(-1, layer.tp_k_head_num, d),
                v.reshape(-1, layer.tp_v_head_num, d))

    def _check_layer(self, layer) -> None:
        if layer.layer_id in self._checked_layers:
            return
        problems = []
        if layer.qk_head_dim != layer.v_head_dim:
            problems.append("different K and V head dims")
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            problems.append("non-causal or cross attention")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            problems.append("sliding-window attention")
        if layer.logit_cap and layer.logit_cap > 0:
            problems.append("attention logit soft-capping")
        if problems:
            raise NotImplementedError(f"the oscar_int2 attention backend does not support layer {layer.layer_id}: "
                                      + ", ".join(problems))
        self._checked_layers.add(layer.layer_id)


def _host_max(host, device_tensor: torch.Tensor) -> int:
    """Largest length from SGLang's host copy (a list or CPU tensor); the device tensor (a sync) only without one."""
    if host is None:
        host = device_tensor
    if isinstance(host, torch.Tensor):
        return int(host.max()) if host.numel() else 0
    return max(host, default=0)


def create_backend(model_runner) -> OscarInt2AttnBackend:
    """Factory registered with SGLang's attention registry."""
    return OscarInt2AttnBackend(model_runner)
