"""Argument checks shared by ``oscar-calibrate`` and ``oscar-eval``: refuse bad input before the long part.

argparse value types (a count with its least value, a list of them, a bits budget) and the output folder's check
(:func:`check_out_dir`), so that a calibration of several minutes is not run to fail at its last step, where what
it computed would be lost.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def count(least: int):
    """An argparse type: an integer ``>= least`` (``count(1)`` for sizes, ``count(0)`` for windows)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    parse.__name__ = "count"   # argparse names the type in its messages
    return parse


def counts(least: int):
    """An argparse type: a comma list of integers ``>= least`` (empty: none)."""
    one = count(least)

    def parse(text: str) -> list[int]:
        return [one(x.strip()) for x in text.split(",") if x.strip()]

    parse.__name__ = "counts"
    return parse


def bits_budget(text: str) -> float | None:
    """``--bits``: average stored bits per element in (0, 16], or ``int2`` / ``none`` for no policy."""
    if text.lower() in ("int2", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bits per element or 'int2', got {text!r}") from None
    if not 0 < value <= 16:
        raise argparse.ArgumentTypeError(f"bits per element must lie in (0, 16], got {value:g}")
    return value


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """Raise ``ValueError`` unless ``path`` is a folder, or can be made one, that this process may write."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")
