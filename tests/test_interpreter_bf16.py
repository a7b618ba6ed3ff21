"""Triton's interpreter as the kernel tests use it (``kernels/interpret.py``): bf16 like a GPU.

The interpreter stores bf16 as uint16 bit patterns; unpatched, ``tl.dot`` of
bf16 operands multiplies those integers and an fp32 -> bf16 cast truncates.
``interpret.enable()`` makes both behave as on a GPU: checked here against
torch's own bf16 rounding (round to nearest even) and an fp32 matmul of the
rounded operands.  CPU only (on CUDA the kernels are compiled).
"""

import pytest
import torch
from kernel_device import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter runs on CPU only")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :]).to(tl.bfloat16)  # fp32 in, rounded here
    b = tl.load(b_ptr + k[:, None] * N + n[None, :]).to(tl.bfloat16)
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))


def test_bf16_dot_is_an_fp32_product_of_the_rounded_operands():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)
    out = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, out, M=16, N=16, K=32)
    want = a.bfloat16().float() @ b.bfloat16().float()
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5), (out - want).abs().max()
    assert not torch.allclose(out, a @ b, atol=1e-4, rtol=0)  # the operands were rounded


def test_fp32_to_bf16_rounds_to_nearest_even_like_torch():
    # ties both ways, values just above/below a tie, subnormals, large and special values
    base = torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, 1.0 + 2**-8 - 2**-20,
                         -1.0 - 2**-8, 3.0e38, 1e-40, -2.5e-39, 0.0, -0.0, float("inf"), float("-inf")])
    x = torch.cat([base, torch.randn(499, generator=torch.Generator().manual_seed(1)) * 100])
    out = torch.empty(512, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, N=512)
    assert torch.equal(out.view(torch.int16), x.bfloat16().view(torch.int16))


def test_nan_stays_nan():
    x = torch.full((16,), float("nan"))
    out = torch.empty(16, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, N=16)
    assert out.isnan().all()
