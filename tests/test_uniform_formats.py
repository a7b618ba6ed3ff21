"""scripts/uniform_formats.py: one format per side for every layer, rotations and fitting clips kept."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang.format import RowFormat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import uniform_formats as uf  # noqa: E402


def _source(tmp_path):
    fp = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=3, hidden_size=256, num_attention_heads=4,
                              num_kv_heads=2, head_dim=64, vocab_size=1000, rope_type="default", rope_theta=10000.0)
    a = art.hadamard(fp)
    a.layers = [art.LayerRotation(l.k_rotation, l.v_rotation, l.k_mean, torch.full((2,), 0.8), torch.full((2,), 0.9))
                for l in a.layers]
    a = a.with_formats([art.LayerFormat(RowFormat(4), RowFormat(2))] + [art.LayerFormat(RowFormat(2), RowFormat(2))] * 2)
    return art.save(a, tmp_path / "src")


def test_every_layer_gets_the_formats_and_clips_follow_the_format(tmp_path):
    rc = uf.main(["--from", str(_source(tmp_path)), "--k", "int4", "--v", "int2", "--out", str(tmp_path / "out")])
    assert rc == 0
    src, out = art.load(tmp_path / "src"), art.load(tmp_path / "out")
    assert all(lf.k == RowFormat(4, 64) and lf.v == RowFormat(2, 64) for lf in out.layer_formats)
    assert out.bits_per_element == pytest.approx((4.5 + 2.5) / 2)    # fp16 scale + zero per 64-element row
    for i, (a, b) in enumerate(zip(src.layers, out.layers)):
        assert torch.equal(a.k_rotation, b.k_rotation) and torch.equal(a.v_rotation, b.v_rotation)
        assert torch.equal(b.v_clip, a.v_clip)                                     # V stays INT2: its clip stays
        assert torch.equal(b.k_clip, a.k_clip if i == 0 else torch.ones(2))      # K changed format: no clip


def test_bad_format_names_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        uf.main(["--from", str(tmp_path), "--k", "fp8", "--v", "int2", "--out", str(tmp_path / "o")])
    assert "expected a row format" in capsys.readouterr().err
    assert uf.main(["--from", str(tmp_path / "missing"), "--k", "int4", "--v", "int2", "--out", str(tmp_path / "o")]) == 2


def test_format_names_are_the_formats_own():
    for f in (RowFormat(2, 64), RowFormat(4, 32), RowFormat(2, 64, True), RowFormat(8, 16, True)):
        assert uf.parse_format(f.name(64)).resolved(64) == f
    assert uf.parse_format("int2sym") == RowFormat(2, None, True)
