"""What ``--kv-cache-dtype oscar-int2`` refuses or supports (``oscar_sglang/sglang/compat.py``), row by row.

* every launch refusal through SGLang's real argument parsing (with the plugin
  loaded), one subprocess for all rows: SGLang knows the flag, the launch
  exits with the row's one sentence, and the same flags without oscar-int2 are
  left to SGLang;
* the model table against SGLang's own model sources: every model module
  whose attention is called with ``save_kv_cache=False`` has each of its
  architectures refused or exempted here with the reason;
* the fused RoPE + set-KV write answers False with the INT2 pool, also where
  SGLang would take it (CUDA), and the hook reaches model modules imported
  after the plugin.
"""

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from oscar_sglang.sglang import compat  # noqa: E402
from oscar_sglang.sglang.settings import OscarConfigError  # noqa: E402

CPU_ENV = {**__import__("os").environ, "SGLANG_USE_CPU_ENGINE": "1"}

# A value for the flags that take one (the others are switches).
FLAG_VALUES = {"--disaggregation-mode": ["prefill"]}

_PROBE = textwrap.dedent("""
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    model, rot, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    out = {}
    for name, extra in cases.items():
        try:
            prepare_server_args(["--model-path", model, "--device", "cpu", *extra])
            out[name] = "accepted"
        except SystemExit as e:
            out[name] = f"exit: {e}"
        except Exception as e:
            out[name] = f"error: {type(e).__name__}: {e}"
    print("RESULT" + json.dumps(out))
""")


def _example(refusal):
    return [x for f in refusal.flags for x in (f, *FLAG_VALUES.get(f, []))]


@pytest.mark.model
def test_every_launch_refusal_through_sglangs_parser(tmp_path):
    from transformers import AutoConfig

    from oscar_sglang import artifacts, assets

    model = str(assets.default_model_dir())
    rot = artifacts.save(artifacts.hadamard(artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model))),
                         tmp_path / "rot")
    int2 = ["--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(rot)]
    cases = {"int2": int2}
    for i, r in enumerate(compat.LAUNCH_REFUSALS):
        cases[f"int2-{i}"] = [*int2, *_example(r)]
        cases[f"plain-{i}"] = _example(r)
    proc = subprocess.run([sys.executable, "-c", _PROBE, model, str(rot), json.dumps(cases)], capture_output=True,
                          text=True, timeout=600, env=CPU_ENV)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[0][len("RESULT"):])
    assert res["int2"] == "accepted"
    for i, r in enumerate(compat.LAUNCH_REFUSALS):
        got = res[f"int2-{i}"]
        assert got == f"exit: oscar-sglang: error: {r.message()}", (r.flags, got)
        assert "oscar" not in res[f"plain-{i}"], (r.flags, res[f"plain-{i}"])   # SGLang's business without int2


def test_refusal_messages_are_one_sentence_naming_the_flag():
    for r in compat.LAUNCH_REFUSALS:
        msg = r.message()
        assert msg.startswith("--kv-cache-dtype oscar-int2 ") and msg.endswith(f"drop {' '.join(r.flags)}")
        assert msg.count(". ") == 0 and "\n" not in msg
    args = SimpleNamespace(kv_cache_dtype="oscar-int2", enable_memory_saver=True)
    with pytest.raises(OscarConfigError, match="--enable-memory-saver"):
        compat.check_launch(args)
    compat.check_launch(SimpleNamespace(kv_cache_dtype="auto", enable_memory_saver=True))   # not ours
    compat.check_launch(SimpleNamespace(kv_cache_dtype="oscar-int2", disaggregation_mode="null"))


# Architectures of modules with save_kv_cache=False that are not refused by the table, and why.
EXEMPT = {
    "Qwen3ForCausalLM": "save_kv_cache=False only on AMD's aiter fused path (_use_aiter)",
    "DeepseekV4ForCausalLM": "MLA: refused by the pool (memory._serving)",
    "DeepseekV4ForCausalLMDSpark": "MLA: refused by the pool",
    "SarvamMLAForCausalLM": "MLA: refused by the pool",
    "SarvamMoEForCausalLM": "its save_kv_cache=False is in SarvamMoEMLAAttention only; this class is Bailing's MoE",
}


def _entry_classes(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
            v = node.value
            return [e.id for e in v.elts] if isinstance(v, (ast.List, ast.Tuple)) else [v.id]
    return []


def test_the_model_table_covers_sglangs_models_that_skip_the_kv_write():
    import sglang

    covered = set(compat.ARCHITECTURE_REFUSALS) | set(EXEMPT)
    found = {}
    for path in (Path(sglang.__file__).parent / "srt" / "models").rglob("*.py"):
        src = path.read_text()
        if "save_kv_cache=False" in src:
            for arch in _entry_classes(ast.parse(src)):
                found[arch] = path.name
    assert len(found) >= 5, found                              # the scan itself works
    missing = {a: f for a, f in found.items() if a not in covered}
    assert not missing, f"new SGLang models skip the KV write; refuse or exempt them in compat.py: {missing}"
    stale = set(compat.ARCHITECTURE_REFUSALS) - set(found)
    assert not stale, f"refused architectures no longer skip the KV write in SGLang: {stale}"
    with pytest.raises(OscarConfigError, match="IQuestLoopCoderForCausalLM"):
        compat.check_model(SimpleNamespace(architectures=["IQuestLoopCoderForCausalLM"]))
    compat.check_model(SimpleNamespace(architectures=["LlamaForCausalLM"]))


def test_the_fused_kv_write_is_off_with_the_int2_pool(monkeypatch):
    import sglang.srt.models.utils as mu
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from test_hot_plan import _pool

    from oscar_sglang.sglang import plugin

    assert ("sglang.srt.models.utils.enable_fused_set_kv_buffer", compat.no_fused_kv_write, "AROUND") in plugin.HOOKS
    monkeypatch.setattr(mu, "_is_cuda", True)                  # where SGLang would take the fused path
    fb = SimpleNamespace(dcp_kv_mask=None)
    monkeypatch.setattr(mu, "is_cp_active", lambda fb: False)
    pool = _pool("cpu")
    assert pool.dtype.is_floating_point                        # it reports the model dtype, as SGLang expects
    original = mu.enable_fused_set_kv_buffer
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=pool))):
        assert compat.no_fused_kv_write(original, fb) is False
    bf16 = SimpleNamespace(dtype=__import__("torch").bfloat16)  # SGLang's own bf16 pool: fused stays on
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=bf16))):
        assert compat.no_fused_kv_write(lambda fb: "original", fb) == "original"


@pytest.mark.model
def test_the_fused_kv_hook_reaches_model_modules_imported_later():
    code = textwrap.dedent("""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import sglang.srt.models.utils as mu
        import sglang.srt.models.bailing_moe as m
        from oscar_sglang.sglang import compat
        f = m.enable_fused_set_kv_buffer
        print("HOOKED", f is mu.enable_fused_set_kv_buffer and f.__wrapped__ is not None
              and f.__name__ == "enable_fused_set_kv_buffer")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=CPU_ENV)
    assert "HOOKED True" in r.stdout, r.stderr[-3000:]


def test_empty_prompt_is_refused_per_request_only_with_oscar_int2():
    """``refuse_empty_prompt`` (before TokenizerManager._validate_one_request): 0 tokens -> ValueError (a 400)."""
    oscar = SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="oscar-int2"))
    bf16 = SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="auto"))
    req = SimpleNamespace(input_embeds=None)
    with pytest.raises(ValueError, match="prompt is empty"):
        compat.refuse_empty_prompt(oscar, req, [])
    assert compat.refuse_empty_prompt(oscar, req, [1]) is None                # a token: SGLang's own checks go on
    assert compat.refuse_empty_prompt(oscar, SimpleNamespace(input_embeds=[[0.0]]), []) is None   # embeddings given
    assert compat.refuse_empty_prompt(oscar, req, None) is None
    assert compat.refuse_empty_prompt(bf16, req, []) is None                  # other servers as SGLang makes them
