"""Entry point ``sglang.srt.plugins: oscar_int2 = oscar_sglang.sglang.plugin:register``.

SGLang runs :func:`register` in every process (launcher, schedulers,
detokenizer) through ``sglang.srt.plugins.load_plugins()``, then applies the
registered hooks.  No SGLang file is patched on disk; every private target
hooked is listed in :data:`HOOKS` (and :data:`RESOLUTION_STEPS`), which
``tests/test_sglang_hooks.py`` checks against the installed SGLang.
"""

from __future__ import annotations

from . import args, compat, memory, metrics

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
POOL_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
REQ_TO_TOKEN_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
METRICS_REPORTER = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter"

# (target, hook, hook type name); the hook types are SGLang's HookType members.
HOOKS = (
    (f"{SERVER_ARGS}.add_cli_args", args.add_cli_args, "AFTER"),
    (f"{SERVER_ARGS}.from_cli_args", args.from_cli_args, "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype", memory.configure_kv_cache_dtype, "AROUND"),
    (f"{POOL_CONFIGURATOR}._compute_cell_size", memory.compute_cell_size, "AROUND"),
    (f"{POOL_CONFIGURATOR}.calculate_pool_sizes", memory.calculate_pool_sizes, "AROUND"),
    (f"{KV_CONFIGURATOR}._profile_available_bytes", memory.profile_available_bytes, "AROUND"),
    (f"{KV_CONFIGURATOR}._build_mha_kv_pool", memory.build_mha_kv_pool, "AROUND"),
    (f"{KV_CONFIGURATOR}.configure", memory.check_pool_and_log, "AFTER"),
    (f"{REQ_TO_TOKEN_POOL}.free_rows", memory.end_requests, "BEFORE"),
    (f"{REQ_TO_TOKEN_POOL}.clear", memory.flush_requests, "AFTER"),
    ("sglang.srt.models.utils.enable_fused_set_kv_buffer", compat.no_fused_kv_write, "AROUND"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", compat.refuse_empty_prompt,
     "BEFORE"),
    (f"{METRICS_REPORTER}.report_decode_stats", metrics.report_decode_stats, "AFTER"),
)

# Server-argument resolution steps wrapped through SGLang's register_resolution_hook.
RESOLUTION_STEPS = (
    ("handle_cuda_graph_config", args.limit_cuda_graphs),
    ("handle_attention_backend_compatibility", args.select_attention_backend),
)

_registered = False


def register() -> None:
    """Register the hooks, the resolution steps and the ``oscar_int2`` attention backend (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .settings import BACKEND_NAME

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
    for step, wrapper in RESOLUTION_STEPS:
        register_resolution_hook(step)(wrapper)
    register_attention_backend(BACKEND_NAME)(_create_backend)
    add_attention_backend_choices([BACKEND_NAME])
    _registered = True


def _create_backend(model_runner):
    """Imported lazily: the backend module pulls in SGLang's attention stack."""
    from .backend import create_backend

    return create_backend(model_runner)
