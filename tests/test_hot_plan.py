"""The vectorised hot-window bookkeeping (``oscar_sglang/sglang/hot.py``) against the reference it replaced.

``tests/hot_reference.py`` keeps the earlier per-request implementation (a
Python loop over requests, ``nonzero``, boolean-mask indexing).  The
vectorised one must leave exactly the same state (``hot_index``, ``owner``,
``stamp``, pass counter) and return the same ``hot_loc`` after every pass, for:

* random serving traffic driven through ``begin_pass`` (the pool's entry
  point; every other seed re-pins with the Triton kernel, as on a GPU): prefills, chunked extends, decodes, rows with no new token, radix
  hits on live and finished requests' prefixes, empty batches, requests
  finishing, their slots reused, cold writes (``release``) in between, with
  random sink/recent windows and region sizes (zero, smaller than the demand);
* raw ``HotSet.update`` calls with arbitrary positions, lengths, kept and
  leaving slots (duplicates, slots that are also written), not only what a
  plan makes.

Both follow the pinning rule (tokens that left their window or whose request
ended are out of window and taken first); the scenario tests below replay
SGLang's schedules (prefill-first chunks, more requests than the pool)
against the rule itself.

A guard (``TorchDispatchMode``) then proves the per-pass path is free of
device syncs and data-dependent shapes: ``pool.begin_pass`` (plan + hot set)
and ``pool.set_kv_buffer``'s release run under it in strict mode, as do the
Triton write and decode kernels' host wrappers; the plain-torch reference
kernels are *not* sync-free (``kernels/write/reference.py`` indexes with a
boolean mask, ``kernels/decode/reference.py`` reads lengths with ``tolist``)
and the test records that instead of hiding it.
"""

import os
import random

import pytest
import torch
from hot_reference import RefHotSet, ref_window_plan
from kernel_device import DEVICE  # (on CPU it also enables the interpreter: the re-pin's Triton kernel)
from torch.utils._python_dispatch import TorchDispatchMode

from oscar_sglang.kernels.scenario import capture_graph
from oscar_sglang.sglang.hot import HotSet, window_plan

aten = torch.ops.aten

# ---------------------------------------------------------------------------
# Window plan


def _plan_as_reference(plan):
    """The fixed ``[batch, sink + recent]`` layout flattened the reference's way (row-major: sinks, then recent)."""
    rows = torch.arange(plan.keep_mask.shape[0]).unsqueeze(1).expand_as(plan.keep_mask)
    leave_rows = torch.arange(plan.leave_mask.shape[0]).unsqueeze(1).expand_as(plan.leave_mask)
    return (plan.new_pos, plan.new_len, rows[plan.keep_mask], plan.keep_pos[plan.keep_mask],
            leave_rows[plan.leave_mask], plan.leave_pos[plan.leave_mask])


def test_window_plan_matches_the_reference_on_random_batches():
    rng = random.Random(0)
    for _ in range(1500):
        batch = rng.choice([0, 1, 1, 2, 3, 5, 8])
        sink, recent = rng.choice([0, 1, 2, 3, 6]), rng.choice([0, 1, 2, 4, 7])
        prefix = [rng.choice([0, 0, 1, sink, sink + 1, rng.randrange(0, 40)]) for _ in range(batch)]
        ext = [rng.choice([0, 1, 1, 2, rng.randrange(0, 30)]) for _ in range(batch)]
        if rng.random() < 0.2:
            ext = [1] * batch                                    # a decode batch
        seq = [p + e for p, e in zip(prefix, ext)]
        ref = ref_window_plan(prefix, seq, sink, recent)
        decode = batch > 0 and all(e == 1 for e in ext)
        dtypes = rng.choice([(torch.int32, torch.int32), (torch.int32, torch.int64), (torch.int64, torch.int64)])
        got = window_plan(torch.tensor(prefix, dtype=dtypes[0]), torch.tensor(seq, dtype=dtypes[1]), sum(ext),
                          sink, recent, one_new_each=decode and rng.random() < 0.5)
        assert got.keep_pos.shape == got.keep_mask.shape == (batch, sink + recent)
        assert got.leave_pos.shape == got.leave_mask.shape
        want = (ref.new_pos, ref.new_len, ref.keep_req, ref.keep_pos, ref.leave_req, ref.leave_pos)
        for a, b in zip(_plan_as_reference(got), want):
            assert a.tolist() == b.tolist(), (prefix, seq, sink, recent)


# ---------------------------------------------------------------------------
# HotSet: identical state after every pass


def _assert_same(new: HotSet, ref: RefHotSet, what=""):
    assert new.clock == ref.clock, what
    assert torch.equal(new.hot_index.cpu(), ref.hot_index), what
    assert torch.equal(new.owner.cpu(), ref.owner), what
    assert torch.equal(new.stamp.cpu(), ref.stamp), what
    c = new.counters
    assert (c["in_window_evictions"], c["denied"]) == (ref.in_window_evictions, ref.denied), what
    if new._req_len is not None:                                  # the request rows tracked
        rows = range(new._req_len.numel())
        assert new._req_len.tolist() == [ref.req_len.get(r, 0) for r in rows], what
        assert [int(new._req_pass[r]) for r in ref.req_len] == [ref.req_pass[r] for r in ref.req_len], what


class _Traffic:
    """Random serving traffic over a slot pool: requests with ``req_to_token`` rows, a prefix cache, slot reuse."""

    def __init__(self, rng: random.Random, num_slots: int, rows: int = 12, width: int = 96, on_end=None):
        self.rng = rng
        self.on_end = on_end or (lambda rows, req_to_token: None)   # SGLang's free_rows hook
        self.free = list(range(1, num_slots))   # slot 0 is SGLang's padding slot
        rng.shuffle(self.free)
        self.refs = {}                            # slot -> holders (live requests + cached sequences)
        self.live = {}                            # row -> slots of the request
        self.cached = []                          # finished requests' slot lists (the radix cache)
        self.free_rows = list(range(rows))
        self.width = width
        self.req_to_token = torch.zeros(rows, width, dtype=torch.int32)

    def _hold(self, slots, d):
        for s in slots:
            self.refs[s] = self.refs.get(s, 0) + d
            if self.refs[s] == 0:
                del self.refs[s]
                self.free.append(s)

    def _alloc(self, n):
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        self._hold(out, 1)
        return out

    def next_pass(self):
        """A batch: [(row, prefix len, new slots)]; a plain decode step (one token each) about a third of the time."""
        rng, batch = self.rng, []
        if self.live and rng.random() < 0.35:
            out = []
            for row, slots in self.live.items():
                new = self._alloc(1) if len(slots) < self.width else None
                if new is None:
                    return out
                out.append((row, len(slots), new))
                slots += new
                self.req_to_token[row, len(slots) - 1] = new[0]
            return out
        for row in list(self.live):
            if rng.random() < 0.15:                                  # finishes; maybe stays cached
                slots = self.live.pop(row)
                self.on_end([row], self.req_to_token)
                self.free_rows.append(row)
                if rng.random() < 0.5:
                    self.cached.append(slots)
                    self._hold(slots, 1)
                self._hold(slots, -1)
        while len(self.cached) > 4:                                  # the cache evicts
            self._hold(self.cached.pop(0), -1)
        for row, slots in self.live.items():
            if rng.random() < 0.8:
                n = rng.choice([1, 1, 1, 0, 2, rng.randrange(0, 12)])  # decode, no token, chunk
                n = min(n, self.width - len(slots))
                batch.append((row, len(slots), n))
        for _ in range(rng.choice([0, 0, 1, 2])):                    # new requests, some on a cached prefix
            if not self.free_rows:
                break
            row = self.free_rows.pop()
            src = rng.choice(self.cached + list(self.live.values()) + [[]])
            shared = src[:rng.randrange(0, len(src) + 1)]
            self._hold(shared, 1)
            self.live[row] = list(shared)
            self.req_to_token[row, :len(shared)] = torch.tensor(shared, dtype=torch.int32)
            batch.append((row, len(shared), min(rng.randrange(0, 40), self.width - len(shared))))
        rng.shuffle(batch)
        out = []
        for row, pre, n in batch:
            new = self._alloc(n) or []
            self.live[row] += new
            self.req_to_token[row, pre:pre + len(new)] = torch.tensor(new, dtype=torch.int32)
            out.append((row, pre, new))
        return out


def _pass_tensors(reqs):
    """A pass of ``_Traffic.next_pass`` as int64 tensors: new slots, request rows, prefix and sequence lengths."""
    loc = torch.tensor([x for _, _, s in reqs for x in s], dtype=torch.int64)
    rows = torch.tensor([r for r, _, _ in reqs], dtype=torch.int64)
    prefix = torch.tensor([p for _, p, _ in reqs], dtype=torch.int64)
    return loc, rows, prefix, prefix + torch.tensor([len(s) for _, _, s in reqs], dtype=torch.int64)


@pytest.mark.parametrize("seed", range(24))
def test_begin_pass_matches_the_reference_through_random_traffic(seed):
    rng = random.Random(seed)
    num_slots = rng.choice([60, 120, 300])
    sink, recent = rng.choice([0, 1, 2, 4]), rng.choice([0, 1, 3, 8])
    sink_entries, recent_entries = rng.choice([0, 1, 3, 8, 40]), rng.choice([0, 2, 5, 16, 200])
    # On DEVICE, as the pool keeps it (CUDA: the compiled re-pin; CPU: the interpreter's), against the CPU reference.
    new = HotSet(num_slots, sink_entries, recent_entries, sink, recent, device=DEVICE)
    ref = RefHotSet(num_slots, sink_entries, recent_entries, sink, recent)
    new.track_requests(12)
    new.kernel_backend = "triton" if seed % 2 else "torch"        # the re-pin: its Triton kernel, or torch

    def on_end(rows, req_to_token):                                  # SGLang's req_to_token lives on the device
        new.end_requests(rows, req_to_token.to(DEVICE)), ref.end_requests(rows, req_to_token)

    traffic = _Traffic(rng, num_slots, width=rng.choice([10, 96]), on_end=on_end)   # 10: rows < sink + recent
    for step in range(40):
        reqs = traffic.next_pass()
        loc, rows, prefix_t, seq_t = _pass_tensors(reqs)
        prefix, seq = prefix_t.tolist(), seq_t.tolist()
        want = ref.begin_pass(loc, rows, prefix, seq, traffic.req_to_token)
        decode = bool(reqs) and all(len(s) == 1 for _, _, s in reqs)
        loc_d, rows_d, seq_d, r2t_d = (t.to(DEVICE) for t in (loc, rows, seq_t, traffic.req_to_token))
        if decode and rng.random() < 0.7:                            # as the backend calls it in decode mode
            got = new.begin_pass(loc_d, rows_d, seq_d - 1, seq_d, r2t_d, decode=True)
        else:                                                        # extend: SGLang's int32 device lengths
            got = new.begin_pass(loc_d, rows_d, torch.tensor(prefix, dtype=torch.int32, device=DEVICE),
                                 torch.tensor(seq, dtype=torch.int32, device=DEVICE), r2t_d)
        what = (seed, step, prefix, seq)
        assert torch.equal(got.cpu(), want), what
        _assert_same(new, ref, what)
        if rng.random() < 0.2 and traffic.refs:                      # a cold write through set_kv_buffer
            cold = torch.tensor(rng.sample(sorted(traffic.refs), min(3, len(traffic.refs))))
            new.release(cold.to(DEVICE)), ref.release(cold)
            _assert_same(new, ref, what)


def _state(hs: HotSet):
    return [t.clone() for t in (hs._hot_index[:-1], hs._owner[:-1], hs._stamp[:-1], hs._clock,
                                hs._in_window_evictions, hs._denied, hs._req_len, hs._req_pass)]


@pytest.mark.parametrize("seed", range(8))
def test_padded_rows_of_a_graph_batch_change_nothing(seed):
    """A decode pass recorded at a padded batch (``live``): the padded rows, whatever rows, slots and lengths
    they hold (live requests', ended requests' with stale rows, SGLang's row 0 / slot 0 / length 1), leave
    the state exactly as the same pass over the live rows alone."""
    rng = random.Random(500 + seed)
    sink, recent = rng.choice([(1, 3), (2, 8), (4, 16)])
    recent_entries = rng.choice([12, 40])                     # 12: live windows get evicted
    padded, plain = (HotSet(200, 8, recent_entries, sink, recent) for _ in range(2))
    for hs in (padded, plain):
        hs.track_requests(12)

    def on_end(rows, req_to_token):
        padded.end_requests(rows, req_to_token), plain.end_requests(rows, req_to_token)

    traffic = _Traffic(rng, 200, width=64, on_end=on_end)
    decodes = 0
    for step in range(150):
        reqs = traffic.next_pass()
        loc, rows, prefix, seq = _pass_tensors(reqs)
        if not (reqs and all(len(s) == 1 for _, _, s in reqs)):
            for hs in (padded, plain):
                hs.begin_pass(loc, rows, prefix, seq, traffic.req_to_token)
            continue
        decodes += 1
        pad = rng.choice([1, 2, 5])
        pad_rows = torch.tensor([rng.choice([0, rng.randrange(12)]) for _ in range(pad)])
        pad_seq = torch.tensor([rng.choice([1, rng.randrange(1, 65)]) for _ in range(pad)])
        held = sorted(traffic.refs)                                 # slots holding tokens (some with a BF16 copy)
        pad_loc = torch.tensor([rng.choice([0, int(rng.choice(loc)), rng.choice(held)]) for _ in range(pad)])
        if rng.random() < 0.2:                                   # a replay of padded rows only (a warm-up)
            padded.begin_pass(pad_loc, pad_rows, pad_seq - 1, pad_seq, traffic.req_to_token, decode=True,
                              live=torch.zeros(pad, dtype=torch.bool))
        want = plain.begin_pass(loc, rows, seq - 1, seq, traffic.req_to_token, decode=True)
        all_seq = torch.cat([seq, pad_seq])
        got = padded.begin_pass(torch.cat([loc, pad_loc]), torch.cat([rows, pad_rows]), all_seq - 1, all_seq,
                                traffic.req_to_token, decode=True, live=torch.arange(len(seq) + pad) < len(seq))
        assert got.tolist() == want.tolist() + [-1] * pad, (seed, step)
        for a, b in zip(_state(padded), _state(plain)):
            assert torch.equal(a, b), (seed, step)
    assert decodes >= 20


@pytest.mark.parametrize("seed", range(12))
def test_update_matches_the_reference_on_arbitrary_inputs(seed):
    """Positions, lengths and kept slots not made by a plan: the policy itself must agree."""
    rng = random.Random(100 + seed)
    num_slots = 50
    sink, recent = rng.choice([0, 2, 5]), rng.choice([0, 3, 9])
    sink_entries, recent_entries = rng.choice([0, 2, 7]), rng.choice([0, 4, 11, 60])
    new = HotSet(num_slots, sink_entries, recent_entries, sink, recent)
    ref = RefHotSet(num_slots, sink_entries, recent_entries, sink, recent)
    for step in range(30):
        n = rng.choice([0, 1, 3, 10, 25])
        slots = torch.tensor(rng.sample(range(num_slots), n), dtype=torch.int64)   # distinct
        pos = torch.tensor([rng.randrange(0, 15) for _ in range(n)], dtype=torch.int64)
        length = pos + torch.tensor([rng.randrange(-2, 12) for _ in range(n)], dtype=torch.int64)
        kept = torch.tensor([rng.randrange(num_slots) for _ in range(rng.choice([0, 4, 20]))], dtype=torch.int32)
        mask = torch.tensor([rng.random() < 0.7 for _ in range(kept.numel())], dtype=torch.bool)
        leave = torch.tensor([rng.randrange(num_slots) for _ in range(rng.choice([0, 3, 9]))], dtype=torch.int32)
        lmask = torch.tensor([rng.random() < 0.6 for _ in range(leave.numel())], dtype=torch.bool)
        want = ref.update(slots, pos, length, kept[mask], leave[lmask])
        got = new.update(slots, pos, length, kept, mask, leave_slots=leave, leave_mask=lmask)
        assert torch.equal(got, want), (seed, step)
        _assert_same(new, ref, (seed, step))
        if rng.random() < 0.3:
            cold = torch.tensor(rng.sample(range(num_slots), 4))
            new.release(cold), ref.release(cold)
            _assert_same(new, ref, (seed, step))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_begin_pass_matches_the_reference_on_cuda():
    rng = random.Random(7)
    new = HotSet(300, 8, 40, 2, 8, device="cuda")
    ref = RefHotSet(300, 8, 40, 2, 8)
    traffic = _Traffic(rng, 300)
    for _ in range(40):
        reqs = traffic.next_pass()
        loc, rows, prefix, seq = _pass_tensors(reqs)
        want = ref.begin_pass(loc, rows, prefix.tolist(), seq.tolist(), traffic.req_to_token)
        args = [t.cuda() for t in (loc, rows, prefix, seq, traffic.req_to_token)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")                      # CUDA itself refuses any sync
        try:
            got = new.begin_pass(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.cpu(), want)
        assert torch.equal(new.hot_index.cpu(), ref.hot_index) and torch.equal(new.stamp.cpu(), ref.stamp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_begin_pass_records_in_a_cuda_graph_with_padded_rows():
    """The decode update as the INT2 backend records it in a decode CUDA graph (backend.py): captured once at a
    padded batch from static buffers (padded rows: slot 0, row 0, length 1, as SGLang pads), replayed with 1 to
    ``bs`` live rows; hot_loc and the whole state equal an eager twin's fed the live rows alone."""
    rng, dev, bs = random.Random(11), torch.device("cuda"), 8
    graph_hs, eager_hs = (HotSet(300, 8, 24, 2, 8, device=dev) for _ in range(2))
    for hs in (graph_hs, eager_hs):
        hs.track_requests(12)
    eager_hs.kernel_backend = "torch"           # the twin on the general torch path; the graph records the fused one

    def on_end(rows, req_to_token):                                  # the traffic's CPU table, as the device's
        r2t_now = req_to_token.to(dev)
        graph_hs.end_requests(rows, r2t_now), eager_hs.end_requests(rows, r2t_now)

    traffic = _Traffic(rng, 300, on_end=on_end)
    r2t = traffic.req_to_token.to(dev)                               # SGLang's req_to_token: one device tensor
    loc_buf = torch.zeros(bs, dtype=torch.int64, device=dev)          # the runner's static buffers
    rows_buf = torch.zeros(bs, dtype=torch.int64, device=dev)
    seq_buf = torch.ones(bs, dtype=torch.int64, device=dev)
    hot_buf = torch.full((bs,), -1, dtype=torch.int64, device=dev)

    def recorded():
        hot_buf.copy_(graph_hs.begin_pass(loc_buf, rows_buf, seq_buf - 1, seq_buf, r2t, decode=True,
                                          live=loc_buf != 0))

    graph, _ = capture_graph(recorded)                               # after warm-ups, as SGLang's runner does
    assert graph_hs.clock == 0                                       # padded-only passes are no passes
    replays = 0
    for step in range(120):
        reqs = traffic.next_pass()
        r2t.copy_(traffic.req_to_token)
        loc, rows, prefix, seq = _pass_tensors(reqs)
        args = [t.to(dev) for t in (loc, rows, prefix, seq)]
        n = len(reqs)
        if reqs and all(len(s) == 1 for _, _, s in reqs) and n <= bs:
            for buf, live, pad in ((loc_buf, loc, 0), (rows_buf, rows, 0), (seq_buf, seq, 1)):
                buf[:n].copy_(live)
                buf[n:].fill_(pad)
            graph.replay()
            want = eager_hs.begin_pass(args[0], args[1], args[3] - 1, args[3], r2t, decode=True)
            assert hot_buf.tolist() == want.tolist() + [-1] * (bs - n), step
            replays += 1
        else:
            for hs in (graph_hs, eager_hs):
                hs.begin_pass(*args, r2t)
        for a, b in zip(_state(graph_hs), _state(eager_hs)):
            assert torch.equal(a, b), step
    assert replays >= 10


# ---------------------------------------------------------------------------
# Guard: no device sync, no data-dependent shape


_SYNC_OPS = {aten._local_scalar_dense, aten.item, aten.nonzero, aten.nonzero_static, aten.nonzero_numpy,
             aten.masked_select, aten.unique_consecutive, aten._unique2, aten.unique_dim, aten.equal,
             aten.is_nonzero}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_, aten._unsafe_index,
              aten._unsafe_index_put}


class NoHostSync(TorchDispatchMode):
    """Raises (``strict``) or records on ops that sync with the device or give data-dependent shapes."""

    def __init__(self, strict=True):
        super().__init__()
        self.strict, self.seen = strict, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        bad = None
        if packet in _SYNC_OPS:
            bad = str(func)
        elif packet in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                bad = f"{func} with a boolean index"
        if bad:
            if self.strict:
                raise AssertionError(f"data-dependent op on the per-pass path: {bad}")
            self.seen.append(bad)
        return func(*args, **kwargs)


_ATOMIC_OPS = {torch.ops.aten.scatter_reduce_, torch.ops.aten.scatter_reduce, torch.ops.aten.scatter_add_,
               torch.ops.aten.scatter_add, torch.ops.aten.index_add_, torch.ops.aten.index_add}


class AtomicHotSpots(TorchDispatchMode):
    """Records, per atomic scatter (``scatter_reduce``, ``scatter_add``, ``index_add``, accumulating
    ``index_put``), how many updates its busiest address gets: on a GPU those updates serialise."""

    def __init__(self):
        super().__init__()
        self.worst = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        index = None
        if packet in _ATOMIC_OPS:
            index = args[2] if len(args) > 2 else kwargs["index"]
        elif packet in (torch.ops.aten.index_put_, torch.ops.aten.index_put) and (
                args[3] if len(args) > 3 else kwargs.get("accumulate", False)):
            index = args[1][0]
        if index is not None and index.numel():
            hits = int(torch.unique(index.reshape(-1), return_counts=True)[1].max())
            self.worst[str(packet)] = max(self.worst.get(str(packet), 0), hits)
        return func(*args, **kwargs)


def test_no_address_takes_most_atomic_updates_of_a_pass():
    """SGLang's req_to_token has 2048-4096 rows whatever the load; the re-pin scans every row's window each
    pass, so its updates for rows without a request (and window positions without an entry) must not all go
    to one address (they did: the trash element took ~rows x window atomic updates per pass)."""
    rng = random.Random(5)
    rows, sink, recent = 512, 4, 16
    hs = HotSet(300, 8, 40, sink, recent)
    hs.track_requests(rows)
    hs.kernel_backend = "torch"      # the torch re-pin's scatter (the Triton kernel issues no no-op updates)
    traffic = _Traffic(rng, 300, rows=rows, width=96, on_end=hs.end_requests)
    spots, most_live = AtomicHotSpots(), 0
    for step in range(30):
        reqs = traffic.next_pass()
        loc, rows_t, prefix, seq = _pass_tensors(reqs)
        most_live = max(most_live, len(traffic.live))
        with spots:
            hs.begin_pass(loc, rows_t, prefix, seq, traffic.req_to_token)
    spread = -(-rows * (sink + recent) // (hs.entries + 1))      # a no-op update per `entries` positions
    bound = spread + most_live                                   # + the live windows sharing a token
    assert spots.worst and max(spots.worst.values()) <= bound, (spots.worst, bound)
    assert rows * (sink + recent) > 20 * bound                   # what the trash took before


def test_the_guard_catches_what_the_reference_does():
    ref = RefHotSet(16, 2, 4, 1, 2)
    with pytest.raises(AssertionError, match="data-dependent op"), NoHostSync():
        ref.update(torch.tensor([1, 2, 3]), torch.arange(3), torch.full((3,), 3))
    with pytest.raises(AssertionError, match="boolean index"), NoHostSync():
        torch.arange(4)[torch.arange(4) > 1]
    with pytest.raises(AssertionError, match="local_scalar_dense"), NoHostSync():
        int(torch.arange(4).sum())


def test_hot_set_update_and_release_pass_the_guard():
    hs = HotSet(64, 4, 12, 2, 4)
    req_to_token = torch.arange(64, dtype=torch.int32).reshape(2, 32)      # row r, position p: slot 32 r + p
    rows = torch.tensor([0, 1])
    with NoHostSync():
        loc = hs.begin_pass(torch.cat([torch.arange(0, 9), torch.arange(32, 35)]), rows, torch.tensor([0, 0]),
                            torch.tensor([9, 3]), req_to_token)                 # prefill (extend)
        for step in range(2):
            seq = torch.tensor([10 + step, 4 + step])
            loc = hs.begin_pass(req_to_token[rows, seq - 1].long(), rows, seq - 1, seq, req_to_token, decode=True)
        hs.release(torch.tensor([3, 4]))
        hs.update(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0))   # empty pass
    assert (loc >= 0).all() and hs.clock == 4


# -- the pool, as the backend drives it (needs SGLang's KVCache base class) --

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
QH, KVH, D, G, LAYERS, SINK, RECENT = 4, 2, 64, 32, 1, 2, 4


def _pool(device):
    pytest.importorskip("sglang")
    from oscar_sglang import artifacts as art
    from oscar_sglang.sglang.pool import OscarInt2Pool
    from oscar_sglang.sglang.settings import ServingConfig

    fp = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=LAYERS, hidden_size=QH * D,
                              num_attention_heads=QH, num_kv_heads=KVH, head_dim=D, vocab_size=100,
                              rope_type="default", rope_theta=1e4)
    g = torch.Generator().manual_seed(0)
    orth = torch.stack([torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
                        for _ in range(KVH)]).float()
    layers = [art.LayerRotation(orth, orth, torch.zeros(KVH, D), torch.ones(KVH), torch.ones(KVH))]
    cfg = ServingConfig(art.RotationArtifacts(fp, "unit", layers, sink=SINK, recent=RECENT, group_size=G),
                        SINK, RECENT, hot_requests=2)
    return OscarInt2Pool(64, 1, torch.bfloat16, head_num=KVH, head_dim=D, layer_num=LAYERS, device=device,
                         config=cfg, start_layer=0, end_layer=LAYERS)


def _decode_pass(pool, device):
    """A decode pass of 2 requests after their prefill, begin_pass under the strict guard; what the layer needs."""
    from oscar_sglang.kernels import api as kernels

    req_to_token = torch.zeros(2, 32, dtype=torch.int32)
    req_to_token[0, :10] = torch.arange(1, 11)
    req_to_token[1, :7] = torch.arange(20, 27)
    req_to_token = req_to_token.to(device)
    pool.begin_pass(torch.cat([torch.arange(1, 10), torch.arange(20, 26)]).to(device),
                    torch.tensor([0, 1], device=device), torch.tensor([0, 0], device=device),
                    torch.tensor([9, 6], device=device), req_to_token)                  # prefill, unguarded
    rows, seq, loc = (torch.tensor(x, device=device) for x in ([0, 1], [10, 7], [10, 26]))
    q = torch.randn(2, QH, D).to(torch.bfloat16).to(device)
    kv = torch.randn(2, KVH, D).to(torch.bfloat16).to(device)
    store, rot = pool.layer(0)
    prefix = seq - 1
    with NoHostSync():                                                                   # strict, as the backend
        hot_loc = pool.begin_pass(loc, rows, prefix, seq, req_to_token, decode=True)    # calls it in decode
    return hot_loc, store, rot, q, kv, rows, seq, loc, req_to_token, kernels


def test_pool_begin_pass_passes_the_guard_and_the_triton_wrappers_do_too():
    """Strict: begin_pass, set_kv_buffer's release, and the Triton write + decode wrappers (interpreter on CPU)."""
    from kernel_device import DEVICE  # (enables Triton's interpreter on CPU)

    pool = _pool(DEVICE)
    hot_loc, store, rot, q, kv, rows, seq, loc, req_to_token, kernels = _decode_pass(pool, DEVICE)
    assert hot_loc.tolist() == [int(pool.hot_index[10]), int(pool.hot_index[26])] and (hot_loc >= 0).all()
    with NoHostSync():
        pool.hot.release(torch.tensor([3], device=DEVICE))
        kernels.write_kv(kv, kv, loc, store, rot, hot_loc, backend="triton")
        out = kernels.decode_attention(q, store, rot, req_to_token, rows, seq, D ** -0.5, backend="triton",
                                       max_seq_len=10)
    ref = kernels.decode_attention(q, store, rot, req_to_token, rows, seq, D ** -0.5, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_the_torch_reference_kernels_are_not_sync_free():
    """Recorded, not hidden: the CPU serving path's plain-torch kernels use data-dependent ops (begin_pass does not)."""
    pool = _pool("cpu")
    hot_loc, store, rot, q, kv, rows, seq, loc, req_to_token, kernels = _decode_pass(pool, "cpu")
    write, decode = NoHostSync(strict=False), NoHostSync(strict=False)
    with write:
        kernels.write_kv(kv, kv, loc, store, rot, hot_loc, backend="torch")
    with decode:
        kernels.decode_attention(q, store, rot, req_to_token, rows, seq, D ** -0.5, backend="torch")
    assert any("boolean index" in s for s in write.seen)                  # hot_loc[hot_loc >= 0] and more
    assert any("boolean index" in s for s in decode.seen)                 # read_rotated's k[hot] and more
