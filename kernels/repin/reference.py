"""Re-pin the hot side pool's live windows, plain torch (the reference of ``triton_kernel.py``).

Request row ``r`` of ``req_to_token`` has ``req_len[r]`` tokens (0: no
request) and was last in the pass ``req_pass[r]``.  Its window is the
positions ``j < sink`` and the last ``recent``, in the fixed layout
``[rows, sink + recent]`` of ``oscar_sglang.windows.layout_positions``
(positions at or past ``len`` are not in it).  Every entry held by a slot of a live window
gets at least that pass as stamp: ``stamp[e] = max(stamp[e], req_pass[r])``.

Fixed shapes ``[rows * (sink + recent)]``, no host sync.  Positions without
an update (rows without a request, window positions whose slot holds no
entry) send ``-1`` (a no-op: every stamp is >= -1) to ``spread`` addresses,
so that no element takes most of the atomic updates on a GPU.
"""

from __future__ import annotations

import torch

from oscar_sglang import windows


def repin_windows(stamp: torch.Tensor, hot_index: torch.Tensor, req_len: torch.Tensor, req_pass: torch.Tensor,
                  req_to_token: torch.Tensor, sink: int, recent: int, spread: torch.Tensor | None = None) -> None:
    """``stamp`` int64 ``[entries (+ spare)]`` in place; ``hot_index`` int32 per slot (-1: none); ``req_len``,
    ``req_pass`` int64 ``[rows]``; ``req_to_token`` int32 ``[rows, width]``; ``spread``: int64
    ``[rows * (sink + recent)]`` addresses in ``stamp`` for the no-op updates (default: ``arange % numel``)."""
    w = sink + recent
    rows, width = req_to_token.shape
    if w == 0 or rows == 0 or width == 0:
        return
    col = torch.arange(w, device=stamp.device)
    length = req_len.unsqueeze(1)
    pos = windows.layout_positions(length, sink, recent, col, (col >= sink).long())
    live = (pos < length).reshape(-1)
    pos = torch.clamp(pos, max=width - 1).to(req_to_token.device)
    slot = torch.gather(req_to_token, 1, pos).reshape(-1).long().to(stamp.device)
    entry = hot_index.index_select(0, slot)
    hit = live & (entry >= 0)
    last = req_pass.unsqueeze(1).expand(-1, w).reshape(-1)
    if spread is None:
        spread = torch.arange(rows * w, device=stamp.device) % stamp.numel()
    stamp.scatter_reduce_(0, torch.where(hit, entry.long(), spread), torch.where(hit, last, -1), "amax")
