"""A decode pass of the hot side pool's bookkeeping in a few launches (CUDA; the math: ``HotSet`` in
``oscar_sglang/sglang/hot.py``, whose general torch path is this pass's reference).

A decode pass over a batch of ``bs`` rows (one new token each; ``live`` False: a CUDA graph's padded row,
which changes nothing) is, in the torch path, ~80 small tensor ops.  Here:

1. ``_release_retire_track`` (one program, a lane per row): the new token's slot drops its old entry
   (``release``), the cached token leaving the row's recent window (position ``seq - 1 - recent`` if it
   is ``>= sink``) goes out of window (``retire``), and the row's length and pass are recorded for the
   re-pin;
2. the re-pin of every live window (``kernels/repin``), which also stamps the cached window tokens of the
   batch's rows (what the torch path's ``touch`` does: their rows were just recorded with this pass);
3. per region, the ``k`` entries with the smallest ``(stamp, entry)`` keys (``torch.topk``, as the torch
   path);
4. ``_assign`` (one program, a lane per row): which new tokens take an entry of which region (the last
   ``region size`` of them when more ask), the previous owners losing it, the new owners, stamps,
   ``hot_index``, the pass counter and the two counters, and ``hot_loc``.

The lanes of one program touch distinct slots and entries within a phase (a slot holds at most one entry;
new tokens' slots are not cached tokens' slots); ``tl.debug_barrier`` separates the phases that read what
another lane may write.  Needs the request rows tracked (``HotSet.track_requests``, as the server does).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _lanes(live_ptr, bs, HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr):
    """A lane per batch row: its index, whether it is a row, whether the row is live (not a graph's padding)."""
    i = tl.arange(0, BLOCK)
    inb = i < bs
    live = inb
    if HAS_LIVE:
        live = inb & (tl.load(live_ptr + i, mask=inb, other=0) != 0)
    return i, inb, live


@triton.jit
def _release_retire_track(loc_ptr, rows_ptr, seq_ptr, live_ptr, hot_index_ptr, owner_ptr, stamp_ptr,
                          req_len_ptr, req_pass_ptr, clock_ptr, req_to_token_ptr, stride_row, bs,
                          SINK: tl.constexpr, RECENT: tl.constexpr, HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr):
    i, inb, live = _lanes(live_ptr, bs, HAS_LIVE, BLOCK)
    slot = tl.load(loc_ptr + i, mask=live, other=0)
    row = tl.load(rows_ptr + i, mask=live, other=0)
    seq = tl.load(seq_ptr + i, mask=live, other=0)
    # release: the new token's slot drops its old entry (if any)
    old = tl.load(hot_index_ptr + slot, mask=live, other=-1)
    had = live & (old >= 0)
    tl.store(owner_ptr + old, -1, mask=had)
    tl.store(stamp_ptr + old, -1, mask=had)
    tl.store(hot_index_ptr + slot, -1, mask=live)
    # retire: the cached token at seq - 1 - RECENT leaves the recent window (if it is not a sink)
    if RECENT > 0:
        lp = seq - 1 - RECENT
        leaving = live & (lp >= SINK)
        lslot = tl.load(req_to_token_ptr + row * stride_row + lp, mask=leaving, other=0)
        lent = tl.load(hot_index_ptr + lslot, mask=leaving, other=-1)
        tl.store(stamp_ptr + lent, 0, mask=leaving & (lent >= 0))
    # the row's length and this pass (the clock after it), for the re-pin
    clock = tl.load(clock_ptr)
    tl.store(req_len_ptr + row, seq, mask=live)
    tl.store(req_pass_ptr + row, clock + 1, mask=live)


@triton.jit
def _region_take(wants, order_ptr, size, over):
    """(take, entry) of the tokens wanting an entry of a region: its smallest-key entries ``order_ptr[0:]``
    in token order; if more may want one than the region has (``over``), only the last ``size`` take one."""
    w = wants.to(tl.int32)
    rank = tl.cumsum(w, 0)
    first = tl.maximum(tl.sum(w, 0) - (size - 1), 1)
    j = tl.where(over != 0, tl.maximum(rank - first, -1), rank - 1)
    take = wants & (j >= 0)
    entry = tl.load(order_ptr + j, mask=take, other=-1)
    return take, entry


@triton.jit
def _assign(loc_ptr, seq_ptr, live_ptr, sink_order_ptr, recent_order_ptr, hot_index_ptr, owner_ptr, stamp_ptr,
            clock_ptr, evictions_ptr, denied_ptr, hot_loc_ptr, bs, sink_size, sink_over, recent_size, recent_over,
            SINK: tl.constexpr, RECENT: tl.constexpr, HAS_LIVE: tl.constexpr, HAS_SINK: tl.constexpr,
            HAS_RECENT: tl.constexpr, BLOCK: tl.constexpr):
    i, inb, live = _lanes(live_ptr, bs, HAS_LIVE, BLOCK)
    slot = tl.load(loc_ptr + i, mask=inb, other=0)
    seq = tl.load(seq_ptr + i, mask=inb, other=1)
    pos = seq - 1
    is_sink = live & (pos < SINK)
    is_recent = live & (pos >= tl.maximum(seq - RECENT, SINK))
    take = tl.zeros([BLOCK], dtype=tl.int1)
    entry = tl.full([BLOCK], -1, tl.int64)
    if HAS_SINK:
        take_s, entry_s = _region_take(is_sink, sink_order_ptr, sink_size, sink_over)
        take = take | take_s
        entry = tl.where(take_s, entry_s, entry)
    if HAS_RECENT:
        take_r, entry_r = _region_take(is_recent, recent_order_ptr, recent_size, recent_over)
        take = take | take_r
        entry = tl.where(take_r, entry_r, entry)
    clock = tl.load(clock_ptr) + tl.max(live.to(tl.int64), 0)          # a pass of padded rows only is no pass
    evicted = take & (tl.load(stamp_ptr + entry, mask=take, other=-1) > 0)
    # the previous owners lose the entries (if still theirs)
    prev = tl.load(owner_ptr + entry, mask=take, other=-1)
    has_prev = take & (prev >= 0)
    still = has_prev & (tl.load(hot_index_ptr + prev, mask=has_prev, other=-1).to(tl.int64) == entry)
    tl.debug_barrier()
    tl.store(hot_index_ptr + prev, -1, mask=still)
    tl.debug_barrier()
    tl.store(owner_ptr + entry, slot, mask=take)
    tl.store(stamp_ptr + entry, clock, mask=take)
    tl.store(hot_index_ptr + slot, entry.to(tl.int32), mask=take)
    tl.store(hot_loc_ptr + i, entry, mask=inb)
    tl.store(clock_ptr, clock)
    tl.store(evictions_ptr, tl.load(evictions_ptr) + tl.sum(evicted.to(tl.int64), 0))
    tl.store(denied_ptr, tl.load(denied_ptr) + tl.sum((is_sink | is_recent).to(tl.int64), 0)
             - tl.sum(take.to(tl.int64), 0))


def decode_pass(hs, loc: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, req_to_token: torch.Tensor,
                live: torch.Tensor | None, repin) -> torch.Tensor:
    """One decode pass of hot set ``hs`` (request rows tracked); returns ``hot_loc`` int64 ``[bs]``.

    ``loc``: the new tokens' slots; ``rows``, ``seq``: their request rows and lengths after the pass;
    ``live``: which rows are real (None: all); ``repin()``: the re-pin of every live window (step 2).
    """
    bs = loc.numel()
    if bs == 0 or rows.numel() != bs:
        raise ValueError(f"decode_pass: one new token per row, and at least one row (got {bs} tokens, "
                         f"{rows.numel()} rows)")
    out = torch.full((bs,), -1, dtype=torch.long, device=loc.device)
    block = max(triton.next_power_of_2(bs), 16)
    loc, rows, seq = loc.long(), rows.long(), seq.long()
    has_live = live is not None
    live_t = live if has_live else loc                                   # unused without live
    _release_retire_track[(1,)](loc, rows, seq, live_t, hs._hot_index, hs._owner, hs._stamp, hs._req_len,
                                hs._req_pass, hs._clock, req_to_token, req_to_token.stride(0), bs,
                                SINK=hs.sink, RECENT=hs.recent, HAS_LIVE=has_live, BLOCK=block,
                                enable_fp_fusion=True)
    repin()
    regions = []
    for region, window in ((hs._sink_region, hs.sink), (hs._recent_region, hs.recent)):
        demand = min(bs, bs * window)
        k = min(demand, region.size)
        regions.append((region.smallest(k) if k else out, region.size, k, demand > region.size))
    (sink_order, sink_size, sink_k, sink_over), (recent_order, recent_size, recent_k, recent_over) = regions
    # sizes and "more may ask than the region has" are run-time arguments: one compiled kernel per power of
    # two of the batch, not one per batch size (CUDA graph capture sizes, eager decode batches)
    _assign[(1,)](loc, seq, live_t, sink_order, recent_order, hs._hot_index, hs._owner, hs._stamp, hs._clock,
                  hs._in_window_evictions, hs._denied, out, bs, sink_size, int(sink_over), recent_size,
                  int(recent_over), SINK=hs.sink, RECENT=hs.recent, HAS_LIVE=has_live, HAS_SINK=sink_k > 0,
                  HAS_RECENT=recent_k > 0, BLOCK=block, enable_fp_fusion=True)
    return out
