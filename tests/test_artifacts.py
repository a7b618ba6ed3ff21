"""Rotation artifacts: round trip, validation, and one clear error per bad case."""

import json
import os
import types

import pytest
import torch
from safetensors.torch import load_file

from oscar_sglang import artifacts as art
from oscar_sglang import rotation as rot

from artifact_files import rewrite_tensors  # noqa: E402

FP = art.ModelFingerprint(
    architecture="LlamaForCausalLM", num_layers=3, hidden_size=128, num_attention_heads=4,
    num_kv_heads=2, head_dim=32, vocab_size=1000, rope_type="default", rope_theta=10000.0,
)


def _random_artifact():
    torch.manual_seed(0)
    layers = []
    for _ in range(FP.num_layers):
        kr = torch.stack([rot.compose(torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0]) for _ in range(2)])
        vr = torch.stack([rot.compose(torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0]) for _ in range(2)])
        layers.append(art.LayerRotation(kr.float(), vr.float(), torch.randn(2, 32), torch.rand(2) * 0.5 + 0.5,
                                        torch.rand(2) * 0.5 + 0.5))
    return art.RotationArtifacts(FP, "oscar", layers, sink=8, recent=32, group_size=16,
                                 calibration={"tokens": 123, "data": "unit test"})


def test_save_load_round_trip(tmp_path):
    a = _random_artifact()
    art.save(a, tmp_path / "rot")
    b = art.load(tmp_path / "rot", expect=FP)
    assert b.model == FP and b.method == "oscar" and (b.sink, b.recent, b.group) == (8, 32, 16)
    assert b.calibration == {"tokens": 123, "data": "unit test"}
    for la, lb in zip(a.layers, b.layers):
        for name in art.LayerRotation.TENSOR_NAMES:
            assert torch.equal(getattr(la, name), getattr(lb, name))
    manifest = json.loads((tmp_path / "rot" / art.MANIFEST).read_text())
    assert manifest["format_version"] == 2 and manifest["bits_per_element"] == 4.0  # no key scales: version 2


@pytest.mark.parametrize("builder", ["identity", "hadamard"])
def test_trivial_builders(tmp_path, builder):
    a = art.BUILDERS[builder](FP)
    art.save(a, tmp_path)
    b = art.load(tmp_path, expect=FP)
    assert b.method == builder and b.group == FP.head_dim
    r = b.layers[0].k_rotation[1]
    expected = torch.eye(32) if builder == "identity" else rot.hadamard(32).float()
    assert torch.equal(r, expected)
    assert (b.layers[2].k_mean == 0).all() and (b.layers[2].v_clip == 1).all()


def test_fingerprint_from_transformers_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                      vocab_size=1000, rope_theta=10000.0, architectures=["LlamaForCausalLM"])
    fp = art.ModelFingerprint.from_config(cfg)
    assert fp == FP
    # A duck-typed config (as SGLang hands over) works too.
    ns = types.SimpleNamespace(architectures=None, model_type="llama", num_attention_heads=4, hidden_size=128,
                               num_hidden_layers=3, num_key_value_heads=2, vocab_size=1000, rope_theta=5e5)
    fp2 = art.ModelFingerprint.from_config(ns)
    assert fp2.architecture == "llama" and fp2.head_dim == 32 and fp2.rope_theta == 5e5


# ---- every bad-artifact case raises ArtifactError naming the file and the mismatch ----

@pytest.fixture
def saved(tmp_path):
    d = tmp_path / "rot"
    art.save(_random_artifact(), d)
    return d


def _rewrite_tensor(d, key, fn):
    t = load_file(str(d / art.TENSORS))
    t[key] = fn(t[key])
    rewrite_tensors(d, t)


def _rewrite_manifest(d, fn):
    m = json.loads((d / art.MANIFEST).read_text())
    fn(m)
    (d / art.MANIFEST).write_text(json.dumps(m))


def test_tensors_from_another_run_are_refused_by_the_manifest_s_digest(saved, tmp_path):
    # a rotations directory whose tensors were replaced by another calibration's (same model, same shapes:
    # every other check passes) while its manifest still describes the first
    other = _random_artifact()
    other.layers[0].k_clip.fill_(0.5)
    art.save(other, tmp_path / "other")
    (saved / art.TENSORS).write_bytes((tmp_path / "other" / art.TENSORS).read_bytes())
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: its sha256 is not the one manifest\.json "
                                                r"records"):
        art.load(saved)
    # artifacts written before the digest (no tensors_sha256) load as before
    _rewrite_manifest(saved, lambda m: m.pop("tensors_sha256"))
    assert torch.equal(art.load(saved).layers[0].k_clip, other.layers[0].k_clip)


def test_save_replaces_both_files_and_leaves_no_temporary_file(saved):
    manifest = json.loads((saved / art.MANIFEST).read_text())
    assert len(manifest["tensors_sha256"]) == 64
    second = _random_artifact()
    second.layers[1].v_clip.fill_(0.75)
    art.save(second, saved)   # over the first, as a re-calibration into the same --out
    assert sorted(p.name for p in saved.iterdir()) == sorted([art.MANIFEST, art.TENSORS])
    # both as the umask makes any file (safetensors alone would make the tensors readable by their owner only)
    assert (saved / art.TENSORS).stat().st_mode & 0o777 == (saved / art.MANIFEST).stat().st_mode & 0o777
    assert (saved / art.TENSORS).stat().st_mode & 0o044 == 0o044 or os.umask(os.umask(0)) & 0o044
    assert torch.equal(art.load(saved).layers[1].v_clip, second.layers[1].v_clip)


def test_missing_directory(tmp_path):
    with pytest.raises(art.ArtifactError, match=r"nope: rotations directory does not exist"):
        art.load(tmp_path / "nope")


def test_missing_manifest(saved):
    (saved / art.MANIFEST).unlink()
    with pytest.raises(art.ArtifactError, match=r"manifest\.json: missing"):
        art.load(saved)


def test_missing_tensors_file(saved):
    (saved / art.TENSORS).unlink()
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: missing"):
        art.load(saved)


def test_corrupt_tensors_file(saved):
    (saved / art.TENSORS).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: unreadable"):
        art.load(saved)


def test_corrupt_manifest(saved):
    (saved / art.MANIFEST).write_text("{not json")
    with pytest.raises(art.ArtifactError, match=r"manifest\.json: not valid JSON"):
        art.load(saved)


def test_wrong_shape(saved):
    _rewrite_tensor(saved, "layers.1.v_rotation", lambda t: t[:, :16, :16].contiguous())
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: layers\.1\.v_rotation has shape \(2, 16, 16\), expected \(2, 32, 32\)"):
        art.load(saved)


def test_missing_layer_tensor(saved):
    t = load_file(str(saved / art.TENSORS))
    del t["layers.2.k_mean"]
    rewrite_tensors(saved, t)
    with pytest.raises(art.ArtifactError, match=r"layer 2 lacks k_mean"):
        art.load(saved)


def test_wrong_model_fingerprint(saved):
    other = art.ModelFingerprint(**{**FP.__dict__, "num_kv_heads": 4, "rope_theta": 1e6})
    with pytest.raises(art.ArtifactError, match=r"manifest\.json: calibrated for a different model: "
                                                r"num_kv_heads 2 in the artifact vs 4 in the model; rope_theta"):
        art.load(saved, expect=other)


def test_non_orthogonal_matrix(saved):
    _rewrite_tensor(saved, "layers.0.k_rotation", lambda t: t * 1.01)
    with pytest.raises(art.ArtifactError, match=r"layers\.0\.k_rotation is not orthogonal"):
        art.load(saved)


def test_nan(saved):
    def poison(t):
        t = t.clone()
        t[1, 3] = float("nan")
        return t

    _rewrite_tensor(saved, "layers.2.k_mean", poison)
    with pytest.raises(art.ArtifactError, match=r"layers\.2\.k_mean contains NaN or inf"):
        art.load(saved)


def test_unknown_version(saved):
    _rewrite_manifest(saved, lambda m: m.update(format_version=99))
    with pytest.raises(art.ArtifactError, match=r"manifest\.json: unknown format_version 99"):
        art.load(saved)


def test_bad_clip_ratio(saved):
    _rewrite_tensor(saved, "layers.1.k_clip", lambda t: t * 0 + 1.5)
    with pytest.raises(art.ArtifactError, match=r"layers\.1\.k_clip has clip ratios outside"):
        art.load(saved)


def test_save_refuses_invalid(tmp_path):
    a = _random_artifact()
    a.layers[0].v_rotation = a.layers[0].v_rotation * 2
    with pytest.raises(art.ArtifactError, match="not orthogonal"):
        art.save(a, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---- a rotations directory is untrusted input: bounded before anything is read or allocated ----

@pytest.fixture
def no_tensor_load(monkeypatch):
    """Fail the test if the tensors are loaded (the refusal must come from the header or the manifest)."""
    import safetensors.torch

    def refuse(*_a, **_k):
        raise AssertionError("safetensors.torch.load_file was called for a file that should have been refused")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


def test_oversized_manifest_is_not_read(saved):
    (saved / art.MANIFEST).write_text(" " * (art.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(art.ArtifactError, match=r"manifest\.json: \d+ bytes, more than a manifest can be"):
        art.load(saved)


@pytest.mark.parametrize("key,value", [("num_layers", 10**9), ("head_dim", 0), ("num_kv_heads", -1),
                                       ("num_layers", "3"), ("vocab_size", 2.0), ("hidden_size", True)])
def test_fingerprint_out_of_bounds_is_refused_before_the_tensors(saved, no_tensor_load, key, value):
    _rewrite_manifest(saved, lambda m: m["model"].__setitem__(key, value))
    with pytest.raises(art.ArtifactError, match=rf"manifest\.json: model\.{key} must be an integer in \[1, \d+\]"):
        art.load(saved)


@pytest.mark.parametrize("key,value", [("sink", -4), ("recent", "256"), ("group_size", 10**12)])
def test_bad_defaults_are_refused(saved, key, value):
    _rewrite_manifest(saved, lambda m: m["defaults"].__setitem__(key, value))
    with pytest.raises(art.ArtifactError, match=rf"manifest\.json: defaults\.{key} must be an integer"):
        art.load(saved)


def test_huge_header_length_is_refused(saved, no_tensor_load):
    data = (saved / art.TENSORS).read_bytes()
    (saved / art.TENSORS).write_bytes((2**40).to_bytes(8, "little") + data[8:])
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: unreadable safetensors file \(header of"):
        art.load(saved)


def test_unexpected_tensor_is_refused(saved, no_tensor_load):
    t = load_file(str(saved / art.TENSORS))  # bound at import, before no_tensor_load patched the module
    t["layers.7.k_rotation"] = torch.zeros(1)
    rewrite_tensors(saved, t)
    with pytest.raises(art.ArtifactError, match=r"unexpected tensors layers\.7\.k_rotation for a model of 3 layers"):
        art.load(saved)


def test_huge_declared_shape_is_refused(saved, no_tensor_load):
    path = saved / art.TENSORS
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["layers.0.k_mean"]["shape"] = [2, 10**9]
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    with pytest.raises(art.ArtifactError, match=r"layers\.0\.k_mean has shape \(2, 1000000000\), expected \(2, 32\)"):
        art.load(saved)


def test_integer_dtype_is_refused(saved, no_tensor_load):
    _rewrite_tensor(saved, "layers.0.k_clip", lambda t: t.to(torch.int32))
    with pytest.raises(art.ArtifactError, match=r"layers\.0\.k_clip has dtype 'I32'"):
        art.load(saved)


def test_truncated_tensor_data_is_refused(saved, no_tensor_load):
    path = saved / art.TENSORS
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: unreadable safetensors file \(\d+ bytes, but its header describes \d+"):
        art.load(saved)


def test_files_linked_from_outside_the_directory_are_refused(saved, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    (saved / art.TENSORS).rename(outside)
    (saved / art.TENSORS).symlink_to(outside)
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: points outside the rotations directory"):
        art.load(saved)
    (saved / art.MANIFEST).rename(tmp_path / "m.json")
    (saved / art.MANIFEST).symlink_to(tmp_path / "m.json")
    with pytest.raises(art.ArtifactError, match=r"manifest\.json: points outside the rotations directory"):
        art.load(saved)


def test_a_pickle_is_never_unpickled(saved, monkeypatch):
    import pickle

    torch.save({"layers.0.k_rotation": torch.eye(32)}, saved / art.TENSORS)  # a pickle under the expected name

    def refuse(*_a, **_k):
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(art.ArtifactError, match=r"rotations\.safetensors: unreadable safetensors file"):
        art.load(saved)


# ---- format version 2: per-layer row formats (a precision policy) ----

def _mixed_formats():
    from oscar_sglang.format import RowFormat
    return [art.LayerFormat(RowFormat(2, 16), RowFormat(2, 16)),
            art.LayerFormat(RowFormat(4, 32), RowFormat(2, 8)),
            art.LayerFormat(RowFormat(8, 32), RowFormat(4, 16))]


def test_layer_formats_round_trip_and_accounting(tmp_path):
    a = _random_artifact().with_formats(_mixed_formats())
    art.save(a, tmp_path / "rot")
    b = art.load(tmp_path / "rot", expect=FP)
    assert b.layer_formats == _mixed_formats()
    # bits per element: layer 0 (2 + 2) / 1, layer 1 (4 + 1 + 2 + 4) / 2, layer 2 (8 + 1 + 4 + 2) / 2
    expected = (4.0 + 5.5 + 7.5) / 3
    assert b.bits_per_element == pytest.approx(expected)
    assert json.loads((tmp_path / "rot" / art.MANIFEST).read_text())["bits_per_element"] == pytest.approx(expected)
    # bytes per token: kv_heads * (codes + 4 bytes per group) per side and layer, d = 32
    rows = [(8 + 8, 8 + 8), (16 + 4, 8 + 16), (32 + 4, 16 + 8)]
    assert b.bytes_per_token() == 2 * sum(k + v for k, v in rows)
    assert b.bytes_per_token(kv_heads=1) == sum(k + v for k, v in rows)
    assert b.policy_summary() == "int2/g16 (1 K, 1 V), int2/g8 (1 V), int4 (1 K), int4/g16 (1 V), int8 (1 K)"


def test_symmetric_rows_round_trip_and_cost_a_scale_only(tmp_path):
    from oscar_sglang.format import RowFormat
    fs = [art.LayerFormat(RowFormat(2, 32, True), RowFormat(2, 32)), art.LayerFormat(RowFormat(4, symmetric=True),
                                                                                      RowFormat(2, 16)),
          art.LayerFormat(RowFormat(2, 32), RowFormat(2, 32, True))]
    a = _random_artifact().with_formats(fs)
    art.save(a, tmp_path / "rot")
    b = art.load(tmp_path / "rot", expect=FP)
    assert [(f.k.symmetric, f.v.symmetric) for f in b.layer_formats] == [(True, False), (True, False), (False, True)]
    # d 32: a symmetric row stores 2 bytes per group, a stored-zero row 4
    rows = [(8 + 2, 8 + 4), (16 + 2, 8 + 8), (8 + 4, 8 + 2)]
    assert b.bytes_per_token() == 2 * sum(k + v for k, v in rows)
    assert "int2sym" in b.policy_summary() and "int4sym" in b.policy_summary()


def test_version_1_artifacts_load_as_int2_everywhere(saved):
    def v1(m):
        m["format_version"] = 1
        del m["layer_formats"]

    _rewrite_manifest(saved, v1)
    b = art.load(saved)
    from oscar_sglang.format import RowFormat
    assert b.layer_formats == [art.LayerFormat(RowFormat(2, 16), RowFormat(2, 16))] * 3
    assert b.bits_per_element == 4.0


@pytest.mark.parametrize("entry,match", [
    ({"k": {"bits": 3, "group": 16}, "v": {"bits": 2, "group": 16}}, r"layer_formats\[1\]\.k must be"),
    ({"k": {"bits": 2, "group": 16}, "v": {"bits": 2, "group": 12}}, r"layer_formats\[1\]\.v: group size 12"),
    ({"k": {"bits": 2, "group": 10**9}, "v": {"bits": 2, "group": 16}}, r"layer_formats\[1\]\.k must be"),
    ({"k": {"bits": "4", "group": 16}, "v": {"bits": 2, "group": 16}}, r"layer_formats\[1\]\.k must be"),
    ("int4", r"layer_formats\[1\]\.k must be"),
    ({"k": {"bits": 2, "group": 16, "symmetric": 1}, "v": {"bits": 2, "group": 16}}, r"layer_formats\[1\]\.k must"),
    ({"k": {"bits": 2, "group": 16, "zero": False}, "v": {"bits": 2, "group": 16}}, r"layer_formats\[1\]\.k must"),
])
def test_bad_layer_formats_are_refused(saved, no_tensor_load, entry, match):
    _rewrite_manifest(saved, lambda m: m["layer_formats"].__setitem__(1, entry))
    with pytest.raises(art.ArtifactError, match=match):
        art.load(saved)


def test_layer_formats_must_cover_every_layer(saved, no_tensor_load):
    _rewrite_manifest(saved, lambda m: m["layer_formats"].pop())
    with pytest.raises(art.ArtifactError, match=r"layer_formats must list one entry per layer \(3\), got 2"):
        art.load(saved)
    with pytest.raises(art.ArtifactError, match="row formats for 2 layers"):
        _random_artifact().with_formats(_mixed_formats()[:2])
