"""The INT2 pool and its hot side pool, driven the way the attention backend drives them.

Scenario with page size 16: a request is prefilled and decoded, a second one
shares its first page and extends it (in the same pass as a decode step of
the first), the first is freed, a third reuses its slots.  Every live token
must read back exactly what the reference format says (BF16 rotated row where
hot, INT2 round trip elsewhere), hot exactly at sink and recent positions,
and nothing of a freed token may leak.
"""

import os

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot
from oscar_sglang.sglang import sizing
from oscar_sglang.sglang.hot import HotSet, window_plan

# ---------------------------------------------------------------------------
# Hot side pool bookkeeping (no SGLang)


def _kept(plan):
    """(request, position) of the cached tokens in a window, from the plan's fixed ``[batch, sink + recent]`` layout."""
    rows = torch.arange(plan.keep_mask.shape[0]).unsqueeze(1).expand_as(plan.keep_mask)
    return list(zip(rows[plan.keep_mask].tolist(), plan.keep_pos[plan.keep_mask].tolist()))


def test_window_plan_extend_and_decode():
    p = window_plan(torch.tensor([0, 10, 5]), torch.tensor([6, 11, 5]), 7, sink=2, recent=4)
    assert p.new_pos.tolist() == [0, 1, 2, 3, 4, 5, 10]
    assert p.new_len.tolist() == [6] * 6 + [11]
    assert p.keep_pos.shape == p.keep_mask.shape == (3, 2 + 4)      # fixed shape: no data-dependent size
    # cached tokens in a window after the pass: request 1 keeps its sinks and 7..9, request 2 (no new token) all 5
    assert _kept(p) == [(1, 0), (1, 1), (1, 7), (1, 8), (1, 9), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]


def test_window_plan_chunk_on_prefix():
    p = window_plan([8], [12], 4, sink=2, recent=4)  # window [4, 8) before, [8, 12) after: only sinks stay
    assert [pos for _, pos in _kept(p)] == [0, 1]
    p = window_plan([8], [10], 2, sink=2, recent=4)  # after: [6, 10)
    assert [pos for _, pos in _kept(p)] == [0, 1, 6, 7]


def test_hot_set_assigns_sinks_and_recent_and_keeps_copies_until_needed():
    hs = HotSet(num_slots=32, sink_entries=2, recent_entries=5, sink=2, recent=4)
    slots = torch.arange(10, 20)
    loc = hs.update(slots, torch.arange(10), torch.full((10,), 10))
    assert (loc[:2] >= 0).all() and (loc[:2] < 2).all()          # sink region
    assert (loc[2:6] == -1).all()                                 # middle: INT2 only
    assert (loc[6:] >= 2).all()                                   # recent region
    assert torch.equal(hs.hot_index[slots].long(), loc)
    # position 10 is written: 6 leaves the window [7, 11) but keeps its copy while a free entry exists
    kept = torch.tensor([10, 11, 17, 18, 19])
    loc = hs.update(torch.tensor([20]), torch.tensor([10]), torch.tensor([11]), kept)
    assert hs.hot_index[16] >= 0 and loc.item() >= 2 and hs.hot_index[20] == loc.item()
    # position 11: the region is full, and the entry taken is the out-of-window one (position 6), not 8..10
    old6 = int(hs.hot_index[16])
    loc = hs.update(torch.tensor([21]), torch.tensor([11]), torch.tensor([12]), torch.tensor([10, 11, 18, 19, 20]))
    assert loc.item() == old6 and hs.hot_index[16] == -1 and (hs.hot_index[torch.tensor([18, 19, 20])] >= 0).all()
    # a rewritten slot drops its entry
    hs.update(torch.tensor([19]), torch.tensor([5]), torch.tensor([30]))
    assert hs.hot_index[19] == -1


def test_hot_set_ring_eviction_costs_precision_only():
    hs = HotSet(num_slots=16, sink_entries=1, recent_entries=2, sink=1, recent=3)
    hs.update(torch.tensor([1, 2, 3]), torch.arange(3), torch.full((3,), 3))
    assert hs.hot_index[1:4].tolist() == [0, 1, 2]
    # a second request's sink takes the only sink entry: the first request's sink falls back to INT2
    hs.update(torch.tensor([5]), torch.tensor([0]), torch.tensor([1]))
    assert hs.hot_index[1] == -1 and hs.hot_index[5] == 0
    # more recent tokens than entries in one pass: only the last ones get entries, no entry is shared
    loc = hs.update(torch.tensor([8, 9, 10]), torch.tensor([5, 6, 7]), torch.full((3,), 8))
    assert loc[0] == -1 and sorted(loc[1:].tolist()) == [1, 2]
    held = hs.hot_index[hs.hot_index >= 0].tolist()
    assert len(held) == len(set(held))
    assert all(hs.owner[e] == s for s, e in enumerate(hs.hot_index.tolist()) if e >= 0)


def test_hot_plan_keeps_every_window_of_its_requests_through_a_prefill_burst():
    """R requests decoding in lockstep keep their whole windows hot, also while another request prefills."""
    R, S, W = 3, 2, 4
    plan = sizing.hot_plan(R, S, W)
    hs = HotSet(num_slots=400, sink_entries=plan.sink_entries, recent_entries=plan.recent_entries, sink=S, recent=W)
    slots = {}  # request -> slot per position
    next_slot = iter(range(400))

    def run(reqs):
        """reqs: [(request, new tokens)]; one forward pass."""
        prefix = [len(slots.get(r, [])) for r, _ in reqs]
        seq = [p + n for p, (_, n) in zip(prefix, reqs)]
        plan_ = window_plan(prefix, seq, sum(n for _, n in reqs), S, W)
        new = []
        for r, n in reqs:
            mine = slots.setdefault(r, [])
            mine += [next(next_slot) for _ in range(n)]
            new += mine[-n:]
        kept = torch.tensor([slots[reqs[b][0]][p] for b, p in _kept(plan_)], dtype=torch.long)
        hs.update(torch.tensor(new), plan_.new_pos, plan_.new_len, kept)

    def windows_hot(r):  # copies outside the windows may survive; the windows must be whole
        n = len(slots[r])
        hot = hs.hot_index[torch.tensor(slots[r])] >= 0
        return bool(hot[(torch.arange(n) < S) | (torch.arange(n) >= n - W)].all())

    run([(r, 10) for r in range(R)])                      # R prompts prefilled together
    for _ in range(7):
        run([(r, 1) for r in range(R)])                   # lockstep decode
    for burst in range(2):                                # a 30-token prefill joins while the R decode
        run([(r, 1) for r in range(R)] + [(f"new{burst}", 30)])
        assert all(windows_hot(r) for r in range(R))
        for _ in range(6):                                # the newcomer finishes; the R go on
            run([(r, 1) for r in range(R)])
            assert all(windows_hot(r) for r in range(R))


def _int2(layers, group=None):
    """Every layer's K and V in INT2 rows of ``group``."""
    return [art.LayerFormat(fmt.RowFormat(2, group), fmt.RowFormat(2, group))] * layers


def test_sizing_int2_cell_and_hot_plan():
    # SmolLM2: 30 layers, 3 KV heads, d 64, G 64: a row is 16 B of codes + 4 B of scale/zero
    assert sizing.rows_bytes_per_token(_int2(30), 3, 64) == 30 * 2 * 3 * 20 == 3600
    assert sizing.rows_bytes_per_token(_int2(30, 32), 3, 64) == 30 * 2 * 3 * (16 + 8)
    # a policy's mix: each layer's K and V rows at their own widths (INT4 keys: 32 B + 4 B; INT8 values: 64 + 4)
    mixed = [art.LayerFormat(fmt.RowFormat(4), fmt.RowFormat(2))] + [art.LayerFormat(fmt.RowFormat(2), fmt.RowFormat(8))]
    assert sizing.rows_bytes_per_token(mixed, 3, 64) == 3 * ((36 + 20) + (20 + 68))
    assert sizing.bf16_bytes_per_token(30, 3, 64) == 30 * 2 * 3 * 64 * 2 == 23040
    # 32 requests, sink 64, recent 256: one window of each kind per request + a quarter for bursts
    plan = sizing.hot_plan(32, 64, 256)
    assert (plan.sink_entries, plan.recent_entries) == (40 * 64, 40 * 256)
    assert plan.nbytes(30, 3, 64) == plan.entries * 23040
    assert sizing.hot_plan(1, 4, 16) == sizing.HotPlan(8, 32)          # the burst share is at least a window
    assert sizing.hot_plan(32, 64, 256, max_tokens=1000) == sizing.HotPlan(1000, 1000)
    assert sizing.hot_plan(0, 64, 256).entries == sizing.hot_plan(8, 0, 0).entries == 0
    with pytest.raises(ValueError):
        sizing.hot_plan(-1, 4, 16)
    # SGLang's rule: the fixed part comes off the budget, then whole pages of cells
    assert sizing.capacity_tokens(10_000, 100, fixed_bytes=1_050, page_size=16) == 80
    assert sizing.capacity_tokens(1_000, 100, fixed_bytes=2_000) == 0


def test_capacity_ratio_meets_the_goals_at_a_gpu_sized_budget():
    """Default hot pool (32 requests, sink 64, recent 256), 64 GiB budget (an H200 serving an 8B model has more).

    Geometries: SmolLM2-135M (30 layers, 3 KV heads, d 64) and Llama-3-8B (32 layers, 8 KV heads, d 128).
    """
    budget = 64 * 2**30
    for layers, kv, d, goal in ((30, 3, 64, 6.0), (32, 8, 128, 6.8)):
        bf16 = sizing.capacity_tokens(budget, sizing.bf16_bytes_per_token(layers, kv, d))
        hot = sizing.hot_plan(32, 64, 256).nbytes(layers, kv, d)
        int2 = sizing.capacity_tokens(budget, sizing.rows_bytes_per_token(_int2(layers), kv, d), fixed_bytes=hot)
        assert int2 / bf16 >= goal, (d, int2 / bf16)
        assert int2 / bf16 < 16 / (2 + 32 / d)      # never above the format's own ratio


# ---------------------------------------------------------------------------
# The pool (needs SGLang's KVCache base class)

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

FP = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=2, hidden_size=128, num_attention_heads=4,
                          num_kv_heads=2, head_dim=32, vocab_size=100, rope_type="default", rope_theta=1e4)
SINK, RECENT, PAGE = 2, 4, 16


# A precision policy's per-layer formats (keys and values differ, and so do the two layers)
MIXED = [art.LayerFormat(fmt.RowFormat(4, 32), fmt.RowFormat(2, 8)),
         art.LayerFormat(fmt.RowFormat(2, 16), fmt.RowFormat(8, 32))]


def _artifacts(formats=None):
    g = torch.Generator().manual_seed(0)

    def orth():
        return torch.stack([torch.linalg.qr(torch.randn(32, 32, generator=g, dtype=torch.float64))[0]
                            for _ in range(2)]).float()

    layers = [art.LayerRotation(orth(), orth(), torch.randn(2, 32, generator=g), torch.tensor([0.9, 1.0]),
                                torch.tensor([1.0, 0.8])) for _ in range(FP.num_layers)]
    return art.RotationArtifacts(FP, "unit", layers, sink=SINK, recent=RECENT, group_size=16, formats=formats)


class _Driver:
    """Writes passes into the pool as the backend does and remembers each slot's last raw K/V."""

    def __init__(self, pool):
        self.pool = pool
        self.req_to_token = torch.zeros(4, 64, dtype=torch.int32)
        self.raw = {}  # (layer, slot) -> (k, v) rows [kv_heads, d]
        self.gen = torch.Generator().manual_seed(1)

    def run_pass(self, reqs):
        """``reqs``: list of (row, prefix_len, slots of the new tokens)."""
        rows, prefix, seq, locs = [], [], [], []
        for row, pre, slots in reqs:
            self.req_to_token[row, pre:pre + len(slots)] = torch.tensor(slots, dtype=torch.int32)
            rows.append(row), prefix.append(pre), seq.append(pre + len(slots)), locs.extend(slots)
        loc = torch.tensor(locs)
        hot_loc = self.pool.begin_pass(loc, torch.tensor(rows), torch.tensor(prefix, dtype=torch.int32),
                                       torch.tensor(seq), self.req_to_token)
        for layer in range(FP.num_layers):
            k = torch.randn(len(locs), 2, 32, generator=self.gen).to(torch.bfloat16) * 3
            v = torch.randn(len(locs), 2, 32, generator=self.gen).to(torch.bfloat16)
            k[..., 5] += 20  # an outlier channel, as real keys have
            self.pool.write(layer, loc, k, v, hot_loc)
            for i, s in enumerate(locs):
                self.raw[layer, s] = (k[i], v[i])

    def expected(self, layer, slot, hot):
        _, r = self.pool.layer(layer)
        k, v = self.raw[layer, slot]
        kr = rot.rotate_kv(k[None], r.k_rot, r.k_mean)[0]
        vr = rot.rotate_kv(v[None], r.v_rot)[0]
        if hot:
            return kr.to(torch.bfloat16).float(), vr.to(torch.bfloat16).float()
        lf = self.pool.config.layer_formats[layer]
        return (fmt.fake_quantize(kr, lf.k.group, r.k_clip.unsqueeze(-1), bits=lf.k.bits),
                fmt.fake_quantize(vr, lf.v.group, r.v_clip.unsqueeze(-1), bits=lf.v.bits))


@pytest.fixture(params=["int2", "mixed"])
def pool(request):
    pytest.importorskip("sglang")
    from oscar_sglang.sglang.pool import OscarInt2Pool
    from oscar_sglang.sglang.settings import ServingConfig

    cfg = ServingConfig(_artifacts(MIXED if request.param == "mixed" else None), SINK, RECENT, hot_requests=4)
    return OscarInt2Pool(64, PAGE, torch.bfloat16, head_num=2, head_dim=32, layer_num=2, device="cpu", config=cfg,
                         start_layer=0, end_layer=2)


def test_pool_layout_matches_the_kernel_contract(pool):
    assert pool.num_slots == 64 + PAGE
    for layer in range(2):
        store, r = pool.layer(layer)
        store.check()
        r.check(2, 32)
        assert store.hot_index is pool.hot_index
    assert pool.k_hot.shape[1] == pool.hot.entries == 5 * SINK + 5 * RECENT
    with pytest.raises(RuntimeError, match="no dense K/V buffer"):
        pool.get_key_buffer(0)
    # each layer stores its rows in the artifact's formats, and SGLang sizes by exactly those bytes
    formats = pool.config.layer_formats
    for layer in range(2):
        store, _ = pool.layer(layer)
        assert (store.k_format, store.v_format) == (formats[layer].k, formats[layer].v)
    per_token = sum(2 * (f.k.bytes_per_row(32) + f.v.bytes_per_row(32)) for f in formats)
    assert pool.bytes_per_token == per_token == pool.config.artifacts.bytes_per_token()
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    hot = pool.hot.entries * 2 * 2 * 32 * 2  # entries x layers x heads x d x bf16, per side
    assert k_bytes + v_bytes == pool.num_slots * per_token + 2 * hot


def test_pool_reads_live_tokens_exactly_after_sharing_freeing_and_reuse(pool):
    from oscar_sglang.kernels.common.reference import read_rotated

    d = _Driver(pool)
    page = lambda i: list(range(i * PAGE, (i + 1) * PAGE))  # noqa: E731
    a_slots = page(1) + page(2)                       # request A owns pages 1 and 2
    d.run_pass([(0, 0, a_slots[:20])])                # A: prefill 20 tokens
    d.run_pass([(0, 20, [a_slots[20]])])              # A: decode
    d.run_pass([(0, 21, [a_slots[21]])])              # A: decode
    d.req_to_token[1, :16] = torch.tensor(page(1))   # B's cached prefix: A's first page (radix cache hit)
    d.run_pass([(1, 16, page(3)[:12]), (0, 22, [a_slots[22]])])   # B extends it while A decodes
    a_hot_freed = [s for s in page(2) if pool.hot_index[s] >= 0]
    assert a_hot_freed, "A's recent window lies on its second page"
    # A finishes; its own page 2 is freed and handed to C
    d.run_pass([(2, 0, page(2)[:14])])
    live = {"B": (1, 28), "C": (2, 14)}
    for name, (row, n) in live.items():
        slots = d.req_to_token[row, :n].long()
        hot = pool.hot_index[slots] >= 0
        want_hot = (torch.arange(n) < SINK) | (torch.arange(n) >= n - RECENT)
        assert hot[want_hot].all(), name      # whole windows; older copies may survive until needed
        for layer in range(2):
            store, _ = pool.layer(layer)
            k, v = read_rotated(store, slots)
            for i, s in enumerate(slots.tolist()):
                ek, ev = d.expected(layer, s, bool(hot[i]))
                assert torch.equal(k[i], ek) and torch.equal(v[i], ev), (name, layer, i)
    # C's slots that held A's BF16 rows read C's values (checked above) and are hot only by C's windows
    assert any(pool.hot_index[s] == -1 for s in a_hot_freed)


def test_cold_write_through_the_generic_door_drops_hot_copies(pool):
    d = _Driver(pool)
    d.run_pass([(0, 0, list(range(16, 22)))])
    assert (pool.hot_index[16:22] >= 0).all()

    class Layer:
        layer_id = 1

    k = torch.randn(2, 2, 32).to(torch.bfloat16)
    pool.set_kv_buffer(Layer, torch.tensor([16, 17]), k, k)
    assert (pool.hot_index[16:18] == -1).all() and (pool.hot_index[18:22] >= 0).all()
