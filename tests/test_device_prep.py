"""The GPU run's preparation that can be checked without the bundle: wheel slimming, dummy models, prompts, pins.

The bundle itself (downloads) and its install into a Python 3.12 venv are
exercised by ``scripts/device/dry_run.sh``, not here: CI must not need them.
"""

import csv
import hashlib
import base64
import io
import json
import sys
import zipfile

import pytest
import torch

from script_modules import load_script


build_bundle = load_script("device/build_bundle.py")
dummy_models = sys.modules["dummy_models"]  # build_bundle imports it from scripts/


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_slimmed_sglang_wheel_is_pure_python_with_a_valid_record(tmp_path):
    files = {
        "sglang/__init__.py": b"x = 1\n",
        "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so": b"\x7fELF" * 100,
        "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so": b"\x7fELF",
        "sglang/multimodal_gen/runtime/x.py": b"y = 2\n",
        "sglang/srt/configs/E=16,N=4096,device_name=NVIDIA_H200.json": b"{}",
        "sglang-0.5.23.dist-info/METADATA": b"Name: sglang\nVersion: 0.5.23\n",
        "sglang-0.5.23.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-manylinux_2_34_x86_64\n",
        "sglang-0.5.23.dist-info/RECORD": b"stale\n",
    }
    src = tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(src, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    out = build_bundle.slim_sglang(src, tmp_path)
    assert out.name == "sglang-0.5.23-py3-none-any.whl"
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        wheel = z.read("sglang-0.5.23.dist-info/WHEEL").decode()
        record = list(csv.reader(io.StringIO(z.read("sglang-0.5.23.dist-info/RECORD").decode())))
        contents = {n: z.read(n) for n in names}
    kept = {"sglang/__init__.py", "sglang/srt/configs/E=16,N=4096,device_name=NVIDIA_H200.json",
            "sglang-0.5.23.dist-info/METADATA", "sglang-0.5.23.dist-info/WHEEL", "sglang-0.5.23.dist-info/RECORD"}
    assert names == kept
    assert "Tag: py3-none-any" in wheel and "Root-Is-Purelib: true" in wheel
    rows = {r[0]: r for r in record}
    assert set(rows) == kept  # the path holding commas is one CSV field
    for name in kept - {"sglang-0.5.23.dist-info/RECORD"}:
        assert rows[name][1] == _hash(contents[name]) and int(rows[name][2]) == len(contents[name])
    assert rows["sglang-0.5.23.dist-info/RECORD"][1:] == ["", ""]


def test_bundle_pins_are_exact_and_unique():
    specs = build_bundle.requirements()
    names = [s.split("==")[0].lower().replace("_", "-") for s in specs]
    assert all(s.count("==") == 1 and s.split("==")[1] for s in specs), specs
    assert len(names) == len(set(names)), names
    assert "sglang" not in names and "torch" not in names  # sglang is slimmed separately; torch is on the device


def test_sharegpt_prompts_are_two_turn_conversations_of_real_text(monkeypatch):
    text = "".join(f"line {i} of a play.\n" for i in range(5000))
    monkeypatch.setattr(build_bundle.assets, "read_texts", lambda: {"a": text, "b": text[::-1]})
    rows = build_bundle.sharegpt_prompts(6, chars=500)
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6
    for r in rows:
        human, gpt = r["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        assert len(human["value"]) == 500 and len(gpt["value"]) == 500
        assert human["value"] in text or human["value"] in text[::-1]
    assert json.loads(json.dumps(rows)) == rows


@pytest.mark.parametrize("name,layers,kv,heads,d", [("llama3-8b", 32, 8, 32, 128), ("smollm2-135m", 30, 3, 9, 64),
                                                    ("llama-d128-small", 4, 2, 8, 128)])
def test_dummy_model_geometry_as_transformers_reads_it(tmp_path, name, layers, kv, heads, d):
    from transformers import AutoConfig

    from oscar_sglang import artifacts

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    folder = dummy_models.write_model(name, tmp_path / name, tok)
    assert (folder / "tokenizer.json").read_text() == "{}" and (folder / "tokenizer_config.json").exists()
    fp = artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(folder))
    assert (fp.num_layers, fp.num_kv_heads, fp.num_attention_heads, fp.head_dim) == (layers, kv, heads, d)
    assert fp.hidden_size == heads * d and fp.vocab_size == 49152


def test_dummy_model_hadamard_artifact_validates_against_the_model(tmp_path):
    from transformers import AutoConfig

    from oscar_sglang import artifacts, rotation

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    folder = dummy_models.write_model("llama-d128-small", tmp_path / "m", tok)
    out = dummy_models.write_hadamard(folder, tmp_path / "m-hadamard")
    fp = artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(folder))
    art = artifacts.load(out, expect=fp)
    assert art.method == "hadamard" and len(art.layers) == 4
    torch.testing.assert_close(art.layers[0].k_rotation[1], rotation.hadamard(128).to(torch.float32))


def test_unknown_geometry_and_missing_tokenizer_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown geometry"):
        dummy_models.write_model("llama-70b", tmp_path / "x", tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        dummy_models.write_model("llama3-8b", tmp_path / "x", tmp_path)


def test_calibrate_bench_times_a_truncated_geometry_with_the_policy(tmp_path, capsys):
    """``calibrate_bench.py --layers 1 --bits 3``: the first layer of a 4-layer geometry, random weights, the fit and
    the precision policy timed per layer; the text named by a data spec of ``oscar-calibrate --data``."""
    from oscar_sglang import assets

    bench = load_script("device/calibrate_bench.py")
    folder = dummy_models.write_model("llama-d128-small", tmp_path / "m", assets.default_model_dir())
    out = tmp_path / "out"
    assert bench.main(["--model", str(folder), "--text", "shakespeare", "--out", str(out), "--tokens", "1024",
                       "--seq-len", "512", "--method", "hadamard-center", "--bits", "3", "--layers", "1",
                       "--device", "cpu", "--dtype", "float32"]) == 0
    r = json.loads((out / "calibrate_bench.json").read_text())
    head_dim, hidden, ffn, vocab = 128, 1024, 2816, 49152
    one_layer = hidden * (8 + 2 + 2 + 8) * head_dim + 3 * hidden * ffn + 2 * hidden  # q k v o, MLP, two norms
    assert r["layers"] == 1 and r["parameters"] == vocab * hidden + one_layer + hidden  # tied embeddings, final norm
    assert (r["method"], r["bits"], r["tokens"], r["device"]) == ("hadamard-center", 3.0, 1024, "cpu")
    assert r["policy_s"] is not None and r["policy_s_per_layer"] == round(r["policy_s"], 2)
    assert r["fit_s_per_layer"] == round(r["fit_s"], 2) and r["total_s"] >= r["capture_s"]
    assert "3 bits" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", str(folder), "--text", "mix", "--out", str(out), "--layers", "0"])


def test_calibrate_bench_defaults_to_the_pipeline_oscar_calibrate_runs(tmp_path):
    """Without options the bench times what a user's ``oscar-calibrate`` runs: OptR with the precision policy at the
    default budget, on as many tokens per sequence and in all; ``--bits int2`` leaves the policy out, as there."""
    from oscar_sglang.calibration import cli
    from oscar_sglang.calibration.policy import DEFAULT_BITS

    bench = load_script("device/calibrate_bench.py")
    base = ["--model", str(tmp_path), "--text", "mix", "--out", str(tmp_path)]
    args, user = bench.parse_args(base), cli.build_parser().parse_args(["--out", str(tmp_path)])
    assert (args.method, args.bits, args.tokens, args.seq_len) == (user.method, user.bits, user.tokens, user.seq_len)
    assert (args.method, args.bits) == ("optr", DEFAULT_BITS)
    assert bench.parse_args([*base, "--bits", "int2"]).bits is None
    with pytest.raises(SystemExit):
        bench.parse_args([*base, "--bits", "17"])
