"""The pinning rule of the hot side pool under SGLang's real schedules (``oscar_sglang/sglang/hot.py``).

SGLang runs a waiting prefill before any decode, so a long prompt in chunks
is a series of prefill-only passes while the running requests sit out; it
frees a request's ``req_to_token`` row when the request finishes, is
aborted or retracted (``ReqToTokenPool.free_rows``, hooked to
``HotSet.end_requests``).  These tests drive ``HotSet.begin_pass`` exactly as
the pool does (SGLang's batch tensors and ``req_to_token``), with a pool
sized by ``sizing.hot_plan``, and assert what the issue asked: every live
request's window (positions ``< sink`` and ``>= len - recent``) reads BF16
after every pass, nothing counted as an in-window eviction, while the pool
holds the live windows; counters when it cannot.  Each scenario also runs
without the rule's inputs (no end-of-request hook) or with the pool too small,
to show the assertion can fail.
"""

import torch

from oscar_sglang.sglang import sizing
from oscar_sglang.sglang.hot import HotSet

S, W = 4, 16


class Server:
    """Requests over a slot pool, passes as SGLang's scheduler makes them, through ``HotSet.begin_pass``."""

    def __init__(self, hot_requests: int, rows: int = 16, width: int = 512, end_hook: bool = True):
        plan = sizing.hot_plan(hot_requests, S, W)
        self.hs = HotSet(20000, plan.sink_entries, plan.recent_entries, S, W)
        self.req_to_token = torch.zeros(rows, width, dtype=torch.int32)
        self.hs.track_requests(rows)
        self.next_slot, self.free_rows = 1, list(range(1, rows))
        self.len, self.end_hook = {}, end_hook

    def admit(self, shared_from: int | None = None, shared: int = 0) -> int:
        row = self.free_rows.pop(0)
        if shared_from is not None:                              # a radix hit: the prefix's slots are reused
            self.req_to_token[row, :shared] = self.req_to_token[shared_from, :shared]
        self.len[row] = shared
        return row

    def finish(self, row: int) -> None:
        if self.end_hook:
            self.hs.end_requests([row], self.req_to_token)
        del self.len[row]
        self.free_rows.append(row)                               # its slots stay cached (radix cache)

    def run(self, batch: dict[int, int]) -> torch.Tensor:
        """One forward pass: ``{row: new tokens}``."""
        rows = list(batch)
        prefix = [self.len[r] for r in rows]
        loc = []
        for r in rows:
            n = batch[r]
            new = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int32)
            self.next_slot += n
            self.req_to_token[r, self.len[r]:self.len[r] + n] = new
            self.len[r] += n
            loc.append(new)
        seq = [self.len[r] for r in rows]
        decode = all(batch[r] == 1 for r in rows)
        return self.hs.begin_pass(torch.cat(loc).long(), torch.tensor(rows), torch.tensor(prefix, dtype=torch.int32),
                                  torch.tensor(seq, dtype=torch.int32), self.req_to_token, decode=decode)

    def decode(self, rows) -> None:
        self.run({r: 1 for r in rows})

    def cold_window_tokens(self, rows=None) -> int:
        """Window tokens of live requests without a BF16 copy."""
        cold = 0
        for r in (rows if rows is not None else self.len):
            n = self.len[r]
            pos = torch.tensor(sorted(set(range(min(S, n))) | set(range(max(S, n - W), n))), dtype=torch.long)
            cold += int((self.hs.hot_index[self.req_to_token[r, pos].long()] < 0).sum())
        return cold


def _running(server: Server, n: int, prompt: int = 40, steps: int = 5) -> list[int]:
    rows = [server.admit() for _ in range(n)]
    server.run({r: prompt for r in rows})
    for _ in range(steps):
        server.decode(rows)
    return rows


def test_chunked_prefill_keeps_the_running_requests_windows():
    """The issue's replay: 4 running requests, a 6-chunk prompt, prefill first. Before: 64 of 64 recent entries cold."""
    srv = Server(hot_requests=4)
    running = _running(srv, 4)
    assert srv.cold_window_tokens() == 0
    long = srv.admit()
    for _ in range(6):                                           # prefill-only passes: the running requests sit out
        srv.run({long: 48})
        assert srv.cold_window_tokens() == 0                    # the long prompt's window too
    for _ in range(3):
        srv.decode(running + [long])
        assert srv.cold_window_tokens() == 0
    c = srv.hs.counters
    assert c["in_window_evictions"] == 0 and c["denied"] == 0
    assert c["in_window"] == 5 * (S + W)                       # exactly the live windows are pinned


def test_finished_requests_give_their_entries_back_first():
    """A finished request's window goes out of window: a new request takes it, not a running request's."""
    srv = Server(hot_requests=4)
    rows = _running(srv, 5)                                     # 4 windows + the burst window: full
    assert srv.cold_window_tokens() == 0
    for step in range(6):                                       # each step: one finishes, a new one prefills
        srv.finish(rows.pop(0))
        new = srv.admit()
        srv.run({new: 30 + step})
        rows.append(new)
        srv.decode(rows)
        assert srv.cold_window_tokens() == 0, step
    assert srv.hs.counters["in_window_evictions"] == 0


def test_without_the_end_of_request_hook_running_windows_are_lost():
    """Control for the test above: without ``end_requests`` the finished windows stay pinned and live ones go."""
    srv = Server(hot_requests=4, end_hook=False)
    rows = _running(srv, 5)
    for step in range(6):
        srv.finish(rows.pop(0))
        new = srv.admit()
        srv.run({new: 30 + step})
        rows.append(new)
        srv.decode(rows)
    assert srv.hs.counters["in_window_evictions"] > 0 and srv.cold_window_tokens() > 0


def test_more_requests_than_the_pool_are_counted():
    """Windows of more requests than the pool holds cannot all be BF16: the losses are counted, nothing breaks."""
    srv = Server(hot_requests=2)
    rows = _running(srv, 6)
    c = srv.hs.counters
    assert srv.cold_window_tokens() > 0
    assert c["in_window_evictions"] > 0
    assert c["in_window"] == srv.hs.entries                     # every entry holds a live window token


def test_a_radix_hit_pins_a_finished_prefix_again():
    """The sinks and tail of a finished request's prefix are out of window until a new request reuses them."""
    srv = Server(hot_requests=4)
    a = srv.admit()
    srv.run({a: 40})
    srv.decode([a])
    prefix_slots = srv.req_to_token[a, :41].clone().long()
    srv.finish(a)
    sinks = srv.hs.hot_index[prefix_slots[:S]].long()
    assert (sinks >= 0).all() and (srv.hs.stamp[sinks] == 0).all()   # copies kept, out of window
    b = srv.admit(shared_from=a, shared=41)
    srv.run({b: 3})                                             # extend on the cached prefix
    assert (srv.hs.stamp[sinks] > 0).all() and srv.cold_window_tokens([b]) == 0


def _full_of_finished_windows(srv: Server, n: int = 3) -> None:
    """Requests that ran and finished: their window entries fill the regions, all out of window, none free."""
    for _ in range(n):
        junk = srv.admit()
        srv.run({junk: 52})
        srv.finish(junk)
    assert srv.hs.counters["free"] == 0 and srv.hs.counters["in_window"] == 0


def _b_on_a_s_prefix(srv: Server) -> tuple[int, int]:
    """On a pool full of finished windows, A prefills 40 tokens and B reuses A's prefix while A runs (a radix hit on
    a live request) and extends it by 2: B's window holds A's sinks and the prefix's tail (positions 26..39)."""
    _full_of_finished_windows(srv)
    a = srv.admit()
    srv.run({a: 40})
    b = srv.admit(shared_from=a, shared=40)
    srv.run({b: 2})
    return a, b


def _shared_prefix_then_sharer_ends(srv: Server) -> int:
    """A ends, then a prompt C prefills while B sits out: C's tokens take the out-of-window entries with the lowest
    index first, which are A's."""
    a, b = _b_on_a_s_prefix(srv)
    srv.finish(a)
    c = srv.admit()
    srv.run({c: 30})
    return b


def test_sinks_of_a_live_radix_prefix_stay_when_the_request_that_wrote_them_ends():
    srv = Server(hot_requests=2)
    b = _shared_prefix_then_sharer_ends(srv)
    assert srv.cold_window_tokens([b]) == 0
    assert srv.hs.counters["in_window_evictions"] == 0


def test_without_repinning_a_shared_prefix_loses_its_sinks(monkeypatch):
    """Control: A's end retires the shared window tokens, and C takes them although B still reads them."""
    monkeypatch.setattr(HotSet, "_repin", lambda self, req_to_token: None)
    srv = Server(hot_requests=2)
    b = _shared_prefix_then_sharer_ends(srv)
    assert srv.cold_window_tokens([b]) == S + 14                 # B's sinks and the prefix tail 26..39 it reads


def _shared_tail_then_owner_moves_on(srv: Server) -> int:
    """A's next chunk (B sits out) moves A's window past positions 24-31, and A's new tokens want entries."""
    a, b = _b_on_a_s_prefix(srv)
    srv.run({a: 8})
    return b


def test_a_shared_tail_stays_while_the_other_request_still_has_it_in_its_window():
    srv = Server(hot_requests=2)
    b = _shared_tail_then_owner_moves_on(srv)
    assert srv.cold_window_tokens([b]) == 0
    assert srv.hs.counters["in_window_evictions"] == 0


def test_without_repinning_a_shared_tail_goes_cold(monkeypatch):
    monkeypatch.setattr(HotSet, "_repin", lambda self, req_to_token: None)
    srv = Server(hot_requests=2)
    b = _shared_tail_then_owner_moves_on(srv)
    assert srv.cold_window_tokens([b]) == 6                      # positions 26..31: A's leaving tokens in B's window


def test_tokens_leaving_the_window_go_out_of_window_in_the_same_pass():
    srv = Server(hot_requests=1)
    r = srv.admit()
    srv.run({r: 30})                                            # recent window [14, 30)
    slot_14 = int(srv.req_to_token[r, 14])
    entry = int(srv.hs.hot_index[slot_14])
    assert entry >= 0 and int(srv.hs.stamp[entry]) > 0
    srv.decode([r])                                             # window [15, 31): position 14 leaves
    assert int(srv.hs.hot_index[slot_14]) == entry and int(srv.hs.stamp[entry]) == 0
    srv.run({r: 5})                                             # a chunk: positions 15..19 leave
    left = srv.hs.hot_index[srv.req_to_token[r, 15:20].long()].long()
    assert (srv.hs.stamp[left[left >= 0]] == 0).all()


# -- the SGLang glue: SGLang's own ReqToTokenPool, the INT2 pool, the plugin's hook functions --


def test_freed_request_rows_reach_the_hot_set_through_the_plugin_hooks():
    import pytest

    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from test_hot_plan import _pool

    from oscar_sglang.sglang import memory, plugin

    assert (f"{plugin.REQ_TO_TOKEN_POOL}.free_rows", memory.end_requests, "BEFORE") in plugin.HOOKS
    assert (f"{plugin.REQ_TO_TOKEN_POOL}.clear", memory.flush_requests, "AFTER") in plugin.HOOKS
    pool = _pool("cpu")                                          # sink 2, recent 4, 2 hot requests
    rtt = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    pool.attach_requests(rtt)
    assert rtt.oscar_pool is pool
    row = rtt.alloc_rows(1)[0]
    rtt.req_to_token[row, :10] = torch.arange(1, 11, dtype=torch.int32)
    rows = torch.tensor([row])
    pool.begin_pass(torch.arange(1, 11), rows, torch.tensor([0]), torch.tensor([10]), rtt.req_to_token)
    window = pool.hot_index[torch.tensor([1, 2, 7, 8, 9, 10])].long()
    assert (window >= 0).all() and (pool.hot.stamp[window] > 0).all()
    memory.end_requests(rtt, [row])                              # what the BEFORE hook does, then SGLang frees
    rtt.free_rows([row])
    assert (pool.hot_index[torch.tensor([1, 2, 7, 8, 9, 10])].long() == window).all()   # copies kept
    assert (pool.hot.stamp[window] == 0).all()                                           # out of window
    rtt.clear()
    memory.flush_requests(None, rtt)                             # the AFTER hook on clear()
    assert (pool.hot_index < 0).all() and pool.hot.counters["free"] == pool.hot.entries


def test_startup_warning_when_sglang_may_run_more_requests_than_the_pool_holds():
    from oscar_sglang.sglang.memory import hot_pool_warning

    assert hot_pool_warning(32, 32) is None and hot_pool_warning(32, None) is None
    msg = hot_pool_warning(32, 400)
    assert "32 requests" in msg and "up to 400" in msg and "--oscar-hot-requests" in msg


# -- what the metrics read (oscar_sglang/sglang/metrics.py) --


def test_bf16_read_share_counts_hot_slots_of_each_request():
    from oscar_sglang.sglang.metrics import bf16_reads, log_line, snapshot

    srv = Server(hot_requests=4)
    rows = _running(srv, 3, prompt=30, steps=2)
    lens = torch.tensor([srv.len[r] for r in rows])
    brute_hot = sum(int((srv.hs.hot_index[srv.req_to_token[r, :srv.len[r]].long()] >= 0).sum()) for r in rows)
    for chunk in (1, 2, 16):
        assert bf16_reads(srv.hs.hot_index, srv.req_to_token, torch.tensor(rows), lens, chunk) == (
            brute_hot, int(lens.sum()))
    assert brute_hot >= 3 * (S + W)                              # every window, plus copies that left it
    pool = type("PoolView", (), {"hot": srv.hs, "hot_index": srv.hs.hot_index})()
    batch = type("Batch", (), {"req_pool_indices": torch.tensor(rows), "seq_lens": lens})()
    s = snapshot(pool, batch, srv.req_to_token)
    assert s["oscar_hot_in_window_entries"] == 3 * (S + W) and s["reads"] == (brute_hot, int(lens.sum()))
    assert f"{3 * (S + W)}/{srv.hs.entries} entries in window" in log_line(s)


def test_the_log_line_parses_back(tmp_path):
    from oscar_sglang.sglang.metrics import log_line, log_lines, snapshot

    srv = Server(hot_requests=2)
    rows = _running(srv, 3)
    pool = type("PoolView", (), {"hot": srv.hs, "hot_index": srv.hs.hot_index})()
    batch = type("Batch", (), {"req_pool_indices": torch.tensor(rows),
                               "seq_lens": torch.tensor([srv.len[r] for r in rows])})()
    s = snapshot(pool, batch, srv.req_to_token)
    log = tmp_path / "server.log"
    log.write_text(f"[t] Decode batch\n[t] {log_line(s)}\nother\n[t] {log_line(s)}\n")
    got = log_lines(log)
    assert len(got) == 2 and got[0] == got[1]
    assert got[0] == {"in_window": s["oscar_hot_in_window_entries"], "entries": s["oscar_hot_entries"],
                      "out_of_window": s["oscar_hot_out_of_window_entries"],
                      "in_window_evictions": s["oscar_hot_in_window_evictions"], "denied": s["oscar_hot_denied_tokens"],
                      "bf16_reads": s["reads"][0], "reads": s["reads"][1]}


def test_prometheus_series_follow_the_counters():
    import pytest

    prometheus_client = pytest.importorskip("prometheus_client")
    from oscar_sglang.sglang.metrics import HotPoolMetrics, snapshot

    registry = prometheus_client.CollectorRegistry()
    m = HotPoolMetrics({"model_name": "m"}, registry=registry)
    srv = Server(hot_requests=2)
    _running(srv, 6)                                            # more than the pool: evictions
    m.update(snapshot(type("P", (), {"hot": srv.hs, "hot_index": srv.hs.hot_index})()))
    ev = registry.get_sample_value("sglang:oscar_hot_in_window_evictions_total", {"model_name": "m"})
    assert ev == srv.hs.counters["in_window_evictions"] > 0
    assert registry.get_sample_value("sglang:oscar_hot_entries", {"model_name": "m"}) == srv.hs.entries
    m.update(snapshot(type("P", (), {"hot": srv.hs, "hot_index": srv.hs.hot_index})()))   # no double counting
    assert registry.get_sample_value("sglang:oscar_hot_in_window_evictions_total", {"model_name": "m"}) == ev
