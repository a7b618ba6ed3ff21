"""The precision policy: its error measure against a direct formula, the budgeted choice against exhaustive
search, and the whole step on a tiny model (artifact v2, fewer errors than INT2 everywhere)."""

import itertools

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot
from oscar_sglang.calibration import calibrate as cal
from oscar_sglang.calibration import data, evaluate, fit, policy, served
from oscar_sglang.calibration.stats import LayerSample
from oscar_sglang.format import RowFormat

from tiny_llama import tiny_llama_large_keys  # noqa: E402


def test_candidate_formats_per_head_dim():
    names = lambda d: [f.name(d) for f in policy.candidate_formats(d)]  # noqa: E731
    assert names(64) == ["int2", "int2/g32", "int2/g16", "int4", "int4/g32", "int8"]
    assert names(128) == ["int2", "int2/g32", "int2/g16", "int4", "int4/g32", "int8"]
    assert [f.bits_per_element(128) for f in policy.candidate_formats(128)] == [2.25, 3.0, 4.0, 4.25, 5.0, 8.25]
    assert names(16) == ["int2", "int4", "int8"]            # groups larger than the row are left out
    assert names(64)[:1] == ["int2"] and policy.candidate_formats(64, RowFormat(2, 32))[0] == RowFormat(2, 32)
    assert all(f.bits_per_element(64) > 3.0 for f in policy.candidate_formats(64, RowFormat(2, 32))[1:])


def test_symmetric_options_come_in_below_and_beside_the_base():
    forms = policy.candidate_formats(64, symmetric=True)
    assert [f.name(64) for f in forms] == ["int2sym", "int2", "int2/g32", "int2/g16", "int4sym", "int4", "int4/g32",
                                           "int8"]
    assert [f.bits_per_element(64) for f in forms][:2] == [2.25, 2.5]
    assert policy.candidate_formats(64) == [f for f in forms if not f.symmetric]


def _costs(err, bits):
    """OptionCosts from ``err [layers, 2, options]`` (one group) and bits per option."""
    err = torch.as_tensor(err, dtype=torch.float64).unsqueeze(-1)
    forms = [RowFormat(2), RowFormat(4), RowFormat(8)][:len(bits)]
    return policy.OptionCosts(forms, list(bits), err, torch.ones(err.shape[0], 2, len(bits), 1), ["g"], 64)


def _exhaustive(costs, budget):
    n = costs.err.shape[0]
    best = None
    for combo in itertools.product(range(len(costs.bits)), repeat=2 * n):
        c = torch.tensor(combo).reshape(n, 2)
        if costs.average_bits(c) <= budget + 1e-9:
            e = costs.total(c)
            if best is None or e < best[0] - 1e-12:
                best = (e, c)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_choice_stays_in_budget_and_matches_exhaustive_search_on_convex_costs(seed):
    g = torch.Generator().manual_seed(seed)
    bits = [2.5, 4.5, 8.5]
    # convex, decreasing error curves per (layer, side): each extra bit saves less than the one before
    base = torch.rand(3, 2, generator=g, dtype=torch.float64) * 0.3
    ratio = 0.02 + 0.2 * torch.rand(3, 2, generator=g, dtype=torch.float64)
    err = torch.stack([base, base * ratio, base * ratio * ratio * 0.5], -1)
    costs = _costs(err, bits)
    for budget in (2.5, 2.9, 3.5, 4.5, 6.0, 8.5):
        c = policy.choose(costs, budget)
        assert costs.average_bits(c) <= budget + 1e-9
        want, _ = _exhaustive(costs, budget)
        # greedy on error saved per bit is optimal up to the last, partly affordable step (knapsack)
        assert costs.total(c) <= want + (err[..., 0] - err[..., 1]).max().item() + 1e-12
        if budget in (2.5, 8.5):
            assert costs.total(c) == pytest.approx(want)
    assert (policy.choose(costs, 2.5) == 0).all()             # the budget of the base: nothing to upgrade
    assert (policy.choose(costs, 8.5) == 2).all()             # everything fits: the best option everywhere
    with pytest.raises(ValueError, match="below the cheapest format"):
        policy.choose(costs, 2.0)


def test_choice_spends_bits_where_they_save_most():
    # layer 0's keys are hard, everything else is easy: the only upgrade the budget allows goes there
    err = [[[1.0, 0.01, 0.0], [0.01, 0.005, 0.0]], [[0.02, 0.01, 0.0], [0.03, 0.02, 0.0]]]
    costs = _costs(err, [2.5, 4.5, 8.5])
    c = policy.choose(costs, (2.5 * 3 + 4.5) / 4)
    assert c.tolist() == [[1, 0], [0, 0]]
    # a held-out group that disagrees shows in the check
    check = policy.heldout_check(costs, 3.0)
    assert check["folds"] == [] and check["beats_base_on_every_heldout_group"] is None


def _sample(seed, t=96, d=32, kv=2, q_heads=4):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv, t, d, generator=g) * torch.linspace(0.3, 3, d) + 2.0
    return LayerSample(torch.randn(q_heads, t, d, generator=g), k, torch.randn(kv, t, d, generator=g))


def test_output_error_matches_attention_after_w_o_computed_directly():
    """Keys, values or both read quantized (the policy measures one side at a time, the other exact)."""
    d, kv, h, sink, recent = 32, 2, 4, 4, 8
    s = _sample(0)
    g = torch.Generator().manual_seed(3)
    r_k = torch.stack([torch.linalg.qr(torch.randn(d, d, generator=g))[0] for _ in range(kv)])
    r_v = torch.stack([torch.linalg.qr(torch.randn(d, d, generator=g))[0] for _ in range(kv)])
    mu = s.k.mean(1)
    w_o = torch.randn(24, h * d, generator=g)
    scale = d ** -0.5
    pos = torch.tensor([20, 50, 95])
    r = fit.RotatedSample(s, r_k, r_v, mu, sink, recent, scale, pos)
    kq = fmt.fake_quantize(r.kr, 16, 0.9, bits=2)
    vq = fmt.fake_quantize(r.vr, None, None, bits=4)

    def direct(kq, vq):
        """Un-rotate the dequantized rows (k = kq R^T + mu, v = vq R^T), attend per query, project by W_O."""
        k_hat = s.k if kq is None else torch.einsum("gtd,ged->gte", kq, r_k) + mu[:, None]
        v_hat = s.v if vq is None else torch.einsum("gtd,ged->gte", vq, r_v)
        err2 = ref2 = 0.0
        for i in pos.tolist():
            rows_e, rows_r = [], []
            exact = served.decode_exact_mask(torch.tensor([i]), i + 1, sink, recent)[0, :, None]
            for head in range(h):
                gi = head // (h // kv)
                keys = torch.where(exact, s.k[gi, :i + 1], k_hat[gi, :i + 1])
                vals = torch.where(exact, s.v[gi, :i + 1], v_hat[gi, :i + 1])
                p_hat = torch.softmax(keys @ s.q[head, i] * scale, 0)
                p = torch.softmax(s.k[gi, :i + 1] @ s.q[head, i] * scale, 0)
                rows_e.append(p_hat @ vals)
                rows_r.append(p @ s.v[gi, :i + 1])
            o_hat, o = torch.cat(rows_e) @ w_o.T, torch.cat(rows_r) @ w_o.T
            err2 += float((o_hat - o).double().square().sum())
            ref2 += float(o.double().square().sum())
        return err2, ref2

    for k_side, v_side in ((kq, vq), (None, vq), (kq, None), (kq, vq)):   # the last again: the cached reference
        e, ref = r.output_error(k_side, v_side, r_v, w_o, scale)
        err2, ref2 = direct(k_side, v_side)
        assert e == pytest.approx(err2, rel=1e-3) and ref == pytest.approx(ref2, rel=1e-4)
    assert r.output_error(None, None, r_v, w_o, scale)[0] == pytest.approx(0, abs=1e-6 * ref)
    # another projection: the reference is made again for it, not taken from the cache
    e, ref = r.output_error(None, vq, r_v, 2 * w_o, scale)
    err2, ref2 = direct(None, vq)
    assert e == pytest.approx(4 * err2, rel=1e-3) and ref == pytest.approx(4 * ref2, rel=1e-4)


def test_measured_error_falls_with_bits_and_the_data_free_clip_stays_valid():
    d, kv = 32, 2
    had = rot.hadamard(d).float().expand(kv, d, d).clone()
    layer = art.LayerRotation(had, had.clone(), torch.zeros(kv, d), torch.ones(kv), torch.ones(kv))
    fp = art.ModelFingerprint("LlamaForCausalLM", 1, 128, 4, kv, d, 100, "default", 1e4)
    a = art.RotationArtifacts(fp, "hadamard", [layer], sink=4, recent=8)
    samples = [_sample(i) for i in range(4)]
    w_o = torch.randn(24, 4 * d, generator=torch.Generator().manual_seed(0))
    costs = policy.measure([samples], [0, 0, 1, 1], ["a", "b"], a, [w_o], [d ** -0.5], n_queries=32, progress=False)
    names = [f.name(d) for f in costs.formats]
    assert names == ["int2", "int2/g16", "int4", "int8"]
    e = costs.err[0].mean(-1)  # [2, options]
    assert (e[:, 0] > e[:, 2]).all() and (e[:, 2] > e[:, 3]).all() and (e[:, 3] < 1e-3 * e[:, 0]).all()
    assert ((costs.clips > 0) & (costs.clips <= 1)).all()
    choice = policy.choose(costs, (2 * 3.0 + 0) / 2)  # room for int2/g16 or half an int4
    out = policy.apply(a, costs, choice)
    assert out.bits_per_element <= 3.0 + 1e-9 and len(out.layer_formats) == 1


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_large_keys()


def test_policy_step_on_a_tiny_model_writes_a_v2_artifact_with_lower_errors(tiny, tmp_path):
    class Seqs(list):
        groups = ["one", "one", "two", "two"]

    g = torch.Generator().manual_seed(1)
    seqs = Seqs(torch.randint(0, 97, (96,), generator=g) for _ in range(4))
    base_cfg = cal.CalibrationConfig(method="hadamard-center", sink=4, recent=8, keep_sequences=4,
                                     clip_queries=32, decision_queries=32)
    base, _ = cal.calibrate(tiny, seqs, base_cfg, progress=False)
    cfg = cal.CalibrationConfig(method="hadamard-center", sink=4, recent=8, keep_sequences=4, clip_queries=32,
                                decision_queries=32, bits=6.0)
    a, _ = cal.calibrate(tiny, seqs, cfg, progress=False)
    assert base.formats is None and a.formats is not None
    assert 4.0 < a.bits_per_element <= 6.0  # base INT2 at d 16 is 4 bits per element
    rep = a.calibration["policy"]
    assert rep["budget_bits"] == 6.0 and rep["error_policy"] < rep["error_base"]
    assert [f["heldout"] for f in rep["heldout_check"]["folds"]] == ["one", "two"]
    assert set(rep["options"]) == {"int2", "int4", "int8"} and len(rep["layers"]) == 2
    # the chosen options' clips are stored with them; rotations and key means are the base method's
    for lb, la in zip(base.layers, a.layers):
        assert torch.equal(lb.k_rotation, la.k_rotation) and torch.equal(lb.k_mean, la.k_mean)
    art.save(a, tmp_path / "rot")
    b = art.load(tmp_path / "rot")
    assert b.layer_formats == a.layer_formats and "policy" in b.calibration
    # served through the simulated cache, the policy's layers err less than INT2 everywhere
    evals = [torch.randint(0, 97, (96,), generator=g) for _ in range(2)]
    e_base = evaluate.layer_errors(tiny, evals, base)
    e_pol = evaluate.layer_errors(tiny, evals, b)
    assert sum(e_pol) < sum(e_base)
    with pytest.raises(ValueError, match="below the cheapest format"):
        cal.calibrate(tiny, seqs, cal.CalibrationConfig(method="hadamard", sink=4, recent=8, bits=3.0),
                      progress=False)
    # with symmetric rows (3 bits per element at d 16) the policy may go below INT2's 4 bits, and serves what it says
    cfg_s = cal.CalibrationConfig(method="hadamard-center", sink=4, recent=8, keep_sequences=4, clip_queries=32,
                                  decision_queries=32, bits=3.5, symmetric_rows=True)
    s_art, _ = cal.calibrate(tiny, seqs, cfg_s, progress=False)
    rep_s = s_art.calibration["policy"]
    assert rep_s["base"] == "int2" and rep_s["options"]["int2sym"] == 3.0
    assert 3.0 <= s_art.bits_per_element <= 3.5 and any(f.k.symmetric or f.v.symmetric for f in s_art.layer_formats)
    art.save(s_art, tmp_path / "sym")
    s_back = art.load(tmp_path / "sym")
    assert s_back.layer_formats == s_art.layer_formats
    sym_only = s_art.with_formats([art.LayerFormat(RowFormat(2, 16, True), RowFormat(2, 16, True))] * 2)
    assert sum(evaluate.layer_errors(tiny, evals, s_back)) < sum(evaluate.layer_errors(tiny, evals, sym_only))


def test_a_budget_below_the_cheapest_format_is_refused_before_any_statistics(tiny, monkeypatch):
    # d 16: INT2 with one group is 4 bits per element, symmetric INT2 3 (scale only); a refused budget must not
    # cost the user the statistics and the fit first (it used to be found only when the policy chose)
    def no_statistics(*args, **kwargs):
        raise AssertionError("statistics collected for a budget that cannot be met")

    monkeypatch.setattr(cal, "collect_statistics", no_statistics)
    seqs = [torch.randint(0, 97, (96,), generator=torch.Generator().manual_seed(2)) for _ in range(2)]
    for method, bits, sym, floor in (("optr", 3.9, False, "int2/g16: 4 bits"), ("hadamard", 2.0, True, "3 bits")):
        cfg = cal.CalibrationConfig(method=method, sink=4, recent=8, bits=bits, symmetric_rows=sym)
        with pytest.raises(ValueError, match=f"below the cheapest format .*{floor}"):
            cal.calibrate(tiny, seqs, cfg, progress=False)
    for bits, sym in ((4.0, False), (3.0, True)):   # the floor itself is a budget the policy can meet
        cal.check_budget(tiny, cal.CalibrationConfig(bits=bits, symmetric_rows=sym))
    with pytest.raises(ValueError, match="below the cheapest format"):   # groups of 8 cost more: 6 bits at d 16
        cal.check_budget(tiny, cal.CalibrationConfig(group_size=8, bits=5.0))


def test_fixed_query_positions_replace_only_the_samples_they_are_given_for():
    samples = [_sample(i) for i in range(3)]
    free = policy._positions(samples, 4, 8, 16, seed=5)
    fixed = torch.tensor([60, 61, 62])
    got = policy._positions(samples, 4, 8, 16, seed=5, fixed=[None, None, fixed])
    assert torch.equal(got[0], free[0]) and torch.equal(got[1], free[1]) and torch.equal(got[2], fixed)


def test_policy_with_a_copy_task_measures_it_as_held_out_groups(tiny):
    class Seqs(list):
        groups = ["one", "one", "two", "two"]

    g = torch.Generator().manual_seed(1)
    seqs = Seqs(torch.randint(0, 97, (96,), generator=g) for _ in range(4))
    longer = data.Sequences([torch.randint(0, 97, (160,), generator=g) for _ in range(2)], ["one", "two"])
    cfg = cal.CalibrationConfig(method="hadamard-center", sink=4, recent=8, keep_sequences=4, clip_queries=32,
                                decision_queries=32, bits=6.0)
    plain, _ = cal.calibrate(tiny, seqs, cfg, progress=False)
    a, _ = cal.calibrate(tiny, seqs, cfg, progress=False, copy_sequences=longer)
    rep = a.calibration["policy"]
    assert rep["measured_on"]["copy_task"] == {"span": cal.COPY_SPAN, "groups": ["one+copy", "two+copy"]}
    assert rep["measured_on"]["seq_len"] == [96, 160] and rep["measured_on"]["sequences"] == 6
    assert [f["heldout"] for f in rep["heldout_check"]["folds"]] == ["one", "two", "one+copy", "two+copy"]
    # the copy task's errors enter the objective: the measured base error is not the plain policy's
    assert rep["error_base"] != pytest.approx(plain.calibration["policy"]["error_base"])
