"""The SGLang internals the plugin hooks still exist with the shapes the hooks rely on.

An SGLang upgrade that moves or reshapes any of them fails here, loudly,
instead of silently serving a BF16 cache (HookRegistry only logs a target it
cannot patch).  The command-line behaviour is checked in a subprocess, since
loading the plugin patches SGLang process-wide.
"""

import importlib.metadata
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sglang = pytest.importorskip("sglang")

from oscar_sglang.sglang import plugin  # noqa: E402

CPU_ENV = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}


def _raw(target: str):
    """The attribute as stored on its owner (staticmethod/classmethod objects unwrapped by hand)."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def test_pinned_sglang_version():
    assert sglang.__version__ == "0.5.23"


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("oscar_int2") == "oscar_sglang.sglang.plugin:register"


@pytest.mark.parametrize("target,hook,kind", plugin.HOOKS, ids=[t for t, _, _ in plugin.HOOKS])
def test_hook_target_exists(target, hook, kind):
    from sglang.srt.plugins.hook_registry import HookType

    assert kind in HookType.__members__
    assert callable(pkgutil.resolve_name(target)), target


def test_hook_target_signatures():
    def params(target):
        raw = _raw(target)
        fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        return inspect.signature(fn).parameters

    assert isinstance(_raw(f"{plugin.SERVER_ARGS}.add_cli_args"), staticmethod)
    assert list(params(f"{plugin.SERVER_ARGS}.add_cli_args")) == ["parser"]
    assert isinstance(_raw(f"{plugin.SERVER_ARGS}.from_cli_args"), classmethod)
    assert list(params(f"{plugin.SERVER_ARGS}.from_cli_args")) == ["cls", "args"]
    p = params("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype")
    assert {"server_args_kv_cache_dtype", "model_dtype", "is_draft_worker"} <= set(p)
    assert all(x.kind is inspect.Parameter.KEYWORD_ONLY for x in p.values())
    assert list(params(f"{plugin.POOL_CONFIGURATOR}._compute_cell_size")) == ["self", "kvc", "num_layers"]
    assert list(params(f"{plugin.POOL_CONFIGURATOR}.calculate_pool_sizes")) == [
        "self", "available_bytes", "page_size"]
    assert list(params(f"{plugin.KV_CONFIGURATOR}._profile_available_bytes")) == ["self", "pre_model_load_memory"]
    p = params(f"{plugin.KV_CONFIGURATOR}._build_mha_kv_pool")
    assert list(p) == ["self", "max_total_num_tokens", "mha_pool_class", "quant_method"]
    assert list(params(f"{plugin.KV_CONFIGURATOR}.configure")) == ["self", "pre_model_load_memory"]
    assert list(params(f"{plugin.REQ_TO_TOKEN_POOL}.free_rows")) == ["self", "indices"]
    assert list(params(f"{plugin.REQ_TO_TOKEN_POOL}.clear")) == ["self"]
    assert list(params(f"{plugin.METRICS_REPORTER}.report_decode_stats"))[:3] == [
        "self", "can_run_cuda_graph", "running_batch"]
    assert list(params("sglang.srt.models.utils.enable_fused_set_kv_buffer")) == ["forward_batch"]


def test_configurator_members_the_hooks_read():
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigResult, KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo

    fields = set(KVCacheConfigurator.__annotations__)
    assert {"kv_cache_dtype_str", "kv_cache_dtype", "model_config", "device", "is_draft_worker",
            "use_mla_backend", "layer_info"} <= fields
    assert isinstance(inspect.getattr_static(KVCacheConfigurator, "pool_page_size"), property)
    assert {"token_to_kv_pool", "max_total_num_tokens", "req_to_token_pool", "max_running_requests"} <= set(
        KVCacheConfigResult.__struct_fields__)
    assert {"start_layer", "end_layer", "num_effective_layers"} <= set(ModelLayerInfo.__struct_fields__)


def test_resolution_steps_are_overridable():
    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

    for step, _ in plugin.RESOLUTION_STEPS:
        assert step in _OVERRIDABLE_HOOKS


def test_public_extension_points_and_base_classes():
    from sglang.srt.arg_groups import choices
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view  # noqa: F401
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVCache, unwrap_write_loc  # noqa: F401
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import get_parallel  # noqa: F401

    assert callable(choices.add_attention_backend_choices)
    assert callable(attention_registry.register_attention_backend)
    for name in ("init_forward_metadata", "forward_extend", "forward_decode"):
        assert callable(getattr(AttentionBackend, name))
    for name in ("get_key_buffer", "get_value_buffer", "get_kv_buffer", "set_kv_buffer"):
        assert name in KVCache.__abstractmethods__
    assert {"EXTEND", "MIXED", "DECODE", "IDLE"} <= set(ForwardMode.__members__)
    assert AttentionType.DECODER.value == "decoder"
    assert {"out_cache_loc", "req_pool_indices", "seq_lens", "seq_lens_cpu", "extend_prefix_lens_cpu",
            "extend_seq_lens_cpu"} <= set(ForwardBatch.__dataclass_fields__)


def test_glue_helpers_import_no_sglang():
    code = ("import sys, oscar_sglang.sglang.settings, oscar_sglang.sglang.hot, oscar_sglang.sglang.sizing;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'sgl_kernel')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


_CLI_PROBE = textwrap.dedent("""
    import json, os, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    from sglang.srt.model_executor import cuda_graph_config as cgc

    model, cases = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    cpu_prefill_default = cgc.default_prefill_backend
    for name, extra in cases.items():
        # "@gpu-defaults": SGLang's defaults on CUDA (breakable prefill graphs), which a CPU run does not get
        gpu = "@gpu-defaults" in extra
        extra = [e for e in extra if e != "@gpu-defaults"]
        cgc.default_prefill_backend = (lambda: cgc.Backend.BREAKABLE) if gpu else cpu_prefill_default
        for k in ("OSCAR_SGLANG_ROTATIONS", "OSCAR_SGLANG_SINK", "OSCAR_SGLANG_RECENT", "OSCAR_SGLANG_HOT_REQUESTS"):
            os.environ.pop(k, None)
        try:
            sa = prepare_server_args(["--model-path", model, "--device", "cpu", *extra])
            sa.resolve_once()
            v = resolving_view(sa)
            out[name] = {"kv": v.kv_cache_dtype, "backend": v.attention_backend,
                         "graphs": [str(v.cuda_graph_config.decode.backend), str(v.cuda_graph_config.prefill.backend)],
                         "env": [os.environ.get(k) for k in ("OSCAR_SGLANG_ROTATIONS", "OSCAR_SGLANG_SINK",
                                                             "OSCAR_SGLANG_RECENT", "OSCAR_SGLANG_HOT_REQUESTS")]}
        except SystemExit as e:
            out[name] = {"exit": str(e)}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Parse several command lines in one subprocess (importing SGLang costs seconds)."""
    import dataclasses

    from transformers import AutoConfig

    from oscar_sglang import artifacts, assets

    model = str(assets.default_model_dir())
    fp = artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model))
    root = tmp_path_factory.mktemp("rotations")
    good = artifacts.save(artifacts.hadamard(fp), root / "good")
    wrong = artifacts.save(artifacts.hadamard(dataclasses.replace(fp, num_layers=4)), root / "wrong")
    int2 = ["--kv-cache-dtype", "oscar-int2"]
    cases = {
        "plain": [],
        "int2": [*int2, "--oscar-rotations", str(good), "--oscar-sink", "4", "--oscar-recent", "16",
                 "--oscar-hot-requests", "8"],
        "negative_hot": [*int2, "--oscar-rotations", str(good), "--oscar-hot-requests", "-1"],
        "no_rotations": int2,
        "wrong_model": [*int2, "--oscar-rotations", str(wrong)],
        "flags_without_int2": ["--oscar-sink", "4"],
        "other_backend": [*int2, "--oscar-rotations", str(good), "--attention-backend", "torch_native"],
        "plain_gpu_defaults": ["@gpu-defaults"],
        "int2_gpu_defaults": [*int2, "--oscar-rotations", str(good), "@gpu-defaults"],
        "int2_no_graphs": [*int2, "--oscar-rotations", str(good), "--disable-cuda-graph"],
        "int2_no_decode_graphs": [*int2, "--oscar-rotations", str(good), "--cuda-graph-backend-decode", "disabled"],
        "int2_prefill_graphs": [*int2, "--oscar-rotations", str(good), "--cuda-graph-backend-prefill", "breakable"],
    }
    r = subprocess.run([sys.executable, "-c", _CLI_PROBE, model, json.dumps(cases)], capture_output=True,
                       text=True, timeout=600, env=CPU_ENV)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):]), good


@pytest.mark.model
def test_cli_selects_backend_and_exports_settings(cli_results):
    res, good = cli_results
    assert res["plain"]["kv"] == "auto" and res["plain"]["backend"] != "oscar_int2"
    assert res["plain"]["env"] == [None, None, None, None]
    int2 = res["int2"]
    assert int2["kv"] == "oscar-int2" and int2["backend"] == "oscar_int2"
    assert int2["env"] == [str(good), "4", "16", "8"]


@pytest.mark.model
def test_cli_keeps_decode_graphs_and_turns_prefill_graphs_off(cli_results):
    """Decode CUDA graphs follow SGLang's flags (the backend captures decode); prefill graphs stay off."""
    res, _ = cli_results
    assert res["int2"]["graphs"] == [res["plain"]["graphs"][0], "disabled"] and res["plain"]["graphs"][0] == "full"
    assert res["plain_gpu_defaults"]["graphs"] == ["full", "breakable"]      # what a GPU server gets by default
    assert res["int2_gpu_defaults"]["graphs"] == ["full", "disabled"]
    assert res["int2_no_graphs"]["graphs"] == ["disabled", "disabled"]
    assert res["int2_no_decode_graphs"]["graphs"] == ["disabled", "disabled"]
    assert "captures CUDA graphs for decode only" in res["int2_prefill_graphs"]["error"]
    assert "--cuda-graph-backend-prefill" in res["int2_prefill_graphs"]["error"]


@pytest.mark.model
def test_cli_refusals_say_what_to_do(cli_results):
    res, _ = cli_results
    assert "oscar-calibrate --model MODEL --out DIR" in res["no_rotations"]["exit"]
    assert "--oscar-rotations DIR" in res["no_rotations"]["exit"]
    wrong = res["wrong_model"]["exit"]
    assert "calibrated for a different model" in wrong and "num_layers 4 in the artifact vs 30" in wrong
    assert "apply only with --kv-cache-dtype oscar-int2" in res["flags_without_int2"]["exit"]
    assert "--oscar-hot-requests must be >= 0, got -1" in res["negative_hot"]["exit"]
    assert "drop --attention-backend torch_native" in res["other_backend"]["error"]
