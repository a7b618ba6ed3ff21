"""Bookkeeping of the BF16 hot side pool: which slot owns which entry (DESIGN.md invariant 2).

The side pool has ``entries`` rows shared by all layers and split into two
regions: a **sink** region for the first ``sink`` positions of each sequence
and a **recent** region for the last ``recent`` positions.  ``hot_index[slot]``
is the slot's entry or -1; ``owner[entry]`` is the slot holding the entry or
-1.  Handing out an entry evicts its previous owner (that slot is then read
from INT2: precision lost, never data, because INT2 is always written).

Eviction is least-recently-used, where "used" means "in the window of a
request of this forward pass": every pass stamps the entries of its
requests' sink and recent windows, and new tokens take free entries first,
then the entries stamped longest ago (tokens that left every window, then
finished or waiting requests' windows).  So while the running requests'
windows fit in a region, a prefill burst or a newly admitted request never
takes a running request's hot rows.  A token that leaves its request's
recent window keeps its BF16 copy until the entry is needed: readers take
BF16 at every window and wherever a copy survives, which is never less
precise, and a request that reuses a cached prefix (radix hit) finds the
prefix's tail still in BF16 unless traffic evicted it meanwhile.

Per forward pass, :meth:`HotSet.update` applies, in order:

1. the slots being written drop their old entries (a reused slot never shows
   a freed token's BF16 row);
2. the entries of the cached tokens in the batch's windows are stamped, so a
   request reads BF16 at least at positions ``< sink`` and ``>= len - recent``
   whatever the rest of the traffic (as long as the regions are big enough);
3. new tokens at sink positions get sink entries, new tokens in the recent
   window get recent entries (free or least recently used first).

The returned ``hot_loc`` (entry per new token or -1) is what the write path
copies the rotated BF16 rows to, in every layer.  Plain torch, no host sync,
no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowPlan:
    """Positions touched by one forward pass, in token order of the batch.

    ``new_pos[n]``: position of each new token; ``new_len[n]``: its request's
    length after the pass; ``keep_req``/``keep_pos``: request row (index into
    the batch) and position of the cached tokens in a window (sink or recent)
    after the pass.
    """

    new_pos: torch.Tensor
    new_len: torch.Tensor
    keep_req: torch.Tensor
    keep_pos: torch.Tensor


def window_plan(prefix_lens: list[int], seq_lens: list[int], sink: int, recent: int) -> WindowPlan:
    """Plan for requests extended from ``prefix_lens[b]`` to ``seq_lens[b]`` tokens (host lists).

    The cached tokens in a window are those at ``[0, min(sink, prefix))`` and
    ``[max(sink, seq - recent), prefix)``.
    """
    new_pos, new_len, keep_req, keep_pos = [], [], [], []
    for b, (n0, n1) in enumerate(zip(prefix_lens, seq_lens)):
        if n1 < n0:
            raise ValueError(f"request {b}: sequence length {n1} is below its prefix length {n0}")
        new_pos.append(torch.arange(n0, n1))
        new_len.append(torch.full((n1 - n0,), n1))
        for k0, k1 in ((0, min(sink, n0)), (max(sink, n1 - recent), n0)):
            if k1 > k0:
                keep_pos.append(torch.arange(k0, k1))
                keep_req.append(torch.full((k1 - k0,), b))

    def cat(parts):
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    return WindowPlan(cat(new_pos), cat(new_len), cat(keep_req), cat(keep_pos))


class _Region:
    """A contiguous range of entries handed out free-first, then least recently used."""

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size


class HotSet:
    """``hot_index`` and entry ownership for a side pool of ``sink_entries + recent_entries`` rows."""

    def __init__(self, num_slots: int, sink_entries: int, recent_entries: int, sink: int, recent: int,
                 device: torch.device | str = "cpu"):
        if min(sink_entries, recent_entries, sink, recent) < 0:
            raise ValueError("hot pool sizes and windows must be >= 0")
        self.sink, self.recent = sink, recent
        self.entries = sink_entries + recent_entries
        self.hot_index = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((self.entries,), -1, dtype=torch.long, device=device)
        # pass number an entry was last in a batch's window; -1 = free
        self.stamp = torch.full((self.entries,), -1, dtype=torch.long, device=device)
        self.clock = 0
        self._sink_region = _Region(0, sink_entries)
        self._recent_region = _Region(sink_entries, recent_entries)

    @property
    def device(self) -> torch.device:
        return self.hot_index.device

    def release(self, slots: torch.Tensor) -> None:
        """Slots lose their entries (if any); the entries become free."""
        if slots.numel() == 0:
            return
        slots = slots.to(self.device).long()
        entry = self.hot_index[slots].long()
        held = entry[entry >= 0]
        self.owner[held] = -1
        self.stamp[held] = -1
        self.hot_index[slots] = -1

    def touch(self, slots: torch.Tensor) -> None:
        """Stamp the entries of ``slots`` (those holding one) as used by this pass."""
        if slots.numel() == 0:
            return
        entry = self.hot_index[slots.to(self.device).long()].long()
        self.stamp[entry[entry >= 0]] = self.clock

    def _assign(self, slots: torch.Tensor, region: _Region) -> torch.Tensor:
        """Give each slot an entry of ``region`` (only the last ``region.size`` if more); returns entries or -1."""
        out = torch.full((slots.numel(),), -1, dtype=torch.long, device=self.device)
        n = min(slots.numel(), region.size)
        if n == 0:
            return out
        slots = slots[-n:].long()
        stamps = self.stamp[region.start:region.start + region.size]
        entries = region.start + torch.argsort(stamps, stable=True)[:n]
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
               kept_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Apply one forward pass (see the module docstring); returns ``hot_loc`` int64 ``[n]``."""
        self.clock += 1
        new_slots = new_slots.to(self.device).long()
        new_pos = new_pos.to(self.device)
        new_len = new_len.to(self.device)
        self.release(new_slots)
        if kept_slots is not None:
            self.touch(kept_slots)
        hot_loc = torch.full((new_slots.numel(),), -1, dtype=torch.long, device=self.device)
        is_sink = new_pos < self.sink
        is_recent = ~is_sink & (new_pos >= new_len - self.recent)
        for mask, region in ((is_sink, self._sink_region), (is_recent, self._recent_region)):
            idx = mask.nonzero().squeeze(-1)
            if idx.numel():
                hot_loc[idx] = self._assign(new_slots[idx], region)
        return hot_loc
