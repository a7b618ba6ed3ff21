"""oscar-sglang's ``sgl_kernel`` stand-in (scripts/sgl_kernel_standin) and its DualGemm plugin.

Each torch implementation is checked against an independent reference: SGLang's
own native code where it has one, and the formula written out here.  Runs on the
installed copy (CUDA tensors where CUDA is present, as on the GPU test machine);
skipped where the real sgl_kernel is installed instead.
"""

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import math
import os
import pathlib
import pkgutil
import subprocess
import sys
import textwrap
import types

import pytest

try:
    importlib.metadata.distribution("oscar-sgl-kernel-standin")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("the sgl_kernel stand-in is not installed here", allow_module_level=True)

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
torch = pytest.importorskip("torch")
sglang = pytest.importorskip("sglang")

import sgl_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
SGLANG_ROOT = pathlib.Path(sglang.__file__).parent

# SGLang module (relative to the sglang package) -> names it imports from sgl_kernel on CUDA.
CUDA_IMPORTS = {
    "srt/layers/layernorm.py": ("sgl_kernel", {"rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm",
                                               "gemma_fused_add_rmsnorm"}),
    "srt/layers/activation.py": ("sgl_kernel", {"silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"}),
    "srt/layers/sampler.py": ("sgl_kernel", {"top_k_renorm_prob", "top_p_renorm_prob"}),
    "srt/layers/attention/merge_state.py": ("sgl_kernel", {"merge_state_v2"}),
    "srt/model_executor/runner_backend_utils/weak_ref_tensor.py": ("sgl_kernel", {"weak_ref_tensor"}),
    "srt/layers/attention/triton_backend.py": ("sgl_kernel.utils", {"is_arch_support_pdl"}),
}


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


# --- What SGLang imports, and what the package does and does not define.

@pytest.mark.parametrize("path", sorted(CUDA_IMPORTS))
def test_names_sglang_imports_on_cuda_are_implemented(path):
    module, names = CUDA_IMPORTS[path]
    tree = ast.parse((SGLANG_ROOT / path).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == module
                for alias in node.names}
    assert names <= imported, f"{path} no longer imports {sorted(names - imported)} from {module}"
    owner = importlib.import_module(module)
    for name in names:
        # Defined in the module itself, not answered by the module __getattr__ with a raising stand-in.
        assert name in vars(owner) and getattr(owner, name).__module__ == module, name


@pytest.mark.parametrize("name", ["moe_sum", "moe_sum_reduce", "int8_scaled_mm", "rotary_embedding",
                                  "kvcacheio.transfer_kv_per_layer", "kvcacheio.transfer_kv_all_layer",
                                  "quantization.ggml_dequantize", "utils.get_cuda_stream"])
def test_unlisted_names_raise_naming_the_function(name):
    fn = pkgutil.resolve_name(f"sgl_kernel:{name}")
    with pytest.raises(NotImplementedError, match=rf"sgl_kernel\.{name} was called.*oscar-sglang's stand-in"):
        fn(torch.zeros(1), out=None)


def test_submodules_sglang_imports_from_are_real_modules():
    from sgl_kernel import kvcacheio, quantization, utils
    from sgl_kernel.utils import is_arch_support_pdl

    for module, name in ((utils, "utils"), (kvcacheio, "kvcacheio"), (quantization, "quantization")):
        assert isinstance(module, types.ModuleType) and module.__name__ == f"sgl_kernel.{name}"
    assert is_arch_support_pdl() is False
    assert not hasattr(sgl_kernel, "__no_such_dunder__")


@pytest.mark.parametrize("name", ["scalar_type", "allreduce", "flash_attn", "mamba"])
def test_fallback_submodules_are_absent(name):
    # SGLang uses its own code where these fail to import.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"sgl_kernel.{name}")
    with pytest.raises(ImportError):
        exec(f"from sgl_kernel import {name}", {})
    assert not hasattr(sgl_kernel, name)


def test_weak_ref_tensor_returns_the_tensor():
    x = _rand(3)
    assert sgl_kernel.weak_ref_tensor(x) is x


# --- RMS norms.

@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_matches_sglang_native_and_formula(dtype):
    from sglang.srt.layers.layernorm import RMSNorm

    x, w = _rand(5, 64, dtype=dtype), _rand(64, dtype=dtype, seed=1)
    norm = RMSNorm(64, eps=1e-5, weight_dtype=dtype).to(DEVICE)
    norm.weight.data.copy_(w)
    got = sgl_kernel.rmsnorm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, norm.forward_native(x))
    x64 = x.double()
    formula = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(got, formula.to(dtype))
    out = torch.empty_like(x)
    assert sgl_kernel.rmsnorm(x, w, eps=1e-5, out=out, enable_pdl=False) is out
    torch.testing.assert_close(out, got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_updates_both_tensors_in_place(dtype):
    from sglang.srt.layers.layernorm import RMSNorm

    x, r, w = _rand(4, 32, dtype=dtype), _rand(4, 32, dtype=dtype, seed=1), _rand(32, dtype=dtype, seed=2)
    norm = RMSNorm(32, eps=1e-6, weight_dtype=dtype).to(DEVICE)
    norm.weight.data.copy_(w)
    want_out, want_residual = norm.forward_native(x.clone(), r.clone())
    x_in, r_in = x.clone(), r.clone()
    assert sgl_kernel.fused_add_rmsnorm(x_in, r_in, w, 1e-6, enable_pdl=None) is None
    torch.testing.assert_close(r_in, (x.float() + r.float()).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(r_in, want_residual)
    torch.testing.assert_close(x_in, want_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rmsnorms_scale_by_one_plus_weight(dtype):
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    x, r, w = _rand(4, 48, dtype=dtype), _rand(4, 48, dtype=dtype, seed=1), 0.1 * _rand(48, seed=2)
    norm = GemmaRMSNorm(48, eps=1e-6).to(DEVICE)
    norm.weight.data.copy_(w)
    got = sgl_kernel.gemma_rmsnorm(x, w, 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, norm.forward_native(x))
    x64 = x.double()
    formula = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    torch.testing.assert_close(got, formula.to(dtype))

    want_out, want_residual = norm.forward_native(x.clone(), r.clone())
    x_in, r_in = x.clone(), r.clone()
    assert sgl_kernel.gemma_fused_add_rmsnorm(x_in, r_in, w, 1e-6) is None
    torch.testing.assert_close(r_in, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(x_in, want_out)


# --- Gated activations.

def _silu(x):
    return x * torch.sigmoid(x)


def _gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,act,native", [("silu_and_mul", _silu, None), ("gelu_and_mul", _gelu_erf, "none"),
                                             ("gelu_tanh_and_mul", _gelu_tanh, "tanh")])
def test_act_and_mul_matches_sglang_native_and_formula(name, act, native, dtype):
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul

    x = 3 * _rand(2, 3, 64, dtype=dtype)
    fn = getattr(sgl_kernel, name)
    got = fn(x)
    assert got.dtype == dtype and got.shape == (2, 3, 32)
    layer = SiluAndMul() if native is None else GeluAndMul(approximate=native)
    torch.testing.assert_close(got, layer.forward_native(x))
    x64 = x.double()
    torch.testing.assert_close(got, (act(x64[..., :32]) * x64[..., 32:]).to(dtype))
    out = torch.empty_like(got)
    assert fn(x, out) is out  # SGLang passes out positionally
    torch.testing.assert_close(out, got, rtol=0, atol=0)


def test_gelu_variants_differ():
    x = _rand(4, 64)
    assert not torch.equal(sgl_kernel.gelu_and_mul(x), sgl_kernel.gelu_tanh_and_mul(x))


# --- Sampling renormalization, against per-row brute force.

def _dyadic_probs(rows, vocab, seed):
    """Probabilities k/4096 (exact in float32, with ties), so that sums compare exactly."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.stack([torch.bincount(torch.multinomial(torch.rand(vocab, generator=g) ** 3, 4096,
                                                           replacement=True, generator=g), minlength=vocab)
                          for _ in range(rows)])
    return counts.float() / 4096


def _renormalized(probs, keep):
    kept = [[p if k else 0.0 for p, k in zip(row, keep_row)] for row, keep_row in zip(probs, keep)]
    return torch.tensor([[p / sum(row) for p in row] for row in kept])


def _brute_top_k(probs, top_ks):
    keep = [[sum(q > p for q in row) < k for p in row] for row, k in zip(probs.tolist(), top_ks)]
    return _renormalized(probs.tolist(), keep)


def _brute_top_p(probs, top_ps):
    # Drop the least probable tokens while their total mass stays below 1 - p: a token is kept
    # when it and every token no more probable than it reach 1 - p together (ties stay together).
    keep = [[sum(q for q in row if q <= p) >= 1 - top_p for p in row] for row, top_p in zip(probs.tolist(), top_ps)]
    return _renormalized(probs.tolist(), keep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_renorm_prob_matches_brute_force(dtype):
    probs = _dyadic_probs(6, 40, seed=3).to(device=DEVICE, dtype=dtype)
    top_ks = [1, 2, 5, 17, 40, 1 << 30]  # 1 << 30: SGLang's TOP_K_ALL
    got = sgl_kernel.top_k_renorm_prob(probs, torch.tensor(top_ks, dtype=torch.int32, device=DEVICE))
    assert got.dtype == torch.float32 and got.shape == probs.shape
    torch.testing.assert_close(got.cpu(), _brute_top_k(probs.float().cpu(), top_ks))
    assert torch.equal(got[-1] > 0, probs[-1] > 0)
    scalar = sgl_kernel.top_k_renorm_prob(probs, 5)
    torch.testing.assert_close(scalar.cpu(), _brute_top_k(probs.float().cpu(), [5] * 6))


def test_top_k_renorm_prob_keeps_ties_with_the_pivot():
    probs = torch.tensor([[0.25, 0.125, 0.25, 0.125, 0.125, 0.125]], device=DEVICE)
    assert (sgl_kernel.top_k_renorm_prob(probs, 2) > 0).tolist() == [[True, False, True, False, False, False]]
    assert (sgl_kernel.top_k_renorm_prob(probs, 3) > 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_p_renorm_prob_matches_brute_force(dtype):
    probs = _dyadic_probs(6, 40, seed=4).to(device=DEVICE, dtype=dtype)
    top_ps = [0.05, 0.3, 0.5, 0.75, 0.9, 1.0]
    got = sgl_kernel.top_p_renorm_prob(probs, torch.tensor(top_ps, device=DEVICE))
    assert got.dtype == torch.float32 and got.shape == probs.shape
    torch.testing.assert_close(got.cpu(), _brute_top_p(probs.float().cpu(), top_ps))
    assert torch.equal(got[-1] > 0, probs[-1] > 0)
    scalar = sgl_kernel.top_p_renorm_prob(probs, 0.5)
    torch.testing.assert_close(scalar.cpu(), _brute_top_p(probs.float().cpu(), [0.5] * 6))


def test_top_p_renorm_prob_keeps_ties_with_the_pivot():
    probs = torch.tensor([[0.5, 0.125, 0.25, 0.125]], device=DEVICE)
    assert (sgl_kernel.top_p_renorm_prob(probs, 0.4) > 0).tolist() == [[True, False, False, False]]
    # Dropping 0.125 + 0.125 + 0.25 would reach 1 - p exactly: 0.25 stays (as in SGLang's torch sampler).
    assert (sgl_kernel.top_p_renorm_prob(probs, 0.5) > 0).tolist() == [[True, False, True, False]]
    assert (sgl_kernel.top_p_renorm_prob(probs, 0.6) > 0).tolist() == [[True, False, True, False]]
    assert (sgl_kernel.top_p_renorm_prob(probs, 0.8) > 0).all()  # both 0.125s, or neither


# --- merge_state_v2, against SGLang's Triton fallback (interpreted on CPU, see conftest.py) and the formula.

@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_v2_matches_sglang_triton_and_formula(dtype):
    from sglang.kernels.ops.attention.merge_state import merge_state_triton

    tokens, heads, dim = 4, 3, 16
    v_a, v_b = _rand(tokens, heads, dim, dtype=dtype), _rand(tokens, heads, dim, dtype=dtype, seed=1)
    s_a, s_b = 4 * _rand(tokens, heads, seed=2), 4 * _rand(tokens, heads, seed=3)
    s_a[1, 0] = float("inf")  # an empty part: counts as -inf
    s_b[2, 1] = float("-inf")
    s_a[3, 2] = float("-inf")

    got_v, got_s = sgl_kernel.merge_state_v2(v_a, s_a, v_b, s_b)
    assert got_v.dtype == dtype and got_s.dtype == torch.float32
    want_v, want_s = merge_state_triton(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(got_v, want_v)
    torch.testing.assert_close(got_s, want_s)

    finite = torch.isfinite(s_a) & torch.isfinite(s_b)
    e_a, e_b = torch.exp(s_a.double()), torch.exp(s_b.double())
    formula_v = (e_a[..., None] * v_a.double() + e_b[..., None] * v_b.double()) / (e_a + e_b)[..., None]
    torch.testing.assert_close(got_v[finite], formula_v[finite].to(dtype))
    torch.testing.assert_close(got_s[finite], torch.log(e_a + e_b)[finite].float())
    torch.testing.assert_close(got_v[1, 0], v_b[1, 0], rtol=0, atol=0)  # +inf prefix: the suffix alone
    torch.testing.assert_close(got_s[1, 0], s_b[1, 0])
    torch.testing.assert_close(got_v[2, 1], v_a[2, 1], rtol=0, atol=0)
    torch.testing.assert_close(got_s[2, 1], s_a[2, 1])
    torch.testing.assert_close(got_v[3, 2], v_b[3, 2], rtol=0, atol=0)

    out_v, out_s = torch.empty_like(v_a), torch.empty_like(s_a)
    ret_v, ret_s = sgl_kernel.merge_state_v2(v_a, s_a, v_b, s_b, out_v, out_s)
    assert ret_v is out_v and ret_s is out_s
    torch.testing.assert_close(out_v, got_v, rtol=0, atol=0)


# --- The DualGemm plugin.

def test_plugin_entry_point_and_hook_target():
    import sgl_kernel_standin_plugin as plugin
    from sglang.srt.plugins.hook_registry import HookType

    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("no_cutedsl_dual_gemm") == "sgl_kernel_standin_plugin:register"
    for target, hook, kind in plugin.HOOKS:
        assert kind in HookType.__members__
        original = pkgutil.resolve_name(target)
        assert callable(original), target
        assert list(inspect.signature(original).parameters) == list(inspect.signature(hook).parameters)
        assert hook(None, None, 4096) is None


_PLUGIN_PROBE = textwrap.dedent("""
    import sys
    import sglang.srt.layers.dual_gemm as dual_gemm
    from sglang.srt.plugins.hook_registry import HookRegistry
    import sgl_kernel_standin_plugin

    dual_gemm.is_cuda = lambda: True  # take the CUDA branch, which imports the CuTe DSL module
    layer = object.__new__(dual_gemm.DualGemm)
    try:
        dual_gemm.DualGemm._select_mode(layer, None, 4096)
        print("ORIGINAL returned")
    except Exception as e:
        print("ORIGINAL", type(e).__name__, getattr(e, "name", ""))
    sys.modules.pop("sglang.kernels.ops.gemm.cutedsl_dual_gemm", None)
    sgl_kernel_standin_plugin.register()
    HookRegistry.apply_hooks()
    print("HOOKED", dual_gemm.DualGemm._select_mode(layer, None, 4096),
          "sglang.kernels.ops.gemm.cutedsl_dual_gemm" in sys.modules)
""")


def test_plugin_makes_select_mode_return_none():
    # In a subprocess: applying hooks patches SGLang process-wide.
    r = subprocess.run([sys.executable, "-c", _PLUGIN_PROBE], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    if importlib.util.find_spec("cutlass") is None:
        assert "ORIGINAL ModuleNotFoundError cutlass" in lines
    assert "HOOKED None False" in lines
