"""REFERENCE ONLY (test oracle): the hot-window bookkeeping written the plain way.

The per-request implementation that ``oscar_sglang/sglang/hot.py`` replaced
(Python loop over requests and windows, ``nonzero`` and boolean-mask
indexing, host lists in), extended with the same pinning rule (entries of
tokens that left their window or whose request ended go "out of window",
stamp 0, and are taken before in-window ones; an entry still in a live
request's window keeps at least that request's last pass as stamp), so the tests can assert that
the vectorised :class:`oscar_sglang.sglang.hot.HotSet` and
:func:`~oscar_sglang.sglang.hot.window_plan` produce exactly the same
``hot_index``, ``owner``, ``stamp``, counters and ``hot_loc`` on every input,
and so ``scripts/bench_host_overhead.py`` can time a per-request path.  Never
imported by the serving code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RefWindowPlan:
    """``new_pos``/``new_len`` per new token; ``keep_req``/``keep_pos`` per cached token in a window;
    ``leave_req``/``leave_pos`` per cached token leaving the recent window."""

    new_pos: torch.Tensor
    new_len: torch.Tensor
    keep_req: torch.Tensor
    keep_pos: torch.Tensor
    leave_req: torch.Tensor
    leave_pos: torch.Tensor


def ref_window_plan(prefix_lens: list[int], seq_lens: list[int], sink: int, recent: int) -> RefWindowPlan:
    """Kept tokens: ``[0, min(sink, prefix))`` and ``[max(sink, seq - recent), prefix)`` per request;
    leaving: ``[max(sink, prefix - recent), min(prefix, max(sink, seq - recent)))``."""
    new_pos, new_len, keep_req, keep_pos, leave_req, leave_pos = [], [], [], [], [], []
    for b, (n0, n1) in enumerate(zip(prefix_lens, seq_lens)):
        if n1 < n0:
            raise ValueError(f"request {b}: sequence length {n1} is below its prefix length {n0}")
        new_pos.append(torch.arange(n0, n1))
        new_len.append(torch.full((n1 - n0,), n1))
        for k0, k1 in ((0, min(sink, n0)), (max(sink, n1 - recent), n0)):
            if k1 > k0:
                keep_pos.append(torch.arange(k0, k1))
                keep_req.append(torch.full((k1 - k0,), b))
        l0, l1 = max(sink, n0 - recent), min(n0, max(sink, n1 - recent))
        if l1 > l0:
            leave_pos.append(torch.arange(l0, l1))
            leave_req.append(torch.full((l1 - l0,), b))

    def cat(parts):
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    return RefWindowPlan(cat(new_pos), cat(new_len), cat(keep_req), cat(keep_pos), cat(leave_req), cat(leave_pos))


class _Region:
    def __init__(self, start: int, size: int):
        self.start, self.size = start, size


class RefHotSet:
    """The earlier ``HotSet``: same state (``hot_index``, ``owner``, ``stamp``, ``clock``), same policy."""

    def __init__(self, num_slots: int, sink_entries: int, recent_entries: int, sink: int, recent: int,
                 device: torch.device | str = "cpu"):
        if min(sink_entries, recent_entries, sink, recent) < 0:
            raise ValueError("hot pool sizes and windows must be >= 0")
        self.sink, self.recent = sink, recent
        self.entries = sink_entries + recent_entries
        self.hot_index = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((self.entries,), -1, dtype=torch.long, device=device)
        self.stamp = torch.full((self.entries,), -1, dtype=torch.long, device=device)
        self.clock = 0
        self.in_window_evictions = self.denied = 0
        self.req_len: dict[int, int] = {}                # live request rows: length after their last pass
        self.req_pass: dict[int, int] = {}               # ... and that pass's number
        self._sink_region = _Region(0, sink_entries)
        self._recent_region = _Region(sink_entries, recent_entries)

    @property
    def device(self) -> torch.device:
        return self.hot_index.device

    def release(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(self.device).long()
        entry = self.hot_index[slots].long()
        held = entry[entry >= 0]
        self.owner[held] = -1
        self.stamp[held] = -1
        self.hot_index[slots] = -1

    def retire(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        entry = self.hot_index[slots.to(self.device).long()].long()
        self.stamp[entry[entry >= 0]] = 0

    def _window(self, n: int) -> list[int]:
        return sorted(set(range(min(self.sink, n))) | set(range(max(self.sink, n - self.recent), n)))

    def end_requests(self, rows: list[int], req_to_token: torch.Tensor) -> None:
        for row in rows:
            n = self.req_len.pop(row, 0)
            self.req_pass.pop(row, None)
            pos = self._window(n)
            if pos:
                self.retire(req_to_token[row, torch.tensor(pos)])
        if self.sink + self.recent:
            self.repin(req_to_token)

    def repin(self, req_to_token: torch.Tensor) -> None:
        """Every live request's window: its entries' stamps at least the request's last pass."""
        for row, n in self.req_len.items():
            for p in self._window(n):
                entry = int(self.hot_index[int(req_to_token[row, p])])
                if entry >= 0:
                    self.stamp[entry] = max(int(self.stamp[entry]), self.req_pass[row])

    def touch(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        entry = self.hot_index[slots.to(self.device).long()].long()
        self.stamp[entry[entry >= 0]] = self.clock

    def _assign(self, slots: torch.Tensor, region: _Region) -> torch.Tensor:
        out = torch.full((slots.numel(),), -1, dtype=torch.long, device=self.device)
        n = min(slots.numel(), region.size)
        self.denied += slots.numel() - n
        if n == 0:
            return out
        slots = slots[-n:].long()
        stamps = self.stamp[region.start:region.start + region.size]
        entries = region.start + torch.argsort(stamps, stable=True)[:n]
        self.in_window_evictions += int((self.stamp[entries] > 0).sum())
        prev = self.owner[entries]
        evicted = prev[prev >= 0]
        still = self.hot_index[evicted].long() == entries[prev >= 0]
        self.hot_index[evicted[still]] = -1
        self.owner[entries] = slots
        self.stamp[entries] = self.clock
        self.hot_index[slots] = entries.to(torch.int32)
        out[-n:] = entries
        return out

    def update(self, new_slots: torch.Tensor, new_pos: torch.Tensor, new_len: torch.Tensor,
               kept_slots: torch.Tensor | None = None, leave_slots: torch.Tensor | None = None,
               repin: torch.Tensor | None = None) -> torch.Tensor:
        self.clock += 1
        new_slots = new_slots.to(self.device).long()
        new_pos = new_pos.to(self.device)
        new_len = new_len.to(self.device)
        self.release(new_slots)
        if leave_slots is not None:
            self.retire(leave_slots)
        if kept_slots is not None:
            self.touch(kept_slots)
        if repin is not None:
            self.repin(repin)
        hot_loc = torch.full((new_slots.numel(),), -1, dtype=torch.long, device=self.device)
        is_sink = new_pos < self.sink
        is_recent = ~is_sink & (new_pos >= new_len - self.recent)
        for mask, region in ((is_sink, self._sink_region), (is_recent, self._recent_region)):
            idx = mask.nonzero().squeeze(-1)
            if idx.numel():
                hot_loc[idx] = self._assign(new_slots[idx], region)
        return hot_loc

    def begin_pass(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: list[int],
                   seq_lens: list[int], req_to_token: torch.Tensor, repin: bool = True) -> torch.Tensor:
        """What ``OscarInt2Pool.begin_pass`` does (host lists of lengths); ``repin=False``: what it did before
        2026-12-02, without re-pinning the windows of live requests outside the batch."""
        plan = ref_window_plan(prefix_lens, seq_lens, self.sink, self.recent)
        rows = req_pool_indices.to(self.device).long()
        for row, n in zip(rows.tolist(), seq_lens):
            self.req_len[row] = n
            self.req_pass[row] = self.clock + 1                  # the pass update() is about to count
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        kept = req_to_token[rows[plan.keep_req], plan.keep_pos] if plan.keep_pos.numel() else empty
        leave = req_to_token[rows[plan.leave_req], plan.leave_pos] if plan.leave_pos.numel() else empty
        return self.update(out_cache_loc, plan.new_pos, plan.new_len, kept, leave,
                           repin=req_to_token if repin else None)
