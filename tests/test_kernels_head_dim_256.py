"""Head size 256 (Gemma's: ``tests/test_architectures.py`` serves it on CPU, through the torch path) through the
three Triton kernels against their plain-torch references, as the per-kernel tests do at 64 and 128: the write
(rotation, clipping, codes; byte-identical under an identity rotation), the decode (default and folded loops,
split-K, hot rows) and the extend (TF32 and bf16 dots).  The kernels' loops take ``d`` as a compile-time size
(four ``d / 4`` pieces a row), so 256 is a new compilation of each, not a new code path; on a GPU it is also a
new register budget (not measured: no GPU run has taken d 256 yet)."""

import pytest
import torch
import test_kernels_decode as dec
import test_kernels_extend as ext
import test_kernels_write as wr
from kernel_device import DEVICE

from oscar_sglang import format as fmt
from oscar_sglang.kernels import api
from oscar_sglang.kernels.decode import reference as decode_reference
from oscar_sglang.kernels.extend import reference as extend_reference

D = 256
F = fmt.RowFormat


@pytest.mark.parametrize("kf,vf,identity", [(F(2), F(2), True), (F(2), F(2), False), (F(4, 64), F(2, 32), False)])
def test_write_kernel_at_head_dim_256(kf, vf, identity):
    wr._check_against_reference(D, kf, vf, identity, True, 21, 256 + kf.bits,
                                lambda *a: api.write_kv(*a, backend="triton"))


@pytest.mark.parametrize("fold", [False, True])
def test_decode_kernel_at_head_dim_256(fold):
    lens = [1, 17, 50]
    paged, rot, store = dec.build(lens, D, None, 16, True, 7 + fold, formats=dec.FORMATS[7 if fold else 3])
    q = torch.randn(len(lens), dec.KV * 4, D, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    ref = decode_reference.decode_attention(*args, D**-0.5)
    out = api.decode_attention(*args, backend="triton", num_splits=2, block_n=16, fold=fold)
    err = (out - ref).abs().max().item()
    if fold:
        assert err < dec.fold_tolerance(args, ref), err
    else:
        assert torch.allclose(out, ref, atol=dec.ATOL, rtol=dec.RTOL), err


@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_extend_kernel_at_head_dim_256(dots):
    prefix, extend = [0, 5, 33], [3, 17, 2]
    paged, rot, store = ext.build(prefix, extend, D, None, 16, True, 9, formats=ext.FORMATS[4])
    q, k, v = ext.new_tokens(sum(extend), ext.KV * 3, D, 9)
    pre, new = torch.tensor(prefix, device=DEVICE), torch.tensor(extend, device=DEVICE)
    args = (q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices, pre, new)
    ref = extend_reference.extend_attention(*args, D**-0.5)
    out = api.extend_attention(*args, backend="triton", block_rows=16, block_n=16, dots=dots)
    atol, rtol = ext.tolerance(dots)
    assert not torch.isnan(out).any()
    assert torch.allclose(out, ref, atol=atol, rtol=rtol), (out - ref).abs().max()
