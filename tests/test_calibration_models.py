"""Which models ``oscar-calibrate`` takes: every family the server tests serve, and a clear refusal, before any
statistics, for a model whose attention it cannot read (GPT-2) or the INT2 server does not serve (sliding
windows, soft-capped logits: Gemma 2 and 3)."""

import fnmatch

import pytest
import torch

from oscar_sglang.calibration import calibrate as cal

from test_architectures import COMMON, FAMILIES  # noqa: E402  (the families the real server serves)

SMALL = dict(COMMON, num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512)


def _model(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL, **extra))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_served_family_is_accepted(model_type):
    extra = {k: v for k, v in FAMILIES[model_type][0].items() if k != "head_dim"}
    cal.check_model(_model(model_type, **extra))


def test_a_mistral_window_sglang_does_not_apply_is_accepted():
    # Mistral's config carries sliding_window 4096 by default; SGLang's Mistral attends over the whole context
    model = _model("mistral", head_dim=16)
    assert model.config.sliding_window == 4096
    cal.check_model(model)


@pytest.mark.parametrize("model_type, extra, msg", [
    ("gpt2", dict(n_layer=2, n_head=2, n_embd=32, vocab_size=512),
     "GPT2LMHeadModel: oscar-calibrate needs one attention module with an o_proj per layer.*found 0 for 2 layers"),
    ("gemma3_text", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=32, head_dim=16),
     "Gemma3ForCausalLM: 1 of its 2 layers use sliding-window attention, which --kv-cache-dtype oscar-int2 does "
     "not serve"),
    ("gemma2", dict(head_dim=16, layer_types=["full_attention", "full_attention"], attn_logit_softcapping=50.0),
     "Gemma2ForCausalLM: its attention logits are soft-capped \\(50\\)"),
])
def test_models_it_cannot_read_or_serve_are_refused_before_any_statistics(model_type, extra, msg, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr(cal, "collect_statistics", lambda *a, **k: pytest.fail("statistics collected"))
    config = AutoConfig.for_model(model_type, **({} if model_type == "gpt2" else SMALL), **extra)
    model = AutoModelForCausalLM.from_config(config)
    seqs = [torch.randint(0, 512, (64,))]
    with pytest.raises(ValueError, match=msg):
        cal.calibrate(model, seqs, cal.CalibrationConfig(method="optr", sink=4, recent=8), progress=False)


@pytest.mark.model
def test_a_model_hub_id_is_read_from_the_hub_s_cache(tmp_path, monkeypatch):
    """``--model OWNER/NAME`` as SGLang's ``--model-path`` takes it: the snapshot ``huggingface_hub`` keeps in its
    cache (offline here: a cache laid out as the hub lays it out, holding the default model's files)."""
    import huggingface_hub.constants

    from oscar_sglang import assets
    from oscar_sglang.calibration import model as model_io

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--smol"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in assets.default_model_dir().iterdir():
        (snapshot / f.name).symlink_to(f)
        # what a download would fetch: every file a model folder of ours holds
        assert any(fnmatch.fnmatch(f.name, pattern) for pattern in model_io.HUB_FILES), f.name
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert model_io.resolve("acme/smol") == snapshot
    lm, tok, path = model_io.load("acme/smol", dtype=torch.float32)
    assert path == snapshot and lm.config.num_hidden_layers == 30 and tok("Paris").input_ids
    with pytest.raises(FileNotFoundError, match="acme/other: no such model folder or GGUF file here, and the "
                                                "model hub could not provide it"):
        model_io.resolve("acme/other")
    with pytest.raises(FileNotFoundError, match="^nowhere: no such model folder or GGUF file$"):
        model_io.resolve("nowhere")    # not a hub id: never asked of the hub
