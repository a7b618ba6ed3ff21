"""scripts/bench_capacity.py's command line: rotations per geometry (the servers themselves run in the benchmark)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_capacity as bc  # noqa: E402


def test_rotations_are_given_per_geometry():
    args = bc.parse_args(["--rotations", "/a", "--rotations", "qwen=/b", "--geometries", "smollm2", "qwen"])
    assert args.rotations == {"smollm2": Path("/a"), "qwen": Path("/b")}     # a plain DIR is smollm2's
    assert bc.parse_args([]).rotations == {} and bc.parse_args([]).geometries == ["smollm2", "d128"]


def test_an_unknown_geometry_is_refused(capsys):
    with pytest.raises(SystemExit):
        bc.parse_args(["--rotations", "llama=/a"])
    assert "unknown geometry 'llama'" in capsys.readouterr().err
