"""Per-(layer, KV head) INT2 diagnostics against direct computation."""

import math

import torch

from oscar_sglang import artifacts as art
from oscar_sglang.calibration import diagnostics, roundtrip

FP = art.ModelFingerprint("LlamaForCausalLM", 2, 128, 4, 2, 64, 100, "default", 1e4)


def _kv(seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(400, 2, 64, generator=g)
    k[:, 0, :] += 3.0           # head 0: a constant offset on every channel
    k[:, 1, 5] *= 20.0          # head 1: one outlier channel
    v = torch.randn(400, 2, 64, generator=g)
    return {0: (k, v), 1: (0.5 * k, 2 * v)}


def test_shape_statistics_match_their_definitions():
    k, _ = _kv(0)[0]
    st = diagnostics.shape_statistics(k)
    x = k.double()
    for h in range(2):
        share = (x[:, h].mean(0).pow(2).sum() / x[:, h].pow(2).sum(-1).mean()).item()
        rms = x[:, h].pow(2).mean(0).sqrt()
        assert math.isclose(st["mean_share"][h].item(), share, rel_tol=1e-9)
        assert math.isclose(st["rms_spread"][h].item(), (rms.max() / rms.median()).item(), rel_tol=1e-9)
        assert st["outliers"][h].item() == (rms > 4 * rms.median()).sum().item()
    assert st["mean_share"][0] > 0.85 and st["mean_share"][1] < 0.05  # 9 / (9 + 1) expected for head 0
    assert st["outliers"][1] == 1 and st["outliers"][0] == 0 and st["rms_spread"][1] > 15


def test_head_errors_equal_the_round_trip_error_of_each_head_alone():
    k, v = _kv(1)[0]
    a = art.hadamard(FP)
    lr = a.layers[0]
    errs = diagnostics.head_errors(k, lr.k_rotation, lr.k_mean, lr.k_clip, a.group)
    for h in range(2):
        alone = roundtrip.relative_error(k[:, h:h + 1], lr.k_rotation[h:h + 1], lr.k_mean[h:h + 1],
                                         lr.k_clip[h:h + 1], a.group)
        assert math.isclose(errs[h].item(), alone, rel_tol=1e-5)


def test_diagnose_rows_and_levers():
    kv = _kv(2)
    had = art.hadamard(FP)
    levers = {"identity": art.identity(FP), "hadamard": had,
              "hadamard+center": roundtrip.with_key_means(had, _kv(3), "hadamard+center")}
    rows = diagnostics.diagnose(kv, levers)
    assert len(rows) == 2 * 2 * 2 and {(r["layer"], r["head"], r["tensor"]) for r in rows} == \
        {(l, h, t) for l in range(2) for h in range(2) for t in "kv"}
    by = {(r["layer"], r["head"], r["tensor"]): r for r in rows}
    # the outlier head: rotating helps; the offset head: centering (means from another text) helps most
    assert by[0, 1, "k"]["error"]["hadamard"] < by[0, 1, "k"]["error"]["identity"]
    assert by[0, 0, "k"]["error"]["hadamard+center"] < 0.5 * by[0, 0, "k"]["error"]["hadamard"]
    assert by[0, 0, "v"]["error"]["hadamard+center"] == by[0, 0, "v"]["error"]["hadamard"]  # values: no means
    table = diagnostics.worst_table(rows, "hadamard", n=3)
    errs = [float(line.split("|")[-3]) for line in table.splitlines()[2:]]
    assert len(errs) == 3 and errs == sorted(errs, reverse=True)


def test_key_statistics_are_the_head_means_of_the_shape_statistics():
    kv = _kv(4)
    rows = roundtrip.key_statistics(kv)
    st = diagnostics.shape_statistics(kv[1][0])
    assert math.isclose(rows[1]["key_mean_energy_share"], st["mean_share"].mean().item(), rel_tol=1e-12)
    assert math.isclose(rows[1]["key_max_over_median_channel_rms"], st["rms_spread"].mean().item(), rel_tol=1e-12)


def test_key_scale_errors_are_measured_in_the_orthogonal_frame():
    # rows quantize scale-equivariantly (power-of-two scales keep fp16 scale/zero exact), so a uniform key
    # scale of 4 must leave the reported error unchanged, and a non-uniform one must change it
    from oscar_sglang import rotation as rot

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 2, 64, generator=g) * torch.linspace(0.2, 3, 64)
    r = rot.hadamard(64).expand(2, 64, 64).float()
    mean, clip = torch.randn(2, 64, generator=g), torch.full((2,), 0.9)
    base = diagnostics.head_errors(x, r, mean, clip, 64)
    assert torch.equal(diagnostics.head_errors(x, r, mean, clip, 64, scale=torch.full((2, 64), 4.0)), base)
    other = diagnostics.head_errors(x, r, mean, clip, 64, scale=torch.exp(torch.randn(2, 64, generator=g)))
    assert not torch.allclose(other, base)
