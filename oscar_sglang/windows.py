"""The window rule, stated once: which positions of a sequence are read in BF16 (DESIGN.md invariant 2).

A sequence of ``length`` tokens keeps its first ``sink`` positions (the *sink*
window) and its last ``recent`` positions (the *recent* window) in BF16;
every other position is read from INT2.  The two windows overlap when
``length < sink + recent``; a position in both counts as a sink.

Used by the serving bookkeeping (``oscar_sglang/sglang/hot.py``), the
simulated cache of calibration and evaluation (``calibration/served.py``) and
the kernels' synthetic pools (``kernels/scenario.py``).  Works on ints and on
tensors (broadcasting); plain torch, no SGLang.
"""

from __future__ import annotations

import torch


def in_sink(pos, sink: int):
    """Position in the sink window: ``pos < sink``."""
    return pos < sink


def in_recent(pos, length, sink: int, recent: int):
    """Position in the recent window and not a sink: ``pos >= max(sink, length - recent)``."""
    start = length - recent
    if isinstance(start, int):
        return pos >= max(sink, start)
    return pos >= start.clamp(min=sink)


def layout_positions(length, sink: int, recent: int, col, recent_col):
    """The window of sequences of ``length`` tokens in the fixed layout ``[..., sink + recent]``.

    Column ``j`` (``col = arange(sink + recent)``, ``recent_col = col >= sink``
    as integers, made once by the caller) holds position ``j`` for ``j < sink``,
    else ``max(0, length - sink - recent) + j``; ``length`` broadcasts against
    the columns (``[batch, 1]``).  Positions at or past ``length`` are not in
    the window (the caller masks them: ``pos < length``).  The serving
    bookkeeping's plans, request windows and re-pin all use this layout.
    """
    return torch.addcmul(col, torch.clamp(length - (sink + recent), min=0), recent_col)


def in_window(pos, length, sink: int, recent: int):
    """Position read in BF16 in a sequence of ``length`` tokens: ``pos < sink or pos >= length - recent``."""
    return (pos < sink) | (pos >= length - recent)
