"""Where and in which dtype the calibration runs: --device / --dtype resolution, statistics on the model's device."""

import pytest
import torch

from oscar_sglang.calibration import cli
from oscar_sglang.calibration import model as model_io
from oscar_sglang.calibration.stats import StatsCollector

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert not model_io.cpu_has_native_bf16(AVX2_ONLY)
    assert model_io.cpu_has_native_bf16(SAPPHIRE)
    assert not model_io.cpu_has_native_bf16("")


def test_auto_dtype_is_float32_only_on_a_cpu_without_native_bf16():
    assert model_io.resolve_dtype("auto", "cpu", AVX2_ONLY) is torch.float32
    assert model_io.resolve_dtype("auto", "cpu", SAPPHIRE) is torch.bfloat16
    assert model_io.resolve_dtype("auto", "cuda", AVX2_ONLY) is torch.bfloat16
    assert model_io.resolve_dtype("float32", "cuda") is torch.float32
    assert model_io.resolve_dtype("bfloat16", "cpu", AVX2_ONLY) is torch.bfloat16
    with pytest.raises(ValueError, match="--dtype must be auto or one of bfloat16, float32"):
        model_io.resolve_dtype("float16", "cpu")


def test_device_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_io.resolve_device("auto") == "cpu" and model_io.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="--device cuda, but no CUDA device is visible"):
        model_io.resolve_device("cuda")
    with pytest.raises(ValueError, match="--device must be one of"):
        model_io.resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model_io.resolve_device("auto") == "cuda"


def test_cli_refuses_cuda_without_a_gpu_before_loading_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(model_io, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["--out", str(tmp_path / "r"), "--device", "cuda", "--method", "hadamard"]) == 2
    assert "--device cuda, but no CUDA device is visible" in capsys.readouterr().err


def test_statistics_accumulate_in_float64_on_the_inputs_device_and_move_back():
    """On a GPU the sums live on the GPU (float64); the 'meta' device stands in for it here."""
    col = StatsCollector(num_layers=1, q_heads=4, kv_heads=2, head_dim=8, keep_sequences=0)
    q = torch.empty(1, 4, 5, 8, device="meta")
    k = v = torch.empty(1, 2, 5, 8, device="meta")
    out = torch.empty(1, 5, 4, 8, device="meta")
    col(0, q, k, v, out)
    st = col.layers[0]
    assert st.c_q.device.type == "meta" and st.c_q.dtype == torch.float64
    assert st.c_s.device.type == "meta" and st.k_sum.device.type == "meta" and st.tokens == 5
    cpu = StatsCollector(num_layers=1, q_heads=4, kv_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(0)
    qc, kc, vc = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    cpu(0, qc, kc, vc, torch.randn(1, 5, 4, 8, generator=g))
    torch.testing.assert_close(cpu.layers[0].key_mean, kc.double().sum(dim=(0, 2)) / 5)
