"""Calibration statistics, OSCAR fit, clip search, OptR and the simulated cache, on a tiny model."""
import inspect
import json

import pytest
import torch

from oscar_sglang import artifacts as art
from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot
from oscar_sglang.calibration import calibrate as cal
from oscar_sglang.calibration import capture, fit, optr, served, simulate
from oscar_sglang.calibration.stats import StatsCollector

from tiny_llama import D, KV_HEADS, Q_HEADS, tiny_llama_large_keys  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_large_keys()


def _sequences(n, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (length,), generator=g) for _ in range(n)]


def _captured(model, seqs):
    """Post-RoPE q, k, v per layer, per sequence, straight from the capture tap."""
    got = {}

    def tap(layer, q, k, v, out):
        got.setdefault(layer, []).append((q[0].clone(), k[0].clone(), v[0].clone()))

    with torch.no_grad(), capture.tapped(model, tap):
        for s in seqs:
            model(s.reshape(1, -1), use_cache=False)
    return got


def _collect(model, seqs, weighting="exact", keep=0):
    collector = StatsCollector(2, Q_HEADS, KV_HEADS, D, weighting, keep)
    with torch.no_grad(), capture.tapped(model, collector):
        for s in seqs:
            model(s.reshape(1, -1), use_cache=False)
    return collector


def test_query_covariance_and_key_mean_match_direct_computation(tiny):
    seqs = _sequences(3, 20)
    col = _collect(tiny, seqs)
    qkv = _captured(tiny, seqs)
    for layer in (0, 1):
        q = torch.cat([x[0] for x in qkv[layer]], dim=1)  # [H, N, d]
        k = torch.cat([x[1] for x in qkv[layer]], dim=1)  # [G, N, d]
        n = q.shape[1]
        for g in range(KV_HEADS):
            direct = sum(q[h].T @ q[h] for h in range(g * 2, g * 2 + 2)) / n
            got = col.layers[layer].query_cov[g]
            assert torch.allclose(got, direct, rtol=1e-8, atol=1e-12 * direct.abs().max())
            assert torch.allclose(col.layers[layer].key_mean[g], k[g].mean(0), rtol=1e-8)
        assert col.layers[layer].tokens == 60


def test_exact_value_covariance_matches_explicit_attention_probabilities(tiny):
    seqs = _sequences(2, 16)
    col = _collect(tiny, seqs)
    qkv = _captured(tiny, seqs)
    for layer in (0, 1):
        total = torch.zeros(KV_HEADS, D, D, dtype=torch.float64)
        for q, k, v in qkv[layer]:
            s = q.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            for h in range(Q_HEADS):
                g = h // 2
                logits = (q[h] @ k[g].T) * D**-0.5
                probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
                sv = probs @ v[g]
                total[g] += sv.T @ sv
        direct = total / 32
        assert torch.allclose(col.layers[layer].value_cov, direct, rtol=1e-8, atol=1e-14)


def test_proxy_value_covariance_weights_by_key_importance(tiny):
    seqs = _sequences(1, 24)
    col = _collect(tiny, seqs, "proxy")
    q, k, v = _captured(tiny, seqs)[1][0]
    cq = col.layers[1].query_cov
    for g in range(KV_HEADS):
        w = torch.einsum("td,de,te->t", k[g], cq[g], k[g])
        w = w / w.mean()
        direct = (v[g].T * w) @ v[g] / 24
        assert torch.allclose(col.layers[1].value_cov[g], direct, rtol=1e-8)


def test_memory_does_not_grow_with_tokens(tiny):
    col = _collect(tiny, _sequences(6, 20), keep=2)
    assert all(len(layer.samples) == 2 for layer in col.layers)
    assert col.layers[0].c_q.shape == (KV_HEADS, D, D)


def test_oscar_rotations_are_orthogonal_and_built_from_the_eigenvectors(tiny):
    col = _collect(tiny, _sequences(3, 20))
    st = col.layers[1]
    r_k, r_v = fit.oscar_rotations(st)
    assert rot.orthogonality_error(r_k).max() < 1e-10 and rot.orthogonality_error(r_v).max() < 1e-10
    h = rot.hadamard(D)
    p = rot.permutation_matrix(rot.bit_reversal_permutation(D))
    for r, cov in ((r_k, st.query_cov), (r_v, st.value_cov)):
        u = r @ p.T @ h.T  # undo P then H: the eigenbasis
        for g in range(KV_HEADS):
            lam = torch.diagonal(u[g].T @ cov[g] @ u[g])
            assert torch.allclose(cov[g] @ u[g], u[g] * lam, atol=1e-9 * cov[g].abs().max())
            assert (lam[:-1] >= lam[1:] - 1e-12).all()


def _artifact(model, method="identity", **kw):
    fp = art.ModelFingerprint.from_config(model.config)
    return art.BUILDERS[method](fp, **kw)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids.reshape(1, -1), use_cache=False).logits[0]


def test_simulated_cache_without_quantization_reproduces_the_model(tiny):
    ids = _sequences(1, 40)[0]
    ref = _logits(tiny, ids)
    a = _artifact(tiny, "identity")
    for mode in simulate.MODES:
        with simulate.simulated(tiny, simulate.SimState(a, mode=mode, quantize=False)):
            got = _logits(tiny, ids)
        assert torch.allclose(got, ref, atol=1e-10), mode
    # Rotations and key centering change nothing without quantization either.
    centred = _artifact(tiny, "hadamard")
    for layer in centred.layers:
        layer.k_mean = torch.randn(KV_HEADS, D) * 5
    with simulate.simulated(tiny, simulate.SimState(centred, quantize=False)):
        got = _logits(tiny, ids)
    assert torch.allclose(got, ref, atol=1e-9)
    # Nor does key channel scaling (float32 transforms R diag(s), R diag(1/s): float32 rounding, no more)
    for layer in centred.layers:
        layer.k_scale = torch.exp(torch.randn(KV_HEADS, D))
    with simulate.simulated(tiny, simulate.SimState(centred, quantize=False)):
        got = _logits(tiny, ids)
    assert torch.allclose(got, ref, atol=1e-5) and not torch.allclose(got, ref, atol=1e-12)
    assert tiny.config._attn_implementation == "sdpa"


def test_sink_and_recent_windows_are_exact_under_quantization(tiny):
    ids = _sequences(1, 48)[0]
    ref = _logits(tiny, ids)
    a = _artifact(tiny, "hadamard", sink=4, recent=8)
    with simulate.simulated(tiny, simulate.SimState(a, mode="decode")):
        got = _logits(tiny, ids)
    # Positions whose whole history lies in the windows are exact in every layer...
    assert torch.allclose(got[:12], ref[:12], atol=1e-10)
    # ...and later positions do read INT2.
    assert not torch.allclose(got[12:], ref[12:], atol=1e-3)
    # Windows that cover everything make quantization invisible.
    wide = _artifact(tiny, "hadamard", sink=0, recent=48)
    with simulate.simulated(tiny, simulate.SimState(wide, mode="decode")):
        assert torch.allclose(_logits(tiny, ids), ref, atol=1e-10)
    # Serving: a prefill is exact among its own tokens...
    with simulate.simulated(tiny, simulate.SimState(a, mode="serve")):
        assert torch.allclose(_logits(tiny, ids), ref, atol=1e-10)
    # ...and the decode steps after it read the keys outside the windows from INT2.
    # transformers 5.25 renamed the model's KV cache argument and output `past_key_values` -> `cache` (the old
    # name warns, and goes in 5.40); pyproject admits both
    cache = "cache" if "cache" in inspect.signature(tiny.forward).parameters else "past_key_values"

    def next_logits(state):
        with torch.no_grad(), simulate.simulated(tiny, state):
            out = tiny(ids[:-1].reshape(1, -1), use_cache=True)
            return tiny(ids[-1:].reshape(1, -1), **{cache: getattr(out, cache)}, use_cache=True).logits[0, -1]
    assert torch.allclose(next_logits(simulate.SimState(a, mode="serve", quantize=False)), ref[-1], atol=1e-9)
    assert not torch.allclose(next_logits(simulate.SimState(a, mode="serve")), ref[-1], atol=1e-3)
    assert torch.allclose(next_logits(simulate.SimState(wide, mode="serve")), ref[-1], atol=1e-9)


def test_decode_mask_matches_token_by_token_reads():
    pos = torch.arange(10)
    exact = served.decode_exact_mask(pos, 10, sink=2, recent=3)
    for i in range(10):
        for t in range(i + 1):
            assert bool(exact[i, t]) == (t < 2 or t >= i - 2)
    s = served.serve_exact_mask(2, 10, sink=2, recent=3)
    assert s[0].tolist() == [True, True, False, False, False, False, False, True, True, True]


def test_straight_through_quantizer_matches_the_format_forward():
    torch.manual_seed(0)
    x = (torch.randn(5, 3, 64) * 3).requires_grad_()
    clip = torch.tensor([1.0, 0.8, 0.6]).reshape(3, 1)
    y = served.fake_quantize_ste(x, 32, clip)
    assert torch.equal(y, fmt.fake_quantize(x.detach(), 32, clip))
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_clip_search_finds_the_brute_force_minimum(tiny):
    col = _collect(tiny, _sequences(2, 48), keep=2)
    st = col.layers[1]
    r_k, r_v = fit.oscar_rotations(st)
    gen = torch.Generator().manual_seed(0)
    samples = [fit.RotatedSample(s, r_k.float(), r_v.float(), st.key_mean.float(), 4, 8, D**-0.5,
                                 fit.query_positions(48, 4, 8, 100, gen)) for s in st.samples]
    res = fit.search_clips(samples, D)
    for g in range(KV_HEADS):
        errs = []
        for c in fit.CLIP_GRID:
            e = 0.0
            for s in samples:
                kq = fmt.fake_quantize(s.kr[g], D, c)
                dl = torch.einsum("hsd,td->hst", s.qr[2 * g:2 * g + 2], kq - s.kr[g])
                e += (dl.square() * s.int2).sum().item()
            errs.append(e)
        assert res["k_clip"][g].item() == pytest.approx(fit.CLIP_GRID[min(range(len(errs)), key=errs.__getitem__)])
        assert res["k_rel_error"][g] <= res["k_rel_error_noclip"][g] + 1e-12


def test_optr_never_makes_the_heldout_loss_worse(tiny):
    col = _collect(tiny, _sequences(4, 48, seed=5), keep=4)
    st = col.layers[1]
    r_k, r_v = fit.oscar_rotations(st)
    w_o = tiny.model.layers[1].self_attn.o_proj.weight.detach()
    clip = torch.full((KV_HEADS,), 0.9)
    res = optr.refine_layer(st.samples, r_k, r_v, st.key_mean, clip, clip, w_o, sink=4, recent=8, group=D,
                            scale=D**-0.5, cfg=optr.OptRConfig(steps=15, lr=1e-2, max_queries=32), seed=0)
    for which, r0 in (("k", r_k), ("v", r_v)):
        r = res[f"{which}_rotation"]
        assert rot.orthogonality_error(r).max() < 1e-10
        for g in range(KV_HEADS):
            if res[f"{which}_kept"][g]:
                assert res[f"{which}_heldout_after"][g] < res[f"{which}_heldout_before"][g]
            else:
                assert torch.allclose(r[g], r0[g], atol=1e-6)  # reverted to R_0
    again = optr.refine_layer(st.samples, r_k, r_v, st.key_mean, clip, clip, w_o, sink=4, recent=8, group=D,
                              scale=D**-0.5, cfg=optr.OptRConfig(steps=15, lr=1e-2, max_queries=32), seed=0)
    assert torch.equal(again["k_rotation"], res["k_rotation"]), "OptR must be deterministic under a seed"


def test_output_factor_reproduces_the_projected_norm():
    torch.manual_seed(0)
    w_o = torch.randn(24, Q_HEADS * D)
    factors = optr.output_factors(w_o, Q_HEADS)
    x = torch.randn(7, D)
    for h in range(Q_HEADS):
        w_h = w_o[:, h * D:(h + 1) * D].T  # [d, hidden]
        assert torch.allclose((x @ factors[h]).norm(), (x @ w_h).norm(), rtol=1e-4)


@pytest.mark.parametrize("method", cal.METHODS)
def test_every_method_produces_a_valid_artifact(tiny, method, tmp_path):
    cfg = cal.CalibrationConfig(method=method, sink=4, recent=8, keep_sequences=3,
                                optr=optr.OptRConfig(steps=2, max_queries=16))
    a, report = cal.calibrate(tiny.float(), _sequences(3, 32), cfg, {"spec": "random ids"}, progress=False)
    tiny.double()
    art.save(a, tmp_path)
    loaded = art.load(tmp_path, expect=art.ModelFingerprint.from_config(tiny.config))
    assert loaded.method == method and (loaded.sink, loaded.recent) == (4, 8)
    centred = method not in cal.UNCENTERED
    assert bool((loaded.layers[0].k_mean != 0).any()) == centred
    if method not in cal.DATA_FREE:
        assert len(report) == 2 and loaded.calibration["tokens"] == 96
        assert all(0 < c <= 1 for r in report for c in r["k_clip"])


def test_key_scaling_is_searched_held_out_and_stored(tiny, tmp_path):
    # two held-out groups (the halves of one text): every head's decision is recorded with its held-out errors,
    # kept scales make the artifact version 3, and the simulated cache without quantization stays exact
    cfg = cal.CalibrationConfig(method="hadamard-center", sink=4, recent=8, keep_sequences=4, key_scaling=True)
    a, report = cal.calibrate(tiny.float(), _sequences(4, 32), cfg, {"spec": "random ids"}, progress=False)
    tiny.double()
    for r, layer in zip(report, a.layers):
        assert len(r["k_scale_kept"]) == KV_HEADS
        for h, kept in enumerate(r["k_scale_kept"]):
            assert kept == (r["k_heldout_scaled"][h] < r["k_heldout_unscaled"][h])
            assert kept == bool((layer.k_scale[h] != 1).any())
    art.save(a, tmp_path)
    version = json.loads((tmp_path / "manifest.json").read_text())["format_version"]
    assert version == (3 if any(layer.scaled for layer in a.layers) else 2)
    loaded = art.load(tmp_path)
    ids = _sequences(1, 40)[0]
    ref = _logits(tiny, ids)
    with simulate.simulated(tiny, simulate.SimState(loaded, quantize=False)):
        assert torch.allclose(_logits(tiny, ids), ref, atol=1e-4)


def _optr_losses_by_the_formula(s, k_mean, w_o, sink, recent, scale, pos, r_k, r_v, clip, cfg):
    """OptR's key and value losses per KV head, one query head at a time, as METHOD.md and ``optr``'s docstring
    state them (float64 after the rounding, which is the served read path's, in float32)."""
    q, k, v = s.q.float()[:, pos], s.k.float(), s.v.float()            # [H, nq, d], [G, T, d]
    heads, groups, t = q.shape[0], k.shape[0], k.shape[1]
    rep = heads // groups
    allowed = served.causal_mask(pos, t)
    int2 = allowed & ~served.decode_exact_mask(pos, t, sink, recent)
    factors = optr.output_factors(w_o, heads).double()
    kr = rot.rotate_kv(k.transpose(0, 1), r_k, k_mean).transpose(0, 1)
    kq = served.fake_quantize_ste(kr.transpose(0, 1), None, clip).transpose(0, 1).double()
    vr = rot.rotate_kv(v.transpose(0, 1), r_v).transpose(0, 1)
    dv = (served.fake_quantize_ste(vr.transpose(0, 1), None, clip).transpose(0, 1) - vr).double()
    key = [0.0] * groups
    value = [0.0] * groups
    for h in range(heads):
        g = h // rep
        exact_logits = (q[h].double() @ (k[g].double() - k_mean[g].double()).T) * scale
        rotated = ((q[h].double() @ r_k[g].double()) @ kq[g].T) * scale
        p_fp = torch.softmax(exact_logits.masked_fill(~allowed, float("-inf")), -1)
        p_q = torch.softmax(torch.where(int2, rotated, exact_logits).masked_fill(~allowed, float("-inf")), -1)
        kl = torch.where(allowed, p_fp * (p_fp.clamp_min(1e-300).log() - p_q.clamp_min(1e-300).log()), 0).sum(-1)
        vl = v[g].double() @ factors[h]
        out = ((p_q - p_fp) @ vl).square().sum() / (p_fp @ vl).square().sum()
        key[g] = key[g] + cfg.kl_weight * kl.mean() + cfg.output_weight * out
        err = ((p_q.detach() * int2) @ (dv[g] @ r_v[g].double().T) @ factors[h]).square().sum()
        value[g] = value[g] + err / (p_q.detach() @ vl).square().sum()
    return torch.stack(key), torch.stack(value)


def test_optr_losses_and_their_gradients_are_the_formula():
    """``_Prepared.key_loss``/``value_loss`` (batched over each KV head's query heads, the value error multiplied
    from the left) against the losses written out per query head: values and gradients of the rotations."""
    torch.manual_seed(3)
    heads, groups, d, t, sink, recent = 6, 2, 16, 40, 4, 8
    s = optr.LayerSample(torch.randn(heads, t, d).bfloat16(), (torch.randn(groups, t, d) + 0.5).bfloat16(),
                         torch.randn(groups, t, d).bfloat16())
    w_o = torch.randn(24, heads * d) / 8
    k_mean = s.k.float().mean(1)
    pos = fit.query_positions(t, sink, recent, 20, torch.Generator().manual_seed(0))
    cfg = optr.OptRConfig()
    clip = torch.full((groups, 1), 0.8)
    prepared = optr._Prepared(s, k_mean, w_o, sink, recent, d ** -0.5, pos)
    r_k0, r_v0 = (torch.linalg.qr(torch.randn(groups, d, d))[0] for _ in range(2))
    a_k = (0.05 * torch.randn(groups, d, d)).requires_grad_(True)
    a_v = (0.05 * torch.randn(groups, d, d)).requires_grad_(True)
    r_k, r_v = optr._learned(r_k0, a_k), optr._learned(r_v0, a_v)
    with torch.no_grad():
        prepared.read_values_with(prepared.probs_q(r_k, clip, None).exp())
    got_k, got_v = prepared.key_loss(r_k, clip, None, cfg), prepared.value_loss(r_v, clip, None)
    want_k, want_v = _optr_losses_by_the_formula(s, k_mean, w_o, sink, recent, d ** -0.5, pos, r_k, r_v, clip, cfg)
    torch.testing.assert_close(got_k.double(), want_k, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got_v.double(), want_v, rtol=1e-4, atol=1e-7)
    for got, want, a in ((got_k, want_k, a_k), (got_v, want_v, a_v)):
        g_got, = torch.autograd.grad(got.sum(), a, retain_graph=True)
        g_want, = torch.autograd.grad(want.sum(), a, retain_graph=True)
        torch.testing.assert_close(g_got, g_want, rtol=2e-3, atol=2e-3 * g_want.abs().max().item())


def test_error_measures_over_query_blocks_are_the_full_sums():
    """The clip search's error measures, computed per block of query positions over the keys each block reads from
    INT2, equal the sums over every (query head, query, key) pair written out; also after the keys are rescaled
    (key scaling replaces the queries, and the blocks follow)."""
    torch.manual_seed(1)
    heads, groups, d, t, sink, recent = 6, 2, 16, 400, 8, 32
    s = optr.LayerSample(torch.randn(heads, t, d).bfloat16(), torch.randn(groups, t, d).bfloat16(),
                         torch.randn(groups, t, d).bfloat16())
    r_k, r_v = (torch.linalg.qr(torch.randn(groups, d, d))[0] for _ in range(2))
    pos = fit.query_positions(t, sink, recent, 150, torch.Generator().manual_seed(0))
    r = fit.RotatedSample(s, r_k, r_v, s.k.float().mean(1), sink, recent, d ** -0.5, pos)
    assert len(r._blocks) == 3                                       # 150 queries, blocks of 64
    assert sum((s1 - s0) * (hi - lo) for s0, s1, lo, hi in r._blocks) < 0.8 * len(pos) * t
    dk, dv = torch.randn(groups, t, d), torch.randn(groups, t, d)

    def direct():
        key = torch.zeros(groups, dtype=torch.float64)
        value = torch.zeros(groups, dtype=torch.float64)
        for h in range(heads):
            g = h // (heads // groups)
            key[g] += ((r.qr[h].double() @ dk[g].double().T).square() * r.int2).sum()
            value[g] += ((r.probs[h].double() * r.int2) @ dv[g].double()).square().sum()
        return key, value

    key, value = direct()
    torch.testing.assert_close(r._logit_square_sum(dk).double(), key, rtol=1e-5, atol=0)
    torch.testing.assert_close(r._output_square_sum(dv).double(), value, rtol=1e-5, atol=0)
    torch.testing.assert_close(r.key_error(r.kr + dk).double(), key, rtol=1e-4, atol=0)
    r.rescale_keys(torch.rand(groups, d) + 0.5)
    torch.testing.assert_close(r._logit_square_sum(dk).double(), direct()[0], rtol=1e-5, atol=0)
