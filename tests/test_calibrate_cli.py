"""oscar-calibrate and oscar-eval end to end on the embedded default model (small budgets)."""

import json

import pytest

from oscar_sglang import artifacts as art
from oscar_sglang.calibration import cli, eval_cli

pytestmark = pytest.mark.model


def test_calibrate_optr_writes_a_validated_artifact(tmp_path, capsys):
    out = tmp_path / "rot"
    rc = cli.main(["--method", "optr", "--tokens", "1024", "--seq-len", "512", "--sink", "8", "--recent", "32",
                   "--keep-sequences", "2", "--optr-steps", "2", "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "OptR kept" in printed and f"wrote {out}" in printed
    from transformers import AutoConfig

    from oscar_sglang import assets

    fp = art.ModelFingerprint.from_config(AutoConfig.from_pretrained(assets.default_model_dir()))
    a = art.load(out, expect=fp)
    assert a.method == "optr" and (a.sink, a.recent) == (8, 32)
    manifest = json.loads((out / "manifest.json").read_text())
    cal = manifest["calibration"]
    assert cal["tokens"] == 1024 and cal["seed"] == 0 and cal["data"]["spec"] == "shakespeare"
    assert len(cal["layers"]) == 30 and {"k_clip", "v_clip", "k_heldout_before", "k_kept"} <= set(cal["layers"][0])
    assert cal["peak_rss_mb"] > 0


def test_calibrate_reports_bad_input_clearly(tmp_path, capsys):
    assert cli.main(["--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.txt: not a file" in capsys.readouterr().err
    assert cli.main(["--method", "oscar", "--seq-len", "256", "--tokens", "512", "--out", str(tmp_path / "y")]) == 2
    assert "never leave the BF16 windows" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_eval_refuses_overlapping_texts(tmp_path, capsys):
    assert eval_cli.main(["--data", "shakespeare:hamlet_gut", "--eval-data", "shakespeare:hamlet_gut,lear_gut",
                          "--out", str(tmp_path)]) == 2
    assert "in both calibration and evaluation data" in capsys.readouterr().err
