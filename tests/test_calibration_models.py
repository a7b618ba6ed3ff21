"""Which models ``oscar-calibrate`` takes: every family the server tests serve, and a clear refusal, before any
statistics, for a model whose attention it cannot read (GPT-2) or the INT2 server does not serve (sliding
windows, soft-capped logits: Gemma 2 and 3)."""

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
