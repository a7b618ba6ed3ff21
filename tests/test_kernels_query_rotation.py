"""The decode's query rotation kernel (Triton, under the interpreter on CPU) against the torch formula.

``rotated_queries(q, R_K)`` must equal ``rotation.rotate_queries`` (``q @ R_K[group(h)]``, fp32), for the
query dtypes and strides a server passes, every GQA grouping, both head sizes the kernels serve.
"""

import pytest
import torch
from kernel_device import DEVICE

from oscar_sglang.kernels.decode.query_rotation import rotated_queries
from oscar_sglang.rotation import rotate_queries


def _rotation(kv: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.linalg.qr(torch.randn(kv, d, d, generator=g, dtype=torch.float64))[0]
    scale = torch.rand(kv, 1, d, generator=g, dtype=torch.float64) + 0.5  # R_K diag(1/s): not orthogonal
    return (r * scale).float().to(DEVICE)


@pytest.mark.parametrize("d,kv,gq,dtype,strided", [(128, 8, 4, torch.bfloat16, True), (64, 3, 5, torch.float32, False),
                                                   (128, 2, 1, torch.float16, False), (64, 1, 8, torch.bfloat16, True),
                                                   (256, 2, 16, torch.float32, True)])
def test_rotated_queries_equal_the_torch_rotation(d, kv, gq, dtype, strided):
    g = torch.Generator().manual_seed(d + kv + gq)
    rot = _rotation(kv, d, d * kv)
    if strided:  # a view of a wider projection output, as SGLang passes q (rows contiguous, heads strided)
        q = torch.randn(3, kv * gq, d + 16, generator=g).to(dtype).to(DEVICE)[:, :, 8:8 + d]
    else:
        q = torch.randn(3, kv * gq, d, generator=g).to(dtype).to(DEVICE)
    out = rotated_queries(q, rot)
    ref = rotate_queries(q, rot)  # fp32 from the same (rounded) inputs
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == q.shape
    # fp32 products and sums (IEEE dots on the GPU too), only the order differs: ~1e-6 of the scale
    assert (out - ref).abs().max().item() < 1e-5 * ref.abs().max().item() * d ** 0.5


def test_rotated_queries_refuse_what_they_cannot_rotate_and_pass_an_empty_batch():
    rot = _rotation(2, 64, 1)
    assert rotated_queries(torch.zeros(0, 4, 64, device=DEVICE), rot).shape == (0, 4, 64)
    with pytest.raises(ValueError, match="grouped"):
        rotated_queries(torch.zeros(1, 3, 64, device=DEVICE), rot)
    with pytest.raises(ValueError, match="float32"):
        rotated_queries(torch.zeros(1, 4, 64, device=DEVICE), rot.double())
    with pytest.raises(ValueError, match="head_dim"):
        rotated_queries(torch.zeros(1, 2, 48, device=DEVICE), _rotation(1, 48, 2))
