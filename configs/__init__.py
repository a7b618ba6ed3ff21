"""Shipped configuration files, installed as ``oscar_sglang.configs``."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def load(name: str) -> dict:
    """A JSON config by file stem, e.g. ``load("text_split")``."""
    path = HERE / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such config")
    return json.loads(path.read_text())


def text_split() -> tuple[list[str], list[str]]:
    """``(calibration_texts, evaluation_texts)``, disjoint by construction (checked)."""
    cfg = load("text_split")
    cal, ev = list(cfg["calibration"]), list(cfg["evaluation"])
    overlap = set(cal) & set(ev)
    if overlap:
        raise ValueError(f"{HERE / 'text_split.json'}: texts in both splits: {sorted(overlap)}")
    return cal, ev
