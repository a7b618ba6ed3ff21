"""Round-trip error measurement against direct computation."""

import torch

from oscar_sglang import artifacts as art
from oscar_sglang import format as fmt
from oscar_sglang.calibration import roundtrip

FP = art.ModelFingerprint("LlamaForCausalLM", 2, 128, 4, 2, 64, 100, "default", 1e4)


def _spiky_kv(seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(200, 2, 64, generator=g)
    k[..., 3] += 30.0  # a persistent outlier channel, as RoPE keys have
    v = torch.randn(200, 2, 64, generator=g)
    return {0: (k, v), 1: (k * 0.5, v * 2)}


def test_identity_error_is_plain_quantization_error():
    kv = _spiky_kv(0)
    rows = roundtrip.per_layer_errors(kv, art.identity(FP))
    k, v = kv[0]
    assert abs(rows[0]["k"] - ((fmt.fake_quantize(k) - k).norm() / k.norm()).item()) < 1e-6
    assert abs(rows[0]["v"] - ((fmt.fake_quantize(v) - v).norm() / v.norm()).item()) < 1e-6


def test_hadamard_and_centering_reduce_key_error_on_outlier_channels():
    kv = _spiky_kv(1)
    ident = roundtrip.per_layer_errors(kv, art.identity(FP))
    had = roundtrip.per_layer_errors(kv, art.hadamard(FP))
    centred = roundtrip.per_layer_errors(kv, roundtrip.with_key_means(art.hadamard(FP), kv, "c"))
    for a, b, c in zip(ident, had, centred):
        assert c["k"] < b["k"] < a["k"]
        assert c["v"] == b["v"]
    table = roundtrip.markdown_table({"identity": ident, "hadamard": had})
    assert table.count("\n") == 2 + 2 and "| mean |" in table
