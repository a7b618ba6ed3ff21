"""Hooks on SGLang's KV-cache setup: dtype, pool sizing, pool construction, startup log.

All of them act only when the runner's KV dtype string is ``oscar-int2``:

* ``kv_cache_dtype.configure_kv_cache_dtype`` (around): ``oscar-int2`` keeps
  the model dtype as the compute dtype and the string as the cache's name.
* ``DefaultPoolConfigurator._compute_cell_size`` (around): bytes per token of
  the INT2 pool, so SGLang's capacity is INT2 capacity.  This is where the
  artifacts are first loaded and validated in each scheduler (against
  SGLang's own model config).
* ``DefaultPoolConfigurator.calculate_pool_sizes`` (around): the hot side
  pool is a fixed allocation (``hot_requests`` windows); its bytes come off
  the budget before SGLang divides by the cell size.
* ``KVCacheConfigurator._profile_available_bytes`` (around, any dtype): a
  fixed budget from ``OSCAR_SGLANG_KV_BUDGET_BYTES`` when set (benchmarks).
* ``KVCacheConfigurator._build_mha_kv_pool`` (around): builds the INT2 pool.
* ``KVCacheConfigurator.configure`` (after): refuses any other pool (MLA,
  hybrid, sliding-window models), attaches the INT2 pool to SGLang's request
  rows, warns when SGLang may run more requests than the hot side pool holds
  windows for, and logs the one-line summary.
* ``ReqToTokenPool.free_rows`` (before) and ``ReqToTokenPool.clear`` (after):
  a request row freed (finished, aborted, retracted) puts its window's BF16
  entries out of window, first to be reused (``HotSet.end_requests``); a
  cache flush frees every entry.
"""

from __future__ import annotations

import logging

from . import compat, sizing
from .settings import KV_CACHE_DTYPE, OscarConfigError, kv_budget_bytes, serving_config

logger = logging.getLogger(__name__)


def configure_kv_cache_dtype(original, *args, **kwargs):
    """Around ``configure_kv_cache_dtype``: ``oscar-int2`` -> (``"oscar-int2"``, model dtype)."""
    if kwargs.get("server_args_kv_cache_dtype") != KV_CACHE_DTYPE:
        return original(*args, **kwargs)
    if kwargs.get("is_draft_worker"):
        raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} does not support speculative decoding yet")
    return KV_CACHE_DTYPE, kwargs["model_dtype"]


def _is_oscar(kvc) -> bool:
    return getattr(kvc, "kv_cache_dtype_str", None) == KV_CACHE_DTYPE


def _kv_heads(kvc) -> int:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return kvc.model_config.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size)


def _serving(kvc):
    """The validated serving config for this rank's KV heads, after checking the model shape the pool supports."""
    from sglang.srt.runtime_context import get_parallel

    if kvc.use_mla_backend:
        raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} supports MHA/GQA models, not MLA")
    compat.check_model(kvc.model_config.hf_config)
    parallel = get_parallel()
    if parallel.attn_dcp_size > 1:
        raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} does not support decode context parallelism")
    cfg = serving_config(kvc.model_config.hf_config).for_rank(parallel.attn_tp_size, parallel.attn_tp_rank)
    if _kv_heads(kvc) != cfg.artifacts.layers[0].k_rotation.shape[0]:
        raise OscarConfigError(f"this tensor-parallel rank holds {_kv_heads(kvc)} KV heads but the rotations "
                               f"slice for it has {cfg.artifacts.layers[0].k_rotation.shape[0]}")
    return cfg


def hot_requests(cfg) -> int:
    """Requests the hot side pool is sized for: the setting, capped by --max-running-requests if given."""
    from sglang.srt.runtime_context import get_schedule

    limit = get_schedule().max_running_requests
    return cfg.hot_requests if limit is None else min(cfg.hot_requests, limit)


def compute_cell_size(original, self, kvc, num_layers):
    """Around ``DefaultPoolConfigurator._compute_cell_size``: the quantized rows' bytes per token (each layer
    in its format); notes the hot pool's bytes."""
    if not _is_oscar(kvc):
        return original(self, kvc, num_layers)
    cfg = _serving(kvc)
    h, d = _kv_heads(kvc), kvc.model_config.head_dim
    self.oscar_hot_bytes = sizing.hot_plan(hot_requests(cfg), cfg.sink, cfg.recent).nbytes(num_layers, h, d)
    return sizing.rows_bytes_per_token(_served_formats(kvc, cfg, num_layers), h, d)


def _served_formats(kvc, cfg, num_layers: int) -> list:
    """The formats of the layers this process serves (all of them, or a pipeline stage's share)."""
    info = getattr(kvc, "layer_info", None)
    start = getattr(info, "start_layer", 0) or 0
    return cfg.layer_formats[start:start + num_layers]


def calculate_pool_sizes(original, self, available_bytes, page_size):
    """Around ``DefaultPoolConfigurator.calculate_pool_sizes``: the hot side pool comes off the budget first."""
    hot = getattr(self, "oscar_hot_bytes", 0)
    if hot and available_bytes <= hot:
        raise OscarConfigError(f"the KV memory budget ({available_bytes / 2**20:.0f} MiB) does not even hold the "
                               f"BF16 hot side pool ({hot / 2**20:.0f} MiB); lower --oscar-hot-requests, "
                               "--oscar-sink or --oscar-recent, or raise --mem-fraction-static")
    return original(self, available_bytes - hot, page_size)


def profile_available_bytes(original, self, *args, **kwargs):
    """Around ``KVCacheConfigurator._profile_available_bytes``: a fixed budget when the benchmark sets one."""
    budget = kv_budget_bytes()
    if budget is None:
        return original(self, *args, **kwargs)
    logger.info("oscar-sglang: KV memory budget fixed at %d bytes by the environment", budget)
    return budget


def build_mha_kv_pool(original, self, *, max_total_num_tokens, mha_pool_class, quant_method=None):
    """Around ``KVCacheConfigurator._build_mha_kv_pool``: the INT2 pool instead of the BF16 one."""
    if not _is_oscar(self):
        return original(self, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class,
                        quant_method=quant_method)
    from .pool import OscarInt2Pool

    if self.is_draft_worker:
        raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} does not support speculative decoding yet")
    mc = self.model_config
    cfg = _serving(self)
    if mc.head_dim != mc.v_head_dim:
        raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} needs equal K and V head dims")
    return OscarInt2Pool(
        max_total_num_tokens, page_size=self.pool_page_size, dtype=self.kv_cache_dtype,
        head_num=_kv_heads(self), head_dim=mc.head_dim, layer_num=self.layer_info.num_effective_layers,
        device=self.device, config=cfg, hot_requests=hot_requests(cfg),
        start_layer=self.layer_info.start_layer, end_layer=self.layer_info.end_layer,
    )


def check_pool_and_log(result, self, *args, **kwargs):
    """After ``KVCacheConfigurator.configure``: the pool must be the INT2 pool; log the summary line."""
    if not _is_oscar(self):
        return result
    from .pool import OscarInt2Pool

    pool = result.token_to_kv_pool
    if not isinstance(pool, OscarInt2Pool):
        raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} supports standard MHA/GQA models; this model "
                               f"needs SGLang's {type(pool).__name__}")
    pool.attach_requests(result.req_to_token_pool)
    logger.info(summary_line(pool, result.max_total_num_tokens))
    warning = hot_pool_warning(pool.hot_requests, result.max_running_requests)
    if warning:
        logger.warning(warning)
    return result


def hot_pool_warning(hot_requests: int, max_running_requests: int | None) -> str | None:
    """One sentence when SGLang may run more requests at once than the hot side pool holds windows for."""
    if not max_running_requests or hot_requests >= max_running_requests:
        return None
    return (f"oscar-int2: the BF16 hot side pool holds the sink and recent windows of {hot_requests} requests, but "
            f"SGLang may run up to {max_running_requests} at once; beyond {hot_requests}, window tokens are read "
            f"from INT2 (less precise; counted as in-window evictions). Raise --oscar-hot-requests or lower "
            f"--max-running-requests to {hot_requests}")


def end_requests(req_to_token_pool, indices, *args, **kwargs):
    """Before ``ReqToTokenPool.free_rows``: the rows' requests ended; their hot windows go out of window."""
    pool = getattr(req_to_token_pool, "oscar_pool", None)
    if pool is not None and len(indices):
        pool.end_requests(list(indices), req_to_token_pool.req_to_token)


def flush_requests(result, req_to_token_pool, *args, **kwargs):
    """After ``ReqToTokenPool.clear`` (SGLang's cache flush): every hot entry is free again."""
    pool = getattr(req_to_token_pool, "oscar_pool", None)
    if pool is not None:
        pool.hot.reset()
    return result


def _stage_note(pool, cfg) -> str:
    """Which of the model's layers this process serves, for the startup line ("" for all of them)."""
    total, start = cfg.artifacts.model.num_layers, pool.start_layer
    if start == 0 and pool.layer_num == total:
        return ""
    end = start + pool.layer_num - 1
    span = f"layer {start}" if start == end else f"layers {start}-{end}"
    return f", {span} of {total} (this pipeline stage's share)"


def summary_line(pool, capacity_tokens: int) -> str:
    """The startup line: method, bits per element and the layers per format, a pipeline stage's layers, a
    tensor-parallel rank's KV heads, windows, capacity, bytes per token and the hot pool."""
    cfg = pool.config
    layers, h, d = pool.layer_num, pool.head_num, pool.head_dim
    rows = pool.bytes_per_token
    bf16 = sizing.bf16_bytes_per_token(layers, h, d)
    hot_bytes = pool.hot.entries * sizing.hot_bytes_per_entry(layers, h, d)
    return (f"oscar-int2 KV cache: method={cfg.artifacts.method}, {cfg.bits_per_element:.4g} bits/element "
            f"(layers per format: {cfg.artifacts.policy_summary()}){_stage_note(pool, cfg)}{cfg.heads_note()}, "
            f"sink={cfg.sink}, recent={cfg.recent}, "
            f"KV capacity={capacity_tokens} tokens at {rows} B/token (BF16: {bf16} B/token, "
            f"{bf16 / rows:.2f}x), plus a BF16 hot pool of {pool.hot.entries} entries for "
            f"{pool.hot_requests} requests ({hot_bytes / 2**20:.1f} MiB)")
