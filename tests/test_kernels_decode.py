"""Decode kernel (Triton, under the interpreter on CPU) against the plain-torch reference.

Tolerance: |o - o_ref| <= 1e-4 + 1e-4 |o_ref| with fp32 queries on CPU (1e-2 on a GPU: TF32 dots) (the
interpreter computes every dot in fp32; the reference dequantizes and runs
plain attention).  bf16 queries/outputs: within bf16 rounding (2^-7 relative).

Key and value formats rotate through the cases (INT2 with groups d, 64, 32,
and the mixed pairs: K INT4 + V INT2, K INT2/g16 + V INT4/g32, INT8 both,
K INT8 + V INT2/g32), each with both head sizes.  Under the interpreter the default run takes a covering
subset of the grid (every pair of head size, GQA, page size and hot entries; every format and split count:
``tests/case_grid.py``); a GPU, and ``--slow``, every case.
"""

import itertools

import case_grid
import pytest
import torch
from kernel_device import DEVICE

from oscar_sglang import format as fmt
from oscar_sglang.kernels import api, layout, scenario
from oscar_sglang.kernels.common.reference import expand_groups, read_rotated
from oscar_sglang.kernels.decode import reference, split_cut
from oscar_sglang.rotation import rotate_queries

KV = 2
ATOL = RTOL = 1e-4 if DEVICE == "cpu" else 1e-2  # the GPU's dots are TF32


F = fmt.RowFormat
# (keys, values) per case, rotating; groups None = d, so "64" is d for d = 64
FORMATS = [(F(2), F(2)), (F(2, 64), F(2, 64)), (F(2, 32), F(2, 32)),
           (F(4), F(2)), (F(2, 16), F(4, 32)), (F(8), F(8)), (F(8), F(2, 32)),
           (F(2, symmetric=True), F(2)), (F(4, symmetric=True), F(2, 32, True))]  # symmetric rows


def build(lens, d, group, page, hot, seed, sink=2, recent=4, formats=None):
    """A store holding every request's tokens, written by the reference, with sink/recent hot entries.

    ``formats``: (keys, values) RowFormats; default INT2 in groups of ``group`` on both sides.
    """
    kf, vf = formats or (F(2, group), F(2, group))
    paged = scenario.paged_layout(lens, page, seed, device=DEVICE)
    rot = scenario.random_rotation(KV, d, seed, device=DEVICE, key_scale=bool(seed % 2))  # odd seeds: key scales
    store = layout.empty_store(paged.num_slots, KV, d, None, sum(lens), DEVICE, k_format=kf, v_format=vf)
    all_slots = torch.cat([paged.slots(b) for b in range(len(lens))])
    k, v = scenario.random_kv(len(all_slots), KV, d, seed, DEVICE)
    if hot:
        hot_index = scenario.assign_hot(store, paged, sink, recent)
        hot_loc = hot_index[all_slots]
    else:
        hot_loc = None
    api.write_kv(k, v, all_slots, store, rot, hot_loc, backend="torch")
    return paged, rot, store


def fold_tolerance(args, ref):
    """The folded loop's error bound (softmax scale ``d^-0.5``, as every caller's reference): its queries (times
    the softmax's scale) rounded to fp16 (relative 2^-11 per element) move a logit by up to 2^-11 ``L``,
    ``L = d^-0.5 max_t sum_i |q'_i k'_ti|`` (rotated queries and keys; large with per-channel key scales: 16-160
    here), and the output by that much of its scale; the fp16 weights add 2^-11 of it.  Measured on CPU (every case here, two BLAS kernels: the interpreter's fp32 sums in
    another order): 0.015-0.032 of ``2^-11 (1 + L) max|o_ref|``; the bound is 1/8 of it (4x the largest)."""
    q, store, rot, req_to_token, req_pool_indices, seq_lens = args
    qr = rotate_queries(q, rot.q_rot).abs()
    lmax = 0.0
    for b, n in enumerate(seq_lens.tolist()):
        if n:
            k, _ = read_rotated(store, req_to_token[int(req_pool_indices[b]), :n])
            lmax = max(lmax, torch.einsum("hd,thd->ht", qr[b], expand_groups(k, q.shape[1]).abs()).max().item())
    return 2**-14 * (1 + q.shape[-1]**-0.5 * lmax) * ref.abs().max().item()


LENS = [1, 2, 15, 17, 37, 50]  # 1, 2, page-1, page+1, odd, and across splits of BLOCK_N=16
# Full product of d, GQA ratio, page size and hot entries; formats and split count rotate through
# their values (FORMATS; 1 to 5 splits) so each appears with both head sizes.
CASES = [(d, gqa, page, hot, FORMATS[i % len(FORMATS)], 1 + i % 5)
         for i, (d, gqa, page, hot) in enumerate(itertools.product((64, 128), (1, 3, 8), (1, 16), (True, False)))]
# under the interpreter by default: every pair of d, GQA, page size and hot entries, every format and split count
FAST = case_grid.covering_subset(CASES, pairs=(0, 1, 2, 3), singles=(4, 5))


def _case_id(c):
    d, gqa, page, hot, (kf, vf), splits = c
    return f"d{d}-gqa{gqa}-page{page}-{'hot' if hot else 'cold'}-K{kf.name(d)}-V{vf.name(d)}-s{splits}"


@pytest.mark.parametrize("d,gqa,page,hot,formats,splits", case_grid.params(CASES, FAST, _case_id))
def test_decode_kernel_matches_reference(d, gqa, page, hot, formats, splits):
    seed = d + 10 * gqa + page
    paged, rot, store = build(LENS, d, None, page, hot, seed, formats=formats)
    assert (store.k_format, store.v_format) == (formats[0].resolved(d), formats[1].resolved(d))
    q = torch.randn(len(LENS), KV * gqa, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    ref = reference.decode_attention(*args, d**-0.5)
    for in_kernel in (True, False):  # queries rotated inside the split kernel, or before it in torch
        out = api.decode_attention(*args, backend="triton", num_splits=splits, block_n=16,
                                   rotate_q_in_kernel=in_kernel)
        assert not torch.isnan(out).any()
        assert torch.allclose(out, ref, atol=ATOL, rtol=RTOL), (in_kernel, (out - ref).abs().max())


@pytest.mark.parametrize("fold", [False, True])
def test_head_dim_256_decodes_with_its_default_block_as_the_reference(fold):
    """d 256 (a power-of-two head size the kernels accept): the default block of tokens, 32 there
    (``default_block_n``; 64 tokens took 144 KiB of shared memory, over sm_86/89's 99 KiB), over requests
    across blocks and splits, hot and cold rows, INT2 and INT4 keys."""
    from oscar_sglang.kernels.decode.triton_kernel import default_block_n

    assert [default_block_n(d) for d in (64, 128, 256, 512, 1024)] == [64, 64, 32, 16, 16]
    lens, d = [1, 33, 70], 256
    for i, formats in enumerate([(F(2), F(2)), (F(4), F(2))]):
        paged, rot, store = build(lens, d, None, 16, True, 60 + i, formats=formats)
        q = torch.randn(len(lens), KV * 2, d, generator=torch.Generator().manual_seed(i)).to(DEVICE)
        args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
        ref = reference.decode_attention(*args, d**-0.5)
        out = api.decode_attention(*args, backend="triton", num_splits=2, fold=fold)
        tol = 2e-3 if fold else ATOL  # the fold's fp16 operands
        assert torch.allclose(out, ref, atol=tol, rtol=tol), (formats, (out - ref).abs().max())


@pytest.mark.parametrize("prefetch,hot_skip", [(0, False), (0, True), (1, False), (1, True), (2, False), (2, True)])
def test_pipelined_decode_loops_match_the_reference(prefetch, hot_skip):
    """The split kernel's loop loading ahead (slots, entries, rows of later blocks) and skipping the BF16 reads of
    all-cold blocks: the same attention, over splits that end mid-block, empty requests and one-block ones."""
    lens = [0, 1, 17, 50, 70, 33]
    for i, (d, page, hot, gqa) in enumerate([(64, 16, True, 4), (128, 1, True, 3), (64, 1, False, 1)]):
        seed = 40 + 7 * i + prefetch
        formats = FORMATS[(3 * i + prefetch) % len(FORMATS)]
        paged, rot, store = build(lens, d, None, page, hot, seed, formats=formats)
        q = torch.randn(len(lens), KV * gqa, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
        ref = reference.decode_attention(*args, d**-0.5)
        out = api.decode_attention(*args, backend="triton", num_splits=1 + i, block_n=16, prefetch=prefetch,
                                   hot_skip=hot_skip)
        assert not torch.isnan(out).any()
        assert torch.allclose(out, ref, atol=ATOL, rtol=RTOL), (i, (out - ref).abs().max())
    with pytest.raises(ValueError, match="prefetch"):
        api.decode_attention(*args, backend="triton", prefetch=3)


@pytest.mark.parametrize("fold,hot_loop", [(False, True), (False, False), (True, False)])
def test_blocks_with_hot_rows_in_their_own_loop_match_the_reference(fold, hot_loop):
    """``hot_loop`` (and the folded loop whatever it says): the blocks holding a hot row (sink, recent window)
    noted in the loop over the blocks and attended after it, 16 rows at a time: requests of many blocks, cold
    ones between the first and the last hot one (the second loop must pass over them), splits holding both
    ends, one or none, blocks of one to four parts; the default (hot rows read inside the loop) the same."""
    lens = [200, 130, 5, 64]
    for i, (d, block_n, splits) in enumerate([(64, 64, 1), (128, 32, 3), (64, 16, 2), (128, 64, 4)]):
        seed = 90 + 3 * i + fold
        paged, rot, store = build(lens, d, None, 16, True, seed, sink=3, recent=20,
                                  formats=FORMATS[0] if fold else FORMATS[(2 * i) % len(FORMATS)])
        q = torch.randn(len(lens), KV * 4, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
        ref = reference.decode_attention(*args, d**-0.5)
        out = api.decode_attention(*args, backend="triton", num_splits=splits, block_n=block_n, fold=fold,
                                   hot_loop=hot_loop)
        err = (out - ref).abs().max().item()
        if fold:  # fp16 queries and weights
            assert err < fold_tolerance(args, ref), (i, err)
        else:
            assert torch.allclose(out, ref, atol=ATOL, rtol=RTOL), (i, err)


@pytest.mark.parametrize("fold", [False, True])
def test_splits_cut_by_work_keep_the_result_whatever_the_hint(fold):
    """``hot_windows`` (splits cut by work, ``split_cut.py``): the store's true windows, a wrong hint (hot rows
    elsewhere than it says), the heaviest weight (most splits empty or of one block): the same attention as the
    reference; with the true windows the splits are not the even ones here (the cut did move)."""
    lens = [200, 130, 5, 64]
    paged, rot, store = build(lens, 64, None, 16, True, 41 + fold, sink=3, recent=20, formats=FORMATS[0])
    q = torch.randn(len(lens), KV * 4, 64, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    ref = reference.decode_attention(*args, 64**-0.5)
    assert split_cut.split_bounds(200, 5, 16, (3, 20), split_cut.HOT_WEIGHT_FOLD) != split_cut.split_bounds(200, 5, 16)
    for hint, weight in (((3, 20), None), ((100, 0), None), ((3, 20), split_cut.MAX_HOT_WEIGHT)):
        out = api.decode_attention(*args, backend="triton", num_splits=5, block_n=16, fold=fold,
                                   hot_windows=hint, hot_weight=weight)
        err = (out - ref).abs().max().item()
        if fold:  # fp16 queries and weights
            assert err < fold_tolerance(args, ref), (hint, err)
        else:
            assert torch.allclose(out, ref, atol=ATOL, rtol=RTOL), (hint, err)
    with pytest.raises(ValueError, match="hot_weight"):
        api.decode_attention(*args, backend="triton", hot_windows=(3, 20), hot_weight=2)


@pytest.mark.parametrize("fold", [False, True])
def test_decode_gives_no_weight_to_what_hot_rows_and_the_padding_slot_hold(fold):
    """The decode loads every row's codes without a mask (the scales and zeros of its cold rows only, the rows it
    weighs): a hot row's codes, scale and zero, and the padding slot's (tokens past a request's end read slot 0),
    may hold anything, NaN scales included, without changing the result (default and folded loops, hot rows in
    and out of the loop)."""
    lens = [5, 70, 33]
    paged, rot, store = build(lens, 128, None, 16, True, 21, sink=3, recent=10)
    q = torch.randn(len(lens), KV * 4, 128, generator=torch.Generator().manual_seed(21)).to(DEVICE)
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    ref = reference.decode_attention(*args, 128**-0.5)
    poison = store.hot_index >= 0
    poison[:16] = True  # page 0: the padding slot's (no request's)
    assert poison.sum() > 16 and all(bool((~poison[paged.slots(b)]).any()) for b in (1, 2))  # 5 tokens: all hot
    g = torch.Generator().manual_seed(5)
    for codes in (store.k_codes, store.v_codes):
        codes[poison] = torch.randint(0, 256, codes[poison].shape, generator=g, dtype=torch.uint8).to(DEVICE)
    for t, bad in ((store.k_scale, float("nan")), (store.k_zero, float("inf")), (store.v_scale, float("nan")),
                   (store.v_zero, float("-inf"))):
        t[poison] = bad
    for kw in (dict(block_n=32), dict(block_n=64, hot_loop=True), dict(block_n=16, prefetch=2)):
        out = api.decode_attention(*args, backend="triton", num_splits=3, fold=fold, **kw)
        err = (out - ref).abs().max().item()
        assert torch.isfinite(out).all(), kw
        assert err < (fold_tolerance(args, ref) if fold else ATOL + RTOL * ref.abs().max().item()), (kw, err)


def test_decode_with_bf16_dots_is_within_bf16_rounding_of_the_reference():
    """``dots="bf16"``: queries, keys, softmax weights and values rounded to bf16 before the dots (fp32 sums)."""
    paged, rot, store = build([1, 17, 70], 128, None, 16, True, 11, formats=FORMATS[3])
    q = torch.randn(3, KV * 4, 128, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    ref = reference.decode_attention(*args, 128**-0.5)
    out = api.decode_attention(*args, backend="triton", num_splits=2, block_n=16, dots="bf16")
    err = (out - ref).abs().max().item()
    tf32 = (api.decode_attention(*args, backend="triton", num_splits=2, block_n=16) - ref).abs().max().item()
    # bf16 operands: an error of their rounding (2^-6 of the output's scale, as the extend tests' bf16 bound;
    # 3e-3 of it here on CPU), and more than the fp32 operands' (1e-6 on CPU, TF32's ~1e-3 on a GPU)
    assert tf32 < err < 2**-6 * ref.abs().max().item(), (err, tf32)
    with pytest.raises(ValueError, match="dots"):
        api.decode_attention(*args, backend="triton", dots="fp8")


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_decode_with_folded_scales_is_within_fp16_rounding_of_the_reference(prefetch):
    """``fold=True``: blocks without a hot row attended over the codes (fp16, exact) with each row's scale and
    zero folded into the logits and weights; blocks with one dequantized as before, 16 rows at a time (also with
    ``unpack_first``, the values' codes unpacked before they are transposed).  Formats
    of one group per row (INT2, INT4 and INT8 keys, symmetric keys, symmetric values: their codes biased, the
    bias taken off after the dots), hot windows or none, GQA 1 to 8."""
    lens = [0, 1, 17, 50, 70, 33]
    sym = (F(2, symmetric=True), F(2, symmetric=True))
    cases = [(64, 16, True, 4, FORMATS[0]), (128, 1, True, 3, FORMATS[3]), (64, 1, False, 1, FORMATS[5]),
             (128, 16, True, 8, FORMATS[7]), (128, 16, True, 4, sym)]
    for i, (d, page, hot, gqa, formats) in enumerate(cases):
        seed = 50 + 5 * i + prefetch
        paged, rot, store = build(lens, d, None, page, hot, seed, formats=formats)
        q = torch.randn(len(lens), KV * gqa, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
        ref = reference.decode_attention(*args, d**-0.5)
        # block_n 64 and 32: a block with a hot row is attended 16 rows at a time (several parts); the warps
        # change the compiled layouts on a GPU (the interpreter ignores them)
        kw = dict(backend="triton", num_splits=1 + i, block_n=(16, 64, 32, 64, 32)[i], prefetch=prefetch,
                  num_warps=(4, 2, 1, 2, 2)[i])
        out = api.decode_attention(*args, fold=True, **kw)
        err = (out - ref).abs().max().item()
        # fp16 queries and weights (10-bit mantissas, as TF32's): 2^-12.7 to 2^-8.6 of the output's scale here,
        # by the logits' size (symmetric INT2 keys with key scales, case 3, the largest)
        assert err < fold_tolerance(args, ref), (i, err)
        if DEVICE == "cpu":  # the interpreter's fp32 dots are exact to 1e-6: the folded blocks did run
            assert err > 20 * (api.decode_attention(*args, **kw) - ref).abs().max().item(), i
        # the values unpacked before they are transposed: the same numbers (on a GPU another path through shared
        # memory to the same dot operands; the interpreter runs the same code, without the PTX, so not there)
        if DEVICE != "cpu":
            out_u = api.decode_attention(*args, fold=True, unpack_first=True, **kw)
            assert (out_u - out).abs().max().item() <= 2**-14 * ref.abs().max().item(), i
        if i == prefetch:  # the queries rotated inside the kernel (small grids), bf16 as a server passes them
            qb = q.bfloat16()
            out_in = api.decode_attention(qb, *args[1:], fold=True, rotate_q_in_kernel=True, **kw)
            ref_b = reference.decode_attention(qb, *args[1:], d**-0.5).float()
            assert (out_in.float() - ref_b).abs().max().item() < 2**-7 * ref_b.abs().max().item(), i


def test_decode_fold_is_ignored_where_it_does_not_apply():
    """Rows in several groups (a scale per group), or ``hot_skip=False``: ``fold`` leaves the kernel as it is."""
    for formats, hot_skip in ((FORMATS[2], True), (FORMATS[0], False)):
        paged, rot, store = build([17, 40], 64, None, 16, True, 3, formats=formats)
        q = torch.randn(2, KV * 2, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
        kw = dict(backend="triton", num_splits=2, block_n=16, hot_skip=hot_skip)
        assert torch.equal(api.decode_attention(*args, fold=True, **kw), api.decode_attention(*args, **kw))
    with pytest.raises(ValueError, match="block_n"):  # where it applies (the last rows: one group), parts of 16 rows
        api.decode_attention(*args, backend="triton", fold=True, block_n=8)


def test_decode_split_count_does_not_change_the_result():
    paged, rot, store = build([3, 70], 64, 64, 16, True, 7)
    q = torch.randn(2, KV * 4, 64, device=DEVICE)
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    outs = [api.decode_attention(*args, backend="triton", num_splits=s, block_n=16) for s in (1, 2, 7)]
    outs.append(api.decode_attention(*args, backend="triton"))  # automatic split count, block_n 64
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], atol=ATOL, rtol=RTOL)


def test_decode_whole_waves_registers_and_report_keep_the_result():
    """The grid options (``max_registers``, ``whole_waves``: the GPU's compiler and residency, nothing on the
    interpreter) and the most splits the whole-wave rule gives (:data:`MAX_WAVE_SPLITS`, most of them empty
    here) compute the same attention; ``report`` says the split count launched."""
    from oscar_sglang.kernels.decode import triton_kernel as dec
    from oscar_sglang.kernels.decode.triton_kernel import MAX_WAVE_SPLITS

    paged, rot, store = build([3, 300], 64, 64, 16, True, 9)
    q = torch.randn(2, KV * 4, 64, device=DEVICE)
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    want = reference.decode_attention(*args, 64**-0.5)
    report = {}
    plain = api.decode_attention(*args, backend="triton", block_n=16, report=report)
    assert report["splits"] >= 2 and ("registers" in report) == (DEVICE == "cuda")
    for kw in ({"num_splits": MAX_WAVE_SPLITS}, {"max_registers": 128}, {"whole_waves": True, "max_seq_len": 300},
               {"resident": 64}, {"fold": True, "num_warps": 2, "max_registers": 96, "whole_waves": True}):
        out = api.decode_attention(*args, backend="triton", block_n=16, **kw)
        if kw.get("fold"):  # fp16 queries and weights, as the fold's own test
            assert (out - want).abs().max().item() < fold_tolerance(args, want)
        else:
            assert torch.allclose(out, want, atol=ATOL, rtol=RTOL), kw
    assert torch.allclose(plain, want, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="max_registers"):
        api.decode_attention(*args, backend="triton", max_registers=300)
    with pytest.raises(ValueError, match="resident"):
        api.decode_attention(*args, backend="triton", resident=0)
    # a given residency sizes the grid as choose_splits says (the CUDA graphs' count follows the same rule)
    sized = {}
    api.decode_attention(*args, backend="triton", resident=3, num_warps=2, report=sized)
    assert sized["splits"] == dec.choose_splits(2, KV, q.device, num_warps=2, resident=3) != report["splits"]


def test_decode_bf16_query_and_empty_request():
    paged, rot, store = build([0, 9, 33], 64, 64, 1, True, 8)
    q = torch.randn(3, KV * 3, 64, device=DEVICE).bfloat16()
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    out = api.decode_attention(*args, backend="triton", num_splits=2, block_n=16)
    ref = reference.decode_attention(*args, 64**-0.5)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no tokens: zero output, no NaN
    assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_strided_half_query_as_sglang_passes_it(dtype):
    # SGLang's q is a column slice of the fused QKV output: rows strided by the QKV width, heads by d.
    # Both rotation paths, the half-precision output written by the reduce (bf16) or cast after it (fp16).
    d, gqa = 128, 4
    paged, rot, store = build([5, 30], d, None, 16, True, 11, formats=(F(2, symmetric=True), F(4, 32)))
    qkv = torch.randn(2, (KV * gqa + 2 * KV) * d, generator=torch.Generator().manual_seed(11)).to(DEVICE, dtype)
    q = qkv[:, :KV * gqa * d].reshape(2, KV * gqa, d)
    assert not q.is_contiguous() and q.stride(-1) == 1
    args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    ref = reference.decode_attention(*args, d**-0.5)
    for in_kernel in (True, False):
        out = api.decode_attention(*args, backend="triton", num_splits=3, block_n=16, rotate_q_in_kernel=in_kernel)
        assert out.dtype == dtype and out.shape == q.shape
        assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=2**-7), (in_kernel, (out - ref).abs().max())


def test_decode_rotates_queries_in_the_kernel_on_small_grids_only(monkeypatch):
    from oscar_sglang.kernels.decode import triton_kernel as dec

    calls = []
    real = dec.rotated_queries
    monkeypatch.setattr(dec, "rotated_queries", lambda q, r: calls.append(q.shape) or real(q, r))
    paged, rot, store = build([9, 33], 64, 64, 1, True, 8)
    limit = dec.ROTATE_IN_KERNEL_WAVES * dec._processors(torch.device(DEVICE))  # programs
    q = torch.randn(2, KV * 2, 64, device=DEVICE)  # grid: 2 requests x KV heads x splits
    for splits, want_torch in ((limit // (2 * KV), False), (limit // (2 * KV) + 1, True)):
        calls.clear()
        api.decode_attention(q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens,
                             backend="triton", num_splits=splits, block_n=16)
        assert bool(calls) == want_torch, (splits, limit, calls)


def test_decode_runs_no_torch_compute_around_its_kernels():
    # Two launches per layer at small batch, three beyond (the queries rotated by their own kernel): no rotation
    # matmul, cast or copy in torch around the kernels (the interpreter's own tensor bookkeeping is not in the
    # list; until 2026-12-05 the larger grids rotated the queries in torch, a cast, a matmul and copies); the
    # torch formula shows that the recorder sees such ops.
    from torch.utils._python_dispatch import TorchDispatchMode

    glue = {"aten.bmm", "aten.mm", "aten.addmm", "aten.baddbmm", "aten._to_copy", "aten.clone", "aten.mul",
            "aten.add"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    paged, rot, store = build([5, 20], 64, None, 16, True, 3)
    q = torch.randn(2, KV * 2, 64, device=DEVICE).bfloat16()
    seen = {}
    for in_kernel in (True, False):
        with Ops() as ops:
            api.decode_attention(q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens,
                                 backend="triton", num_splits=2, rotate_q_in_kernel=in_kernel)
        seen[in_kernel] = ops.seen & glue
    assert seen == {True: set(), False: set()}, seen
    with Ops() as ops:
        rotate_queries(q, rot.q_rot)
    assert {"aten.bmm", "aten._to_copy"} <= ops.seen, ops.seen


@pytest.mark.parametrize("kf,vf", [(F(4), F(2, 32)), (F(8, 16), F(4))], ids=["K4-V2g32", "K8g16-V4"])
def test_reference_on_a_mixed_store_is_attention_over_the_format_rows(kf, vf):
    # Independent of read_rotated and of the store's packing: each side's rows are the format's round trip
    # (fmt.dequantize(fmt.quantize(..., bits=))) of the rotated inputs, hot rows their bf16 copies; plain
    # attention over those in the rotated space, de-rotated, must equal the decode reference.
    from oscar_sglang.rotation import derotate_output, rotate_kv, rotate_queries

    lens, d, gqa = [3, 21, 40], 64, 2
    paged = scenario.paged_layout(lens, 4, 12)
    rot = scenario.random_rotation(KV, d, 12, key_scale=True)
    store = layout.empty_store(paged.num_slots, KV, d, None, sum(lens), k_format=kf, v_format=vf)
    slots = torch.cat([paged.slots(b) for b in range(len(lens))])
    k, v = scenario.random_kv(len(slots), KV, d, 12)
    hot = scenario.assign_hot(store, paged, 2, 3)[slots] >= 0
    api.write_kv(k, v, slots, store, rot, store.hot_index[slots], backend="torch")
    kr, vr = rotate_kv(k, rot.k_rot, rot.k_mean), rotate_kv(v, rot.v_rot)
    kq = fmt.dequantize(fmt.quantize(kr, kf.group, rot.k_clip[:, None], bits=kf.bits))
    vq = fmt.dequantize(fmt.quantize(vr, vf.group, rot.v_clip[:, None], bits=vf.bits))
    kq[hot], vq[hot] = kr[hot].bfloat16().float(), vr[hot].bfloat16().float()
    assert not torch.equal(kq, kr.bfloat16().float())  # some rows are cold
    q = torch.randn(len(lens), KV * gqa, d, generator=torch.Generator().manual_seed(12))
    qr = rotate_queries(q, rot.q_rot)
    want = derotate_output(_dense_per_request(qr, kq, vq, lens, gqa), rot.v_rot)
    out = reference.decode_attention(q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens,
                                     d**-0.5)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5), (out - want).abs().max()


@pytest.mark.parametrize("key_scale", [False, True], ids=["orthogonal", "key-scaled"])
def test_reference_with_every_token_hot_is_plain_attention(key_scale):
    # The rotation conventions end to end: with every row hot (bf16, unquantized),
    # rotated + centred (+ key-scaled, queries inversely) attention and de-rotation give plain attention.
    lens, d, gqa = [5, 12], 64, 2
    paged = scenario.paged_layout(lens, 4, 3)
    rot = scenario.random_rotation(KV, d, 3, key_scale=key_scale)
    store = layout.empty_store(paged.num_slots, KV, d, None, sum(lens))
    slots = torch.cat([paged.slots(b) for b in range(2)])
    k, v = scenario.random_kv(len(slots), KV, d, 3, dtype=torch.float32)
    api.write_kv(k, v, slots, store, rot, scenario.assign_hot(store, paged, 100, 0)[slots])
    q = torch.randn(2, KV * gqa, d)
    out = api.decode_attention(q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    want = _dense_per_request(q, k, v, lens, gqa)
    for b in range(len(lens)):
        assert torch.allclose(out[b], want[b], atol=0.03, rtol=0.02)  # bf16 hot rows


def test_bf16_baseline_kernel_is_plain_attention():
    from oscar_sglang.kernels.decode.bf16_baseline import decode_attention_bf16

    lens, d, gqa = [1, 19, 40], 128, 4
    paged = scenario.paged_layout(lens, 16, 4, device=DEVICE)
    kb, vb = scenario.random_kv(paged.num_slots, KV, d, 4, DEVICE)
    q = torch.randn(3, KV * gqa, d, device=DEVICE)
    out = decode_attention_bf16(q, kb, vb, paged.req_to_token, paged.req_pool_indices, paged.seq_lens, d**-0.5,
                                num_splits=3, block_n=16)
    for b in range(3):
        s = paged.slots(b)
        p = (torch.einsum("hd,thd->ht", q[b], kb[s].float().repeat_interleave(gqa, 1)) * d**-0.5).softmax(-1)
        want = torch.einsum("ht,thd->hd", p, vb[s].float().repeat_interleave(gqa, 1))
        assert torch.allclose(out[b], want, atol=ATOL, rtol=RTOL)


def test_choose_splits_fills_the_device_without_a_host_sync():
    from oscar_sglang.kernels.decode.triton_kernel import MAX_SPLITS, choose_splits

    cpu = torch.device("cpu")
    assert choose_splits(1, 1, cpu) >= 2
    assert choose_splits(64, 8, cpu) == 1
    assert choose_splits(1, 1, cpu, max_seq_len=10) == 1
    assert 1 <= choose_splits(1, 1, cpu) <= MAX_SPLITS
    # programs of 2 warps: twice as many splits, so that about as many warps run per multiprocessor
    assert choose_splits(1, 2, cpu, num_warps=2) == 2 * choose_splits(1, 2, cpu)


def test_grouped_rotation_glue_equals_the_per_head_formula():
    """The one query-rotation / output-de-rotation glue (references and Triton path) against ``q_h @ R[h // g]``."""
    from oscar_sglang import rotation

    rot = scenario.random_rotation(KV, 64, 9)
    q = torch.randn(3, KV * 3, 64, dtype=torch.float64)
    g = rotation.group_index(KV * 3, KV)
    per_head_k = torch.einsum("nhd,hde->nhe", q, rot.k_rot.double()[g])
    per_head_v = torch.einsum("nhe,hde->nhd", q, rot.v_rot.double()[g])
    assert torch.allclose(rotation.rotate_queries(q, rot.k_rot), per_head_k, atol=1e-12)
    assert torch.allclose(rotation.derotate_output(q, rot.v_rot), per_head_v, atol=1e-12)
    assert rotation.rotate_queries(q.float(), rot.k_rot).dtype == torch.float32
    with pytest.raises(ValueError, match="cannot be grouped"):
        rotation.rotate_queries(torch.randn(2, 5, 64), rot.k_rot)


def _dense_per_request(q, k, v, lens, gqa):
    """Plain softmax attention of each request's query ``q[b] [q_heads, d]`` over its rows of ``k, v``
    (requests' rows back to back, ``[tokens, kv_heads, d]``), query head ``h`` on KV head ``h // gqa``."""
    out, first = torch.zeros(q.shape, dtype=torch.float32, device=q.device), 0
    for b, n in enumerate(lens):
        kb = k[first:first + n].float().repeat_interleave(gqa, 1)
        vb = v[first:first + n].float().repeat_interleave(gqa, 1)
        first += n
        p = (torch.einsum("hd,thd->ht", q[b].float(), kb) * q.shape[-1] ** -0.5).softmax(-1)
        out[b] = torch.einsum("ht,thd->hd", p, vb)
    return out
