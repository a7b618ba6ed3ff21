"""Per-channel key scaling: the transform pair, the artifact (version 3), the search and the simulated cache."""

import json

import pytest
import torch

from oscar_sglang.calibration import key_scale
from oscar_sglang.calibration.fit import RotatedSample, query_positions
from oscar_sglang.calibration.stats import LayerSample
from oscar_sglang import artifacts as art
from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot

KV, D = 2, 32
FP = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=2, hidden_size=4 * D, num_attention_heads=4,
                          num_kv_heads=KV, head_dim=D, vocab_size=100, rope_type="default", rope_theta=1e4)


def _orth(g, n=KV, d=D):
    return torch.stack([torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0] for _ in range(n)])


def _layer(g, scale=True):
    s = torch.exp(0.7 * torch.randn(KV, D, generator=g)) if scale else None
    return art.LayerRotation(_orth(g).float(), _orth(g).float(), torch.randn(KV, D, generator=g),
                             torch.full((KV,), 0.9), torch.ones(KV), s)


def test_query_transform_is_the_inverse_transpose_so_logits_are_unchanged():
    g = torch.Generator().manual_seed(0)
    layer = _layer(g)
    assert not torch.allclose(layer.k_transform, layer.k_rotation)  # really scaled, not orthogonal
    eye = layer.q_transform.double().transpose(-1, -2) @ layer.k_transform.double()
    assert torch.allclose(eye, torch.eye(D, dtype=torch.float64).expand(KV, D, D), atol=1e-5)
    q = torch.randn(5, 2 * KV, D, generator=g)
    k = torch.randn(7, KV, D, generator=g)
    qr = rot.rotate_queries(q, layer.q_transform)
    kr = rot.rotate_kv(k, layer.k_transform, layer.k_mean)
    exact = torch.einsum("qhd,thd->hqt", q, (k - layer.k_mean).repeat_interleave(2, 1))
    assert torch.allclose(torch.einsum("qhd,thd->hqt", qr, kr.repeat_interleave(2, 1)), exact, atol=1e-4)
    assert torch.equal(_layer(g, scale=False).k_scale, torch.ones(KV, D))  # no scales: all ones


def _artifact(g, scaled=True):
    return art.RotationArtifacts(FP, "unit", [_layer(g, scaled), _layer(g, False)])


def test_scaled_artifact_round_trips_as_version_3_and_unscaled_stays_version_2(tmp_path):
    g = torch.Generator().manual_seed(1)
    a = _artifact(g)
    art.save(a, tmp_path / "s")
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["format_version"] == 3
    b = art.load(tmp_path / "s", expect=FP)
    assert torch.equal(b.layers[0].k_scale, a.layers[0].k_scale) and torch.equal(b.layers[1].k_scale, torch.ones(KV, D))
    art.save(_artifact(g, scaled=False), tmp_path / "u")
    assert json.loads((tmp_path / "u" / "manifest.json").read_text())["format_version"] == 2
    from safetensors import safe_open
    with safe_open(str(tmp_path / "u" / "rotations.safetensors"), "pt") as f:
        assert not any(k.endswith("k_scale") for k in f.keys())
    assert torch.equal(art.load(tmp_path / "u").layers[0].k_scale, torch.ones(KV, D))


def test_version_2_manifest_with_key_scales_is_refused(tmp_path):
    # an older reader could not apply the scales: a v2 manifest over a scaled tensor file must not load
    art.save(_artifact(torch.Generator().manual_seed(2)), tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["format_version"] = 2
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(art.ArtifactError, match="unexpected tensors layers.0.k_scale"):
        art.load(tmp_path)


def test_key_scales_out_of_bounds_or_non_finite_are_refused(tmp_path):
    g = torch.Generator().manual_seed(3)
    for bad, msg in ((1e-4, "outside"), (float("nan"), "NaN or inf"), (0.0, "outside")):
        a = _artifact(g)
        a.layers[1].k_scale[0, 3] = bad
        with pytest.raises(art.ArtifactError, match=f"layers.1.k_scale.*{msg}|{msg}.*"):
            art.save(a, tmp_path / "x")


def test_candidate_scales_follow_the_formula_normalised_and_bounded():
    g = torch.Generator().manual_seed(4)
    a = torch.rand(KV, D, generator=g).double() + 0.1
    b = torch.rand(KV, D, generator=g).double() * 10 + 0.1
    s = key_scale.candidate_scales(a, b, ((0.5, 0.5), (0.0, 1.0)))
    assert s.shape == (2, KV, D)
    assert torch.allclose(s.log().mean(-1), torch.zeros(2, KV), atol=1e-5)  # geometric mean 1 per head
    want = (a / b) ** 0.25
    assert torch.allclose(s[0].double(), want / want.log().mean(-1, keepdim=True).exp(), rtol=1e-5)
    want = b ** -0.5
    assert torch.allclose(s[1].double(), want / want.log().mean(-1, keepdim=True).exp(), rtol=1e-5)
    huge = key_scale.candidate_scales(torch.ones(1, 4), torch.tensor([[1e-30, 1.0, 1.0, 1e30]]), ((0.0, 1.0),))
    lo, hi = art.KEY_SCALE_BOUNDS
    assert lo < huge.min() and huge.max() < hi


def _samples(g, n=4, t=384, h=4, spread=True):
    """Keys with a few huge channels the queries ignore, queries big where keys are small (the case scaling fixes)."""
    out = []
    kscale = torch.ones(D)
    qscale = torch.ones(D)
    if spread:
        kscale[:4] = 12.0
        qscale[:4] = 0.05
        qscale[4:12] = 3.0
    for _ in range(n):
        q = torch.randn(h, t, D, generator=g) * qscale
        k = torch.randn(KV, t, D, generator=g) * kscale
        v = torch.randn(KV, t, D, generator=g)
        out.append(LayerSample(q, k, v))
    return out


def _rotated(samples, g, sink=8, recent=32):
    eye = torch.eye(D).expand(KV, D, D)
    zero = torch.zeros(KV, D)
    return [RotatedSample(s, eye, eye, zero, sink, recent, D ** -0.5, query_positions(s.q.shape[1], sink, recent, 64, g))
            for s in samples]


def test_search_keeps_scales_that_cut_the_held_out_logit_error():
    g = torch.Generator().manual_seed(5)
    rotated = _rotated(_samples(g), g)
    groups = torch.tensor([0, 0, 1, 1])
    res = key_scale.search(rotated, groups, 2, torch.ones(KV), D)
    assert res["kept"].all()
    assert (res["heldout_scaled"] < 0.5 * res["heldout_unscaled"]).all()
    assert (res["rel_error"] < 0.7 * res["rel_error_unscaled"]).all()
    s = res["k_scale"]
    assert (s[:, :4].mean(-1) < s[:, 4:12].mean(-1)).all()  # the huge, ignored key channels are scaled down
    # independent check: the chosen scales and clips, applied by hand, give the reported error
    err = energy = 0.0
    for r in rotated:
        qr, kr = r.qr, r.kr
        r.rescale_keys(s)
        err += r.key_error(fmt.fake_quantize(r.kr, D, res["k_clip"].reshape(-1, 1, 1))).double()
        energy += r.key_energy().double()
        r.qr, r.kr = qr, kr
    assert torch.allclose((err / energy).sqrt(), res["rel_error"].double(), rtol=1e-4)


def test_search_rejects_scales_on_isotropic_keys_where_they_cannot_help():
    g = torch.Generator().manual_seed(6)
    rotated = _rotated(_samples(g, spread=False), g)
    res = key_scale.search(rotated, torch.tensor([0, 0, 1, 1]), 2, torch.ones(KV), D)
    for h in range(KV):  # either rejected, or kept with a held-out gain (never a held-out loss)
        assert not res["kept"][h] or res["heldout_scaled"][h] < res["heldout_unscaled"][h]
        if not res["kept"][h]:
            assert torch.equal(res["k_scale"][h], torch.ones(D)) and res["k_clip"][h] == 1.0
