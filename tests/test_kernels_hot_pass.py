"""The fused decode pass of the hot side pool (``kernels/hot_pass``, Triton; the interpreter on CPU) against
``HotSet``'s general torch path, which ``tests/test_hot_plan.py`` fuzzes against the per-request oracle.

Twin hot sets through random serving traffic (prefills, chunks, radix hits, requests ending, slot reuse):
every pass that is a decode step runs fused in one and in torch in the other, often at a padded batch
(a CUDA graph's rows that must change nothing), with window sizes and regions from none to too small for
the batch; after every pass the whole state (``hot_index``, owners, stamps, clock, counters, tracked
lengths and passes) and ``hot_loc`` must be identical.  Integers only: exact.
"""

import random

import case_grid
import pytest
import torch
from kernel_device import DEVICE
from test_hot_plan import _pass_tensors, _state, _Traffic

from oscar_sglang.sglang.hot import HotSet


def _twins(rng, num_slots, rows, device):
    sink, recent = rng.choice([0, 1, 2, 4]), rng.choice([0, 1, 3, 8])
    sink_entries, recent_entries = rng.choice([0, 1, 3, 8, 40]), rng.choice([0, 2, 5, 16, 200])
    fused, plain = (HotSet(num_slots, sink_entries, recent_entries, sink, recent, device=device) for _ in range(2))
    for hs, backend in ((fused, "triton"), (plain, "torch")):
        hs.track_requests(rows)
        hs.kernel_backend = backend
    return fused, plain


# under the interpreter by default the first 8 seeds' traffic (about 1.4 s each there), on a GPU all 16
@pytest.mark.parametrize("seed", case_grid.params([(s,) for s in range(16)], range(8), lambda c: str(c[0])))
def test_fused_decode_pass_matches_the_torch_path(seed):
    rng = random.Random(900 + seed)
    num_slots, rows = rng.choice([60, 120, 300]), 12
    fused, plain = _twins(rng, num_slots, rows, DEVICE)

    def on_end(ended, req_to_token):
        for hs in (fused, plain):
            hs.end_requests(ended, req_to_token.to(DEVICE))

    traffic = _Traffic(rng, num_slots, rows=rows, width=64, on_end=on_end)
    decodes = 0
    for step in range(80):
        reqs = traffic.next_pass()
        r2t = traffic.req_to_token.to(DEVICE)
        loc, rws, prefix, seq = (t.to(DEVICE) for t in _pass_tensors(reqs))
        if not (reqs and all(len(s) == 1 for _, _, s in reqs)):
            for hs in (fused, plain):
                hs.begin_pass(loc, rws, prefix, seq, r2t)
            continue
        decodes += 1
        live = None
        if rng.random() < 0.5:                                      # a CUDA graph's padded batch
            pad = rng.choice([1, 3])
            held = sorted(traffic.refs) or [0]
            loc = torch.cat([loc, torch.tensor([rng.choice([0, rng.choice(held)]) for _ in range(pad)],
                                               device=DEVICE)])
            rws = torch.cat([rws, torch.tensor([rng.choice([0, rng.randrange(rows)]) for _ in range(pad)],
                                               device=DEVICE)])
            seq = torch.cat([seq, torch.tensor([rng.choice([1, rng.randrange(1, 10)]) for _ in range(pad)],
                                               device=DEVICE)])
            live = torch.arange(loc.numel(), device=DEVICE) < len(reqs)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")                 # CUDA itself refuses any sync
        try:
            got = fused.begin_pass(loc, rws, seq - 1, seq, r2t, decode=True, live=live)
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        want = plain.begin_pass(loc, rws, seq - 1, seq, r2t, decode=True, live=live)
        assert torch.equal(got, want), (seed, step)
        for name, a, b in zip(("hot_index", "owner", "stamp", "clock", "evictions", "denied", "req_len",
                               "req_pass"), _state(fused), _state(plain)):
            assert torch.equal(a, b), (seed, step, name)
    assert decodes >= 8


def test_untracked_or_cpu_auto_hot_sets_keep_the_torch_path(monkeypatch):
    """Fused only with the request rows tracked (the re-pin stands in for the torch path's touch) and on
    Triton: an untracked set, or "auto" on CPU, never calls it."""
    from oscar_sglang.kernels import api

    calls = []
    monkeypatch.setattr(api, "hot_decode_pass", lambda *a, **k: calls.append(1))
    req_to_token = torch.arange(64, dtype=torch.int32).reshape(2, 32)
    for tracked, backend in ((False, "triton"), (True, "auto")):
        hs = HotSet(64, 4, 12, 2, 4)
        hs.kernel_backend = backend
        if tracked:
            hs.track_requests(2)
        out = hs.begin_pass(torch.tensor([5, 37]), torch.tensor([0, 1]), torch.tensor([5, 5]),
                            torch.tensor([6, 6]), req_to_token, decode=True)
        assert out.shape == (2,)
    assert not calls
    hs.kernel_backend = "triton"
    hs.begin_pass(torch.tensor([6, 38]), torch.tensor([0, 1]), torch.tensor([6, 6]), torch.tensor([7, 7]),
                  req_to_token, decode=True)
    assert calls == [1]


def test_fused_decode_pass_is_sync_free():
    """Strict guard (no ``item``, ``nonzero``, boolean-mask indexing): what a CUDA graph records."""
    from test_hot_plan import NoHostSync

    hs = HotSet(96, 4, 12, 2, 4, device=DEVICE)
    hs.track_requests(3)
    hs.kernel_backend = "triton"
    req_to_token = torch.arange(96, dtype=torch.int32, device=DEVICE).reshape(3, 32)
    rows = torch.tensor([1, 2, 0], device=DEVICE)
    hs.begin_pass(req_to_token[1:, :9].reshape(-1).long(), rows[:2], torch.zeros(2, dtype=torch.long, device=DEVICE),
                  torch.full((2,), 9, device=DEVICE), req_to_token)                    # prefill
    seq = torch.tensor([10, 10, 1], device=DEVICE)
    loc = torch.tensor([41, 73, 0], device=DEVICE)
    with NoHostSync():
        hot_loc = hs.begin_pass(loc, rows, seq - 1, seq, req_to_token, decode=True, live=loc != 0)
    assert (hot_loc[:2] >= 0).all() and int(hot_loc[2]) == -1 and hs.clock == 2
