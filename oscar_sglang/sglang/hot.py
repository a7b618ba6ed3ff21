"""Bookkeeping of the BF16 hot side pool: which slot owns which entry (DESIGN.md invariant 2).

The side pool has ``entries`` rows shared by all layers and split into two
regions: a **sink** region for the first ``sink`` positions of each sequence
and a **recent** region for the last ``recent`` positions.  ``hot_index[slot]``
is the slot's entry or -1; ``owner[entry]`` is the slot holding the entry or
-1.  Handing out an entry evicts its previous owner (that slot is then read
from INT2: precision lost, never data, because INT2 is always written).

Which entry a new token takes (the **pinning rule**): free entries first,
then *out-of-window* entries, and only then, least recently used first,
entries still in the window of a live request.  An entry holds its token's
copy in one of three states, kept in ``stamp``:

* ``-1``: free;
* ``0``: out of window: its token left its request's recent window (a pass
  of that request moved the window past it) or its request ended
  (:meth:`HotSet.end_requests`, called when SGLang frees the request's row:
  finished, aborted or retracted);
* ``> 0``: the pass number when it was last in the window of a request of a
  forward pass: *in window*, pinned as long as out-of-window or free entries
  are left.

So a chunked prefill recycles the entries its own earlier chunks left behind,
and the windows of running requests that sit out a few prefill-only passes
keep their BF16 rows, as long as the region holds every live window (the
pool is sized for ``hot_requests`` windows; the server warns at startup if
SGLang may run more requests at once).  Where a region is too small, an
in-window entry is taken anyway (that token is then read from INT2:
precision lost, never data, because INT2 is always written) and counted in
:attr:`HotSet.counters` (``in_window_evictions``; ``denied``: tokens of a
window that got no entry at all).  A token that leaves its window keeps its
BF16 copy until the entry is needed: readers take BF16 at every window and
wherever a copy survives, which is never less precise, and a request that
reuses a cached prefix (radix hit) finds the prefix's tail still in BF16
unless traffic took it meanwhile; its first pass pins it again.

Per forward pass, :meth:`HotSet.update` applies, in order:

1. the slots being written drop their old entries (a reused slot never shows
   a freed token's BF16 row);
2. the entries of the cached tokens that leave their request's recent window
   in this pass become out of window;
3. the entries of the cached tokens in the batch's windows are stamped, so a
   request reads BF16 at least at positions ``< sink`` and ``>= len - recent``
   whatever the rest of the traffic (as long as the regions are big enough);
   then every live request's window is re-pinned (an entry in it gets at
   least that request's last pass as stamp), so a token shared through a
   radix hit stays in window while any live request still has it in its
   window, even when the request that retired it in step 2 (or ended) is
   another one and the sharer sits out this pass;
4. new tokens at sink positions get sink entries, new tokens in the recent
   window get recent entries (free, then out of window, then least recently
   used; the last ``region size`` tokens of the pass if more ask; among
   equally ranked entries the lowest first).

The returned ``hot_loc`` (entry per new token or -1) is what the write path
copies the rotated BF16 rows to, in every layer.

**No host work per request, no device sync.**  :func:`window_plan` and
:meth:`HotSet.update` are fixed sequences of tensor ops (about 90 per
decode pass whatever the batch, the re-pin 19 of them) whose shapes depend
only on host numbers SGLang already has (batch size, number of new tokens), on the request rows and on the settings: no
``nonzero``, no boolean-mask indexing, no ``.item()``.  Masked writes go to
one spare element at the end of ``hot_index``, ``owner`` and ``stamp`` (the
*trash*, index -1, so an absent entry ``-1`` addresses it by itself; never
read back as state), the pass counter lives on the device, and "the last
``n`` tokens of a region take the ``n`` least recently stamped entries" is a
cumulative sum (rank of each token) and a ``topk`` over the region's
``(stamp, entry)`` keys.  So a decode CUDA graph records the update with the
layers (``backend.py``), its padded rows masked out (``begin_pass(live=)``).
``tests/hot_reference.py`` keeps a per-request implementation of the same
policy; the tests fuzz this one against it.

**On CUDA** (with the request rows tracked, as the server does) a decode
pass is the fused one of ``kernels/hot_pass`` (two Triton kernels, the
re-pin kernel of ``kernels/repin`` and each region's ``topk``: 12 launches
per pass, docs/host_overhead.md), tested equal to this general torch path
state for state; extend passes and the CPU run the torch path, its re-pin
the torch reference of ``kernels/repin``.  No SGLang imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oscar_sglang import windows
from oscar_sglang.kernels import api as kernels


@dataclass(frozen=True)
class WindowPlan:
    """Positions touched by one forward pass.

    ``new_pos [n]``: position of each new token, in token order of the batch;
    ``new_len [n]``: its request's length after the pass.  The cached tokens in
    a window after the pass, in a fixed layout ``[batch, sink + recent]``:
    ``keep_pos[b, j]`` is a position of request ``b`` and ``keep_mask[b, j]``
    says whether it is a cached token in a window (elsewhere the position is
    unused, may be past the sequence, and is never below 0).  Columns
    ``j < sink`` are positions ``j``, the others ``max(sink, seq - recent) + j - sink``.
    ``leave_pos``/``leave_mask [batch, L]``: the cached tokens that leave the
    recent window in this pass, ``[max(sink, prefix - recent), min(prefix,
    max(sink, seq - recent)))``, at columns ``max(sink, prefix - recent) + j``
    (``L = 1`` for a decode plan, else ``recent``; same masking rule).
    """

    new_pos: torch.Tensor
    new_len: torch.Tensor
    keep_pos: torch.Tensor
    keep_mask: torch.Tensor
    leave_pos: torch.Tensor
    leave_mask: torch.Tensor


def _lengths(x: torch.Tensor | Sequence[int], device: torch.device | str | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        return torch.as_tensor(x, dtype=torch.long, device=device)
    return x if device is None else x.to(device)           # int32 or int64: the arithmetic promotes


def window_plan(prefix_lens: torch.Tensor | Sequence[int], seq_lens: torch.Tensor | Sequence[int], num_new: int,
                sink: int, recent: int, device: torch.device | str | None = None, *,
                one_new_each: bool = False) -> WindowPlan:
    """Plan for requests extended from ``prefix_lens[b]`` to ``seq_lens[b]`` tokens, all in tensor ops.

    ``prefix_lens``, ``seq_lens``: ``[batch]`` (device tensors; lists are
    accepted for tests); ``num_new``: the number of new tokens,
    ``sum(seq_lens - prefix_lens)``, which the caller knows on the host
    (``out_cache_loc.numel()``); it is not checked (that would sync).
    ``one_new_each``: the caller guarantees ``seq = prefix + 1`` (decode),
    which saves the token-to-request map.  The new tokens are at positions
    ``[prefix, seq)``; the cached tokens in a window are those at
    ``[0, min(sink, prefix))`` and ``[max(sink, seq - recent), prefix)``.
    """
    prefix = _lengths(prefix_lens, device)
    seq = _lengths(seq_lens, prefix.device)
    dev = prefix.device
    if one_new_each:
        new_pos, new_len = prefix, seq
    elif num_new > 0:
        end = torch.cumsum(seq - prefix, 0)                      # token index after each request's new tokens
        token = torch.arange(num_new, device=dev)
        req = torch.searchsorted(end, token, right=True)         # request of each new token
        new_pos = token + (seq - end).index_select(0, req)       # position = token index + (prefix - first token)
        new_len = seq.index_select(0, req)
    else:
        new_pos = new_len = torch.zeros(0, dtype=torch.long, device=dev)
    col, recent_col = _columns(sink, recent, dev)
    # recent columns start at max(sink, seq - recent); a position is kept iff it is cached (< prefix)
    keep_pos = windows.layout_positions(seq.unsqueeze(1), sink, recent, col, recent_col)   # [batch, sink + recent]
    keep_mask = keep_pos < prefix.unsqueeze(1)
    # leaving the recent window: [max(sink, prefix - recent), min(prefix, max(sink, seq - recent)))
    width = min(recent, 1) if one_new_each else recent
    start = torch.clamp(prefix - recent, min=sink).unsqueeze(1)
    end = torch.minimum(prefix, torch.clamp(seq - recent, min=sink)).unsqueeze(1)
    leave_pos = start + col[:width]
    leave_mask = leave_pos < end
    return WindowPlan(new_pos, new_len, keep_pos, keep_mask, leave_pos, leave_mask)


_COLUMNS: dict = {}


def _columns(sink: int, recent: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Column ``j`` of the keep layout: ``j``, and whether it is a recent column (constants, cached per device)."""
    key = (sink, recent, str(device))
    if key not in _COLUMNS:
        col = torch.arange(sink + recent, device=device)
        _COLUMNS[key] = (col, (col >= sink).long())
    return _COLUMNS[key]


class _Region:
    """A contiguous range of entries handed out free-first, then least recently used."""

    def __init__(self, start: int, size: int, stamp: torch.Tensor):
        self.start, self.size = start, size
        self.stamp = stamp[start:start + size]                   # a view of the hot set's stamps
        # sort key (stamp, entry) as one integer: stamp * size + (size + local index); -1 (free) sorts first
        self.tie = torch.arange(size, size + size, device=stamp.device)

    def smallest(self, k: int) -> torch.Tensor:
        """The ``k`` entries with the smallest ``(stamp, entry)``, in that order (indices of the whole set)."""
        key = torch.add(self.tie, self.stamp, alpha=self.size)
        order = torch.topk(key, k, largest=False, sorted=True).indices
        return order + self.start if self.start else order


class HotSet:
    """``hot_index`` and entry ownership for a side pool of ``sink_entries + recent_entries`` rows."""

    def __init__(self, num_slots: int, sink_entries: int, recent_entries: int, sink: int, recent: int,
                 device: torch.device | str = "cpu"):
        if min(sink_entries, recent_entries, sink, recent) < 0:
            raise ValueError("hot pool sizes and windows must be >= 0")
        self.sink, self.recent = sink, recent
        self.num_slots = num_slots
        self.entries = sink_entries + recent_entries
        # one spare element at the end of each (the trash, index -1) absorbs masked writes
        self._hot_index = torch.full((num_slots + 1,), -1, dtype=torch.int32, device=device)
        self._owner = torch.full((self.entries + 1,), -1, dtype=torch.long, device=device)
        # pass number an entry was last in a batch's window; -1 = free
        self._stamp = torch.full((self.entries + 1,), -1, dtype=torch.long, device=device)
        self.hot_index = self._hot_index[:num_slots]
        self.owner = self._owner[:self.entries]
        self.stamp = self._stamp[:self.entries]
        self._clock = torch.zeros((), dtype=torch.long, device=device)   # passes so far, on the device
        self._none = torch.tensor(-1, dtype=torch.long, device=device)     # "no entry / no slot / free"
        self._cold = torch.tensor(-1, dtype=torch.int32, device=device)    # hot_index of a cold slot
        self._zero = torch.zeros((), dtype=torch.long, device=device)    # stamp of an out-of-window entry
        self._sink_region = _Region(0, sink_entries, self._stamp)
        self._recent_region = _Region(sink_entries, recent_entries, self._stamp)
        # counters (device): in-window entries taken for another token; window tokens that got no entry
        self._in_window_evictions = torch.zeros((), dtype=torch.long, device=device)
        self._denied = torch.zeros((), dtype=torch.long, device=device)
        # length of each request row after its last pass, and that pass's number (see track_requests)
        self._req_len: torch.Tensor | None = None
        self._req_pass: torch.Tensor | None = None
        # made now, not first inside a CUDA graph capture (where it would hold nothing until a replay)
        _columns(sink, recent, self.device)
        # the re-pin (kernels.repin_windows) and, with request rows tracked, decode passes (kernels/hot_pass):
        # "auto" = Triton on CUDA, torch elsewhere; "triton" (tests: the interpreter on CPU) or "torch"
        self.kernel_backend = "auto"

    @property
    def device(self) -> torch.device:
        return self._hot_index.device

    @property
    def clock(self) -> int:
        """Passes so far (reads the device counter: for tests and logs, not for the serving path)."""
        return int(self._clock)

    @property
    def counters(self) -> dict[str, int]:
        """Host copies of the counters (syncs: for metrics, logs and tests, not the per-pass path).

        ``in_window_evictions``: entries taken while still in the window of a
        request that had not ended (that token is read from INT2 from then
        on); ``denied``: new tokens in a window that got no entry (region
        smaller than the pass's demand); ``in_window``/``out_of_window``/
        ``free``: entries in each state now.
        """
        return {"in_window_evictions": int(self._in_window_evictions), "denied": int(self._denied),
                "in_window": int((self.stamp > 0).sum()), "out_of_window": int((self.stamp == 0).sum()),
                "free": int((self.stamp < 0).sum())}

    def track_requests(self, rows: int) -> None:
        """Remember each request row's length and last pass, so windows of live requests can be found.

        :meth:`end_requests` finds an ending request's window from it, and
        every pass re-pins the windows of the live requests that are not in
        its batch (:meth:`_repin`).  ``rows``: the number of rows of SGLang's
        ``req_to_token`` (allocated once, before serving: the per-pass path
        then only writes into it).
        """
        # one spare element at the end of each (the trash, index -1): a CUDA graph's padded rows write there
        self._req_len_buf = torch.zeros(rows + 1, dtype=torch.long, device=self.device)
        self._req_pass_buf = torch.zeros(rows + 1, dtype=torch.long, device=self.device)
        self._req_len, self._req_pass = self._req_len_buf[:rows], self._req_pass_buf[:rows]
        # where the torch re-pin's no-op updates go (kernels/repin/reference.py): spread over the stamps
        self._spread = torch.arange(rows * (self.sink + self.recent), device=self.device) % (self.entries + 1)

    def _fused_decode(self) -> bool:
        """Decode passes in a few Triton launches (``kernels/hot_pass``): on CUDA with the request rows tracked
        (as the server does), or wherever ``kernel_backend`` is "triton" (tests, under the interpreter)."""
        if self._req_len is None:
            return False
        return self.kernel_backend == "triton" or (self.kernel_backend == "auto" and self.device.type == "cuda")

    def end_requests(self, rows, req_to_token: torch.Tensor) -> None:
        """Requests in ``rows`` (``req_to_token`` rows being freed) ended: their window entries go out of window.

        Their BF16 copies stay until the entries are needed (a radix hit on
        the prefix pins them again).  Tokens still in the window of another
        live request (a prefix shared through a radix hit: its sinks, often)
        stay in window, stamped with that request's last pass
        (:meth:`_repin`).  Needs :meth:`track_requests`; a no-op without it.
        Called by SGLang's ``ReqToTokenPool.free_rows`` hook, before the rows
        are reused.
        """
        if self._req_len is None:
            return
        rows = torch.as_tensor(rows, dtype=torch.long).to(self.device).reshape(-1)
        if rows.numel() == 0:
            return
        length = self._req_len.index_select(0, rows)
        self._req_len.index_put_((rows,), self._zero)
        if self.sink + self.recent:
            self.retire(*self._window_slots(length, rows, req_to_token))
            self._repin(req_to_token)

    def _window_slots(self, length: torch.Tensor, rows: torch.Tensor, req_to_token: torch.Tensor):
        """Slots of the windows of request ``rows`` at ``length`` tokens, flat ``[rows * (sink + recent)]``,
        and which of them are window positions (the layout of :func:`window_plan`'s ``keep_pos`` with
        prefix = seq; the re-pin, ``kernels/repin``, walks the same layout over every row)."""
        length = length.unsqueeze(1)
        col, recent_col = _columns(self.sink, self.recent, self.device)
        pos = windows.layout_positions(length, self.sink, self.recent, col, recent_col)
        live = pos < length
        pos = torch.clamp(pos, max=req_to_token.shape[1] - 1).to(req_to_token.device)
        slots = req_to_token[rows.to(req_to_token.device).unsqueeze(1), pos]
        return slots.to(self.device).reshape(-1).long(), live.reshape(-1)

    def _repin(self, req_to_token: torch.Tensor) -> None:
        """Entries in the window of a live request get at least that request's last pass as stamp.

        So a token another request retired (its window moved past a shared
        prefix token, or it ended) stays in window while a live request still
        reads it there, ranked as if that request alone had stamped it; entries
        already stamped later keep their stamp.  Over every row of
        ``req_to_token``: one launch of the Triton kernel on CUDA (a row
        without a request costs two loads), the torch reference's 19 ops over
        fixed shapes ``[rows * (sink + recent)]`` elsewhere; no sync.
        """
        if self.sink + self.recent == 0:
            return
        kernels.repin_windows(self._stamp, self._hot_index, self._req_len, self._req_pass, req_to_token,
                              self.sink, self.recent, self._spread, backend=self.kernel_backend)

    def reset(self) -> None:
        """Every entry free, no request tracked (SGLang's cache flush: no slot holds a token any more)."""
        self._hot_index.fill_(-1)
        self._owner.fill_(-1)
        self._stamp.fill_(-1)
        if self._req_len is not None:
            self._req_len_buf.zero_()
            self._req_pass_buf.zero_()

    def retire(self, slots: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """The entries of ``slots`` (those holding one, and where ``mask``) go out of window (stamp 0)."""
        if slots.numel() == 0:
            return
        entry = self._hot_index.index_select(0, slots.to(self.device).reshape(-1).long())
        if mask is not None:
            entry = torch.where(mask.to(self.device).reshape(-1), entry, self._cold)
        self._stamp.index_put_((entry.long(),), self._zero)

    def release(self, slots: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Slots (where ``mask``, if given) lose their entries (if any); the entries become free."""
        if slots.numel() == 0:
            return
        slots = slots.to(self.device).reshape(-1)
        entry = self._hot_index.index_select(0, slots)           # -1 (none) addresses the trash
        if mask is not None:                                     # elsewhere both writes go to the trashes
            entry, slots = torch.where(mask, entry, self._cold), torch.where(mask, slots, self._none)
        self._owner.index_put_((entry,), self._none)
        self._stamp.index_put_((entry,), self._none)
        self._hot_index.index_put_((slots,), self._cold)

    def touch(self, slots: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Stamp the entries of ``slots`` (those holding one, and where ``mask`` if given) as used by this pass."""
        if slots.numel() == 0:
            return
        entry = self._hot_index.index_select(0, slots.to(self.device).reshape(-1))
        if mask is not None:
            entry = torch.where(mask.to(self.device).reshape(-1), entry, self._cold)
        self._stamp.index_put_((entry,), self._clock)

    def _candidates(self, wants: torch.Tensor, region: _Region, demand: int):
        """Which tokens of ``wants`` get an entry of ``region``, and which: ``(j, take, order)`` or None.

        If more tokens want one than the region has, only the last
        ``region.size`` (in token order) take one.  The ``n`` takers get the
        ``n`` entries with the smallest ``(stamp, entry)``, in that order (free
        ones first, as a stable sort of the stamps would give): taker ``i``
        gets ``order[j[i]]``.  ``j`` is in ``[-1, k)`` for every token.
        ``demand`` (host) bounds how many tokens can want one.
        """
        k = min(demand, region.size)
        if k == 0:
            return None
        rank = torch.cumsum(wants, 0)                           # 1-based rank among the tokens that want one
        if demand > region.size:                                # the first ones get nothing if too many
            first = torch.clamp(rank[-1:] - (region.size - 1), min=1)
            j = torch.clamp(rank - first, min=-1)
            take = wants & (j >= 0)
        else:
            j, take = rank - 1, wants                           # j = -1 before the first taker
        return j, take, region.smallest(k)

    def _assign(self, slots: torch.Tensor, is_sink: torch.Tensor, is_recent: torch.Tensor, sink_demand: int,
                recent_demand: int) -> torch.Tensor:
        """New tokens at sink positions get sink entries, those in the recent window recent entries; ``hot_loc``.

        Both regions in one set of writes: their entries are disjoint, and so
        are their previous owners (a slot holds at most one entry).
        """
        sink = self._candidates(is_sink, self._sink_region, sink_demand)
        recent = self._candidates(is_recent, self._recent_region, recent_demand)
        if sink is None and recent is None:
            self._denied.add_((is_sink | is_recent).sum())
            return self._none.expand(slots.numel()).clone()
        if sink is None or recent is None:
            j, take, order = sink or recent
        else:                                                   # recent entries follow the sink ones in order
            order = torch.cat([sink[2], recent[2]])
            j = torch.where(recent[1], recent[0] + sink[2].numel(), sink[0])
            take = sink[1] | recent[1]
        entry = torch.take(order, j)                            # j = -1 reads a valid (unused) element
        entry_t = torch.where(take, entry, self._none)          # -1: the trash
        self._in_window_evictions.add_(((torch.take(self._stamp, entry_t) > 0) & take).sum())
        # the previous owners lose the entry (if it is still theirs; for non-takers prev is the trash's
        # owner and the write below stores -1 where -1 already is)
        prev = torch.take(self._owner, entry_t)
        still = torch.take(self._hot_index, prev) == entry_t
        self._hot_index.index_put_((torch.where(still, prev, self._none),), self._cold)
        self._owner.index_put_((entry_t,), slots)
        self._stamp.index_put_((entry_t,), self._clock)
        self._hot_index.index_put_((torch.where(take, slots, self._none),), entry.to(torch.int32))
        self._denied.add_((is_sink | is_recent).sum() - take.sum())
        return entry_t

    def update(self, new_slots: torch.Tensor, new_pos: torch.Tensor, new_len: torch.Tensor,
               kept_slots: torch.Tensor | None = None, kept_mask: torch.Tensor | None = None,
               batch_size: int | None = None, leave_slots: torch.Tensor | None = None,
               leave_mask: torch.Tensor | None = None, repin: torch.Tensor | None = None,
               new_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply one forward pass (see the module docstring); returns ``hot_loc`` int64 ``[n]``.

        ``new_slots`` must be distinct (SGLang never writes a slot twice in a
        pass), except where ``new_mask`` (``[n]`` bool) is False: those new
        tokens take no entry (their ``hot_loc`` is -1) and their slots are not
        released (a CUDA graph's padded rows; with no new token left the pass
        does not count).  ``leave_slots`` (any shape) go out of window where
        ``leave_mask``, then ``kept_slots`` are stamped where ``kept_mask``,
        then, given SGLang's ``req_to_token`` as ``repin`` (and
        :meth:`track_requests`), the windows of all live requests are
        re-pinned (:meth:`_repin`), before any new token takes an entry.
        ``batch_size`` (host), when the positions come from
        :func:`window_plan`, bounds a region's takers by ``batch * window``.
        """
        new_slots = new_slots.to(self.device).long()
        n = new_slots.numel()
        if new_mask is None:
            self._clock.add_(1)
        else:                                                   # a pass of padded rows only is no pass
            new_mask = new_mask.to(self.device)
            self._clock.add_(new_mask.any())
        self.release(new_slots, new_mask)
        if leave_slots is not None:
            self.retire(leave_slots, leave_mask)
        if kept_slots is not None:
            self.touch(kept_slots, kept_mask)
        if repin is not None and self._req_len is not None:
            self._repin(repin)
        if n == 0:
            return torch.full((0,), -1, dtype=torch.long, device=self.device)
        new_pos = new_pos.to(self.device)
        new_len = new_len.to(self.device)
        is_sink = windows.in_sink(new_pos, self.sink)
        is_recent = windows.in_recent(new_pos, new_len, self.sink, self.recent)
        if new_mask is not None:
            is_sink, is_recent = is_sink & new_mask, is_recent & new_mask
        sink_demand = recent_demand = n
        if batch_size is not None:
            sink_demand, recent_demand = min(n, batch_size * self.sink), min(n, batch_size * self.recent)
        return self._assign(new_slots, is_sink, is_recent, sink_demand, recent_demand)

    def begin_pass(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor,
                   prefix_lens: torch.Tensor | Sequence[int], seq_lens: torch.Tensor | Sequence[int],
                   req_to_token: torch.Tensor, *, decode: bool = False,
                   live: torch.Tensor | None = None) -> torch.Tensor:
        """One forward pass from SGLang's batch tensors; returns ``hot_loc`` per new token.

        Request ``b`` (row ``req_pool_indices[b]`` of ``req_to_token``) grows
        from ``prefix_lens[b]`` to ``seq_lens[b]`` tokens; its new tokens are at
        ``out_cache_loc``, in request order.  ``decode``: one new token per
        request (``seq = prefix + 1``).  ``live`` (decode only, ``[batch]``
        bool): rows where it is False are a CUDA graph's padding and change
        nothing (no entry taken, stamped, retired or released, no length
        tracked; ``hot_loc`` -1), so the pass can be recorded at a padded batch
        size and replayed with any number of live rows.  Device tensors in,
        device tensors out; the only host numbers used are the sizes of
        ``out_cache_loc``, ``req_pool_indices`` and ``req_to_token``.
        """
        n, batch = out_cache_loc.numel(), req_pool_indices.numel()
        if live is not None and not decode:
            raise ValueError("live rows are for decode passes (one new token per row)")
        if decode and n and self._fused_decode():
            return kernels.hot_decode_pass(self, out_cache_loc.to(self.device), req_pool_indices.to(self.device),
                                           _lengths(seq_lens, self.device), req_to_token,
                                           None if live is None else live.to(self.device),
                                           lambda: self._repin(req_to_token))
        plan = window_plan(prefix_lens, seq_lens, n, self.sink, self.recent, device=self.device,
                           one_new_each=decode)
        kept = leave = None
        rows = req_pool_indices.to(self.device)
        keep_mask, leave_mask = plan.keep_mask, plan.leave_mask
        if live is not None:
            live = live.to(self.device)
            keep_mask, leave_mask = keep_mask & live.unsqueeze(1), leave_mask & live.unsqueeze(1)
        if batch and plan.keep_pos.shape[1]:
            pos = plan.keep_pos
            if req_to_token.shape[1] < self.sink + self.recent:   # unused columns may point past a short row
                pos = torch.clamp(pos, max=req_to_token.shape[1] - 1)
            kept = req_to_token[rows.unsqueeze(1), pos]
        if batch and plan.leave_pos.shape[1]:
            leave = req_to_token[rows.unsqueeze(1), torch.clamp(plan.leave_pos, max=req_to_token.shape[1] - 1)]
        if self._req_len is not None and batch:
            tracked = rows.long() if live is None else torch.where(live, rows.long(), self._none)  # -1: trash
            self._req_len_buf.index_put_((tracked,), _lengths(seq_lens, self.device).long())
            self._req_pass_buf.index_put_((tracked,), self._clock + 1)     # the pass update() is about to count
        return self.update(out_cache_loc, plan.new_pos, plan.new_len, kept, keep_mask, batch_size=batch,
                           leave_slots=leave, leave_mask=leave_mask, repin=req_to_token, new_mask=live)
