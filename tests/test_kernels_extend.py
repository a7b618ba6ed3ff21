"""Extend kernel (Triton, under the interpreter on CPU) against the plain-torch reference.

Tolerance: |o - o_ref| <= 1e-4 + 1e-4 |o_ref| with fp32 inputs on CPU (1e-2 on a GPU: TF32 dots) (fp32 dots in
the interpreter), with the kernel's dots on fp32 operands (``dots="tf32"``);
the default bf16 operands (every query, key, softmax weight and value rounded
to bf16, as in any BF16 attention) are held to BF16_ATOL/BF16_RTOL on every
case: these keys have a large mean and spread (|k| up to 13), so bf16 moves
their logits by up to ~1e-2 and outputs of magnitude up to 5 by up to 0.05
(mean 0.002); the indexing and masking those cases share with the fp32 runs is
held to the tight bound there (``test_bf16_dots_err_like_bf16_rounding_of_the_operands``
bounds the bf16 error from both sides).
The reference itself is checked against plain causal
attention (no prefix: everything exact) and against decode.

Key and value formats of the cached prefix rotate through the cases as in
the decode tests (INT2 with groups d, 64, 32, and the mixed pairs), each with
both head sizes; the split-K cases use mixed formats.  Under the interpreter the default run takes a
covering subset of the main grid (every pair of head size, GQA, page size and hot entries; every format:
``tests/case_grid.py``); a GPU, and ``--slow``, every case.
"""

import itertools
import os
import subprocess
import sys

import case_grid
import pytest
import torch
from kernel_device import DEVICE

from oscar_sglang import format as fmt
from oscar_sglang.kernels import api, layout, scenario
from oscar_sglang.kernels.extend import reference

KV = 2
ATOL = RTOL = 1e-4 if DEVICE == "cpu" else 1e-2  # the GPU's dots are TF32
BF16_ATOL, BF16_RTOL = 6e-2, 2**-6  # bf16 dot operands (the default)


F = fmt.RowFormat
# (keys, values) per case, rotating; groups None = d
FORMATS = [(F(2), F(2)), (F(2, 64), F(2, 64)), (F(2, 32), F(2, 32)),
           (F(4), F(2)), (F(2, 16), F(4, 32)), (F(8), F(8)), (F(8), F(2, 32)),
           (F(2, symmetric=True), F(2)), (F(4, symmetric=True), F(2, 32, True))]  # symmetric rows


def build(prefix, extend, d, group, page, hot, seed, sink=2, recent=4, formats=None):
    """Prefixes already in the store (sink/recent hot), plus the new tokens' q, k, v.

    ``formats``: (keys, values) RowFormats; default INT2 in groups of ``group`` on both sides.
    """
    kf, vf = formats or (F(2, group), F(2, group))
    lens = [p + e for p, e in zip(prefix, extend)]
    paged = scenario.paged_layout(lens, page, seed, device=DEVICE)
    rot = scenario.random_rotation(KV, d, seed, device=DEVICE, key_scale=bool(seed % 2))  # odd seeds: key scales
    store = layout.empty_store(paged.num_slots, KV, d, None, sum(lens), DEVICE, k_format=kf, v_format=vf)
    slots = torch.cat([paged.slots(b)[:p] for b, p in enumerate(prefix)])
    k, v = scenario.random_kv(len(slots), KV, d, seed, DEVICE)
    hot_loc = scenario.assign_hot(store, paged, sink, recent)[slots] if hot else None
    api.write_kv(k, v, slots, store, rot, hot_loc, backend="torch")
    return paged, rot, store


def new_tokens(n, q_heads, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, q_heads, d, generator=g)
    k, v = scenario.random_kv(n, KV, d, seed + 1, dtype=dtype)
    return q.to(DEVICE, dtype), k.to(DEVICE), v.to(DEVICE)


PREFIX = [0, 1, 15, 17, 33]
EXTEND = [17, 2, 1, 16, 5]  # across BLOCK_M (16 rows / padded group) and BLOCK_N=16
# Full product of d, GQA ratio, page size and hot entries; formats rotate through FORMATS.
CASES = [(d, gqa, page, hot, FORMATS[i % len(FORMATS)])
         for i, (d, gqa, page, hot) in enumerate(itertools.product((64, 128), (1, 3, 8), (1, 16), (True, False)))]
# under the interpreter by default: every pair of d, GQA, page size and hot entries, and every format
FAST = case_grid.covering_subset(CASES, pairs=(0, 1, 2, 3), singles=(4,))


def _case_id(c):
    d, gqa, page, hot, (kf, vf) = c
    return f"d{d}-gqa{gqa}-page{page}-{'hot' if hot else 'cold'}-K{kf.name(d)}-V{vf.name(d)}"


def tolerance(dots):
    return (ATOL, RTOL) if dots == "tf32" else (BF16_ATOL, BF16_RTOL)


@pytest.mark.parametrize("dots", ["tf32", "bf16"])
@pytest.mark.parametrize("d,gqa,page,hot,formats", case_grid.params(CASES, FAST, _case_id))
def test_extend_kernel_matches_reference(d, gqa, page, hot, formats, dots):
    seed = d + gqa + page
    paged, rot, store = build(PREFIX, EXTEND, d, None, page, hot, seed, formats=formats)
    q, k, v = new_tokens(sum(EXTEND), KV * gqa, d, seed)
    pre, ext = torch.tensor(PREFIX, device=DEVICE), torch.tensor(EXTEND, device=DEVICE)
    args = (q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices, pre, ext)
    ref = reference.extend_attention(*args, d**-0.5)
    out = api.extend_attention(*args, backend="triton", block_rows=16, block_n=16, dots=dots)
    atol, rtol = tolerance(dots)
    assert not torch.isnan(out).any()
    assert torch.allclose(out, ref, atol=atol, rtol=rtol), (out - ref).abs().max()


# Split along the prefix (split-K): prefixes that cross split and block boundaries (BLOCK_N = 16), empty
# splits (a prefix shorter than the split count), no prefix, and new-token blocks beside the splits.
SPLIT_PREFIX = [0, 1, 16, 17, 47, 95, 130]
SPLIT_EXTEND = [3, 1, 2, 17, 1, 5, 4]


SPLIT_FORMATS = [(F(2), F(2)), (F(4), F(2)), (F(8), F(2, 32))]
SPLIT_CASES = [(splits, d, gqa, hot, SPLIT_FORMATS[(i + j) % 3])  # formats rotate: each with both d
               for i, splits in enumerate((2, 3, 7))
               for j, (d, gqa, hot) in enumerate([(64, 4, True), (128, 1, False)])]


@pytest.mark.parametrize("dots", ["tf32", "bf16"])
@pytest.mark.parametrize("splits,d,gqa,hot,formats", SPLIT_CASES,
                         ids=[f"s{c[0]}-d{c[1]}-K{c[4][0].name(c[1])}-V{c[4][1].name(c[1])}" for c in SPLIT_CASES])
def test_extend_split_along_the_prefix_matches_reference(splits, d, gqa, hot, formats, dots):
    seed = 100 + splits + d
    paged, rot, store = build(SPLIT_PREFIX, SPLIT_EXTEND, d, None, 16, hot, seed, formats=formats)
    q, k, v = new_tokens(sum(SPLIT_EXTEND), KV * gqa, d, seed)
    pre, ext = torch.tensor(SPLIT_PREFIX, device=DEVICE), torch.tensor(SPLIT_EXTEND, device=DEVICE)
    args = (q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices, pre, ext)
    ref = reference.extend_attention(*args, d**-0.5)
    out = api.extend_attention(*args, backend="triton", block_rows=16, block_n=16, num_splits=splits, dots=dots)
    atol, rtol = tolerance(dots)
    assert not torch.isnan(out).any()
    assert torch.allclose(out, ref, atol=atol, rtol=rtol), (out - ref).abs().max()


def test_prefix_splits_are_chosen_from_the_host_known_longest_prefix():
    from oscar_sglang.kernels.extend.triton_kernel import choose_prefix_splits

    cpu = torch.device("cpu")  # counts as 4 multiprocessors
    assert choose_prefix_splits(1, 1, 2, cpu, None, 32) == 1  # no host-known prefix: never split
    assert choose_prefix_splits(1, 1, 2, cpu, 100_000, 32) == 4  # 8 programs wanted over 2
    assert choose_prefix_splits(1, 1, 1, cpu, 64, 32) == 1  # a short prefix is not worth splitting
    assert choose_prefix_splits(64, 4, 8, cpu, 100_000, 32) == 1  # the grid is already full


def test_extend_with_default_blocks_and_bf16_inputs():
    prefix, extend, d = [70, 0], [3, 40], 128
    paged, rot, store = build(prefix, extend, d, d, 16, True, 11)
    q, k, v = new_tokens(sum(extend), KV * 4, d, 11, torch.bfloat16)
    pre, ext = torch.tensor(prefix, device=DEVICE), torch.tensor(extend, device=DEVICE)
    args = (q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices, pre, ext)
    out = api.extend_attention(*args, backend="triton", max_extend_len=40)  # default dots: bf16
    ref = reference.extend_attention(*args, d**-0.5)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    assert torch.allclose(out.float(), ref.float(), atol=BF16_ATOL, rtol=BF16_RTOL)


def test_a_launch_refused_for_shared_memory_runs_with_one_stage_and_is_remembered(monkeypatch):
    """A GPU whose shared memory cannot hold two pipeline stages (TF32 dots at d 128 on sm_86/89: 101.5 KiB of
    99, ``test_kernels_compile.py``): Triton refuses the launch before the kernel runs, and the wrapper launches
    one stage instead, once per launch shape; the result is the reference's. Stood in for here by refusing
    launches as Triton's loader does."""
    from triton.runtime.errors import OutOfResources

    from oscar_sglang.kernels.extend import triton_kernel as tk

    real, stages = tk._extend_kernel, []

    def gpu(refuses):  # a kernel whose launches are refused where ``refuses(num_stages)`` names a resource
        class Refusing:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    stages.append(kwargs["num_stages"])
                    if resource := refuses(kwargs["num_stages"]):
                        raise OutOfResources(101504, 101376, resource)
                    return real[grid](*args, **kwargs)
                return launch
        return Refusing()

    monkeypatch.setattr(tk, "_ONE_STAGE", set())
    prefix, extend, d = [20, 0], [3, 9], 128
    paged, rot, store = build(prefix, extend, d, None, 16, True, 12, formats=(F(4), F(2)))
    q, k, v = new_tokens(sum(extend), KV * 4, d, 12)
    pre, ext = torch.tensor(prefix, device=DEVICE), torch.tensor(extend, device=DEVICE)
    args = (q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices, pre, ext)
    ref = reference.extend_attention(*args, d**-0.5)
    run = lambda: api.extend_attention(*args, backend="triton", block_rows=16, block_n=16, dots="tf32")  # noqa: E731

    monkeypatch.setattr(tk, "_extend_kernel", gpu(lambda n: "shared memory" if n > 1 else None))
    for _ in range(2):
        out = run()
        assert torch.allclose(out, ref, atol=ATOL, rtol=RTOL), (out - ref).abs().max()
    assert stages == [2, 1, 1]                # refused once, then one stage straight away
    tk._ONE_STAGE.clear(), stages.clear()
    monkeypatch.setattr(tk, "_extend_kernel", gpu(lambda n: "shared memory"))
    with pytest.raises(OutOfResources, match="shared memory"):  # what one stage cannot cure is the caller's
        run()
    assert stages == [2, 1]
    tk._ONE_STAGE.clear(), stages.clear()
    monkeypatch.setattr(tk, "_extend_kernel", gpu(lambda n: "threads"))
    with pytest.raises(OutOfResources, match="threads"):        # another resource: no retry
        run()
    assert stages == [2]


@pytest.mark.parametrize("key_scale", [False, True], ids=["orthogonal", "key-scaled"])
def test_reference_without_prefix_is_plain_causal_attention(key_scale):
    # exact rows only: the rotation (and the key scaling with its inverse on the queries) must cancel
    n, d, gqa = 9, 64, 3
    rot = scenario.random_rotation(KV, d, 5, key_scale=key_scale)
    store = layout.empty_store(4, KV, d)
    q, k, v = (t.cpu() for t in new_tokens(n, KV * gqa, d, 5))      # the reference's math, on CPU everywhere
    out = api.extend_attention(q, k, v, store, rot, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]),
                               torch.tensor([0]), torch.tensor([n]), backend="torch")
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.float().repeat_interleave(gqa, 1).transpose(0, 1),
        v.float().repeat_interleave(gqa, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-4)


def test_extend_of_one_token_agrees_with_decode_after_writing_it():
    # The new token read exactly (extend) or from its hot BF16 copy (decode): equal to bf16 rounding.
    prefix, d, gqa = [20, 7], 64, 2
    paged, rot, store = build(prefix, [1, 1], d, d, 1, True, 6, sink=2, recent=3)
    q, k, v = new_tokens(2, KV * gqa, d, 6)
    pre, ext = torch.tensor(prefix, device=DEVICE), torch.tensor([1, 1], device=DEVICE)
    ext_out = api.extend_attention(q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices, pre, ext)
    new_slots = torch.stack([paged.slots(b)[-1] for b in range(2)])
    api.write_kv(k, v, new_slots, store, rot, store.hot_index[new_slots])
    dec = api.decode_attention(q, store, rot, paged.req_to_token, paged.req_pool_indices, pre + 1)
    assert torch.allclose(ext_out, dec, atol=2e-2, rtol=2e-2)


def test_cpu_dispatch_never_imports_triton():
    code = ("import sys, torch; from oscar_sglang.kernels import api, scenario, layout;"
            "r = scenario.random_rotation(1, 64); s = layout.empty_store(4, 1, 64);"
            "k, v = scenario.random_kv(2, 1, 64); api.write_kv(k, v, torch.tensor([1, 2]), s, r);"
            "t = torch.tensor([[1, 2, 3, 0]]); q = torch.randn(1, 1, 64); i = torch.tensor;"
            "[api.extend_attention(q, k[:1], v[:1], s, r, t, i([0]), i([2]), i([1]), backend=b)"
            " for b in ('auto', 'sdpa')];"
            "print('triton' in sys.modules)")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


# The SDPA path (extend/sdpa.py; a server's OSCAR_SGLANG_EXTEND_KERNEL=sdpa): the reference's numerics with q's
# dtype as the operands; a request without new tokens, and the requests' rows laid out in reverse order.
SDPA_PREFIX = [0, 5, 17, 33, 64]
SDPA_EXTEND = [9, 0, 16, 1, 40]
SDPA_CASES = [(64, 1, 16, True, FORMATS[0]), (128, 4, 1, True, FORMATS[3]), (64, 3, 16, False, FORMATS[6]),
              (128, 8, 16, True, FORMATS[7])]


def _sdpa_case(d, gqa, page, hot, formats, dtype):
    seed = 200 + d + gqa
    paged, rot, store = build(SDPA_PREFIX, SDPA_EXTEND, d, None, page, hot, seed, formats=formats)
    q, k, v = new_tokens(sum(SDPA_EXTEND), KV * gqa, d, seed, dtype)
    ext = torch.tensor(SDPA_EXTEND, device=DEVICE)
    start = sum(SDPA_EXTEND) - torch.cumsum(ext, 0)  # the last request's rows first
    return (q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices,
            torch.tensor(SDPA_PREFIX, device=DEVICE), ext, d**-0.5, start)


@pytest.mark.parametrize("read", ["triton", "torch"])
@pytest.mark.parametrize("kv", ["expanded", "gqa"])
@pytest.mark.parametrize("mask", ["causal-bias", "booleans"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,gqa,page,hot,formats", SDPA_CASES, ids=[_case_id(c) for c in SDPA_CASES])
def test_sdpa_path_matches_reference(monkeypatch, d, gqa, page, hot, formats, dtype, mask, kv, read):
    from oscar_sglang.kernels.extend import sdpa

    monkeypatch.setattr(sdpa, "CAUSAL_BIAS", mask == "causal-bias")  # the GPU's mask / the CPU's
    monkeypatch.setattr(sdpa, "GQA_NATIVE", kv == "gqa")  # KV heads as they are (flash on a GPU) / expanded
    monkeypatch.setattr(sdpa, "READ_BACKEND", read)  # the prefix read by the read kernel / in torch
    args = _sdpa_case(d, gqa, page, hot, formats, dtype)
    ref = reference.extend_attention(*args)
    out = api.extend_attention(*args, backend="sdpa", max_extend_len=40, block_rows=16)  # Triton tuning: ignored
    atol, rtol = tolerance("tf32" if dtype == torch.float32 else "bf16")
    assert out.dtype == dtype and out.shape == ref.shape and not torch.isnan(out).any()
    assert torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol), (out.float() - ref.float()).abs().max()


def test_sdpa_path_reads_with_the_triton_kernel_only_where_the_triton_kernels_take_the_store(monkeypatch):
    from oscar_sglang.kernels.extend import sdpa

    def store(d, kf=F(2), vf=F(2)):
        return layout.empty_store(4, KV, d, None, 1, "cpu", k_format=kf, v_format=vf)

    assert sdpa.read_backend(store(128), "cuda") == sdpa.read_backend(store(64, F(4), F(2, 32)), "cuda") == "triton"
    assert sdpa.read_backend(store(96), "cuda") == "torch"          # head_dim the Triton kernels refuse
    assert sdpa.read_backend(store(32), "cuda") == "torch"
    assert sdpa.read_backend(store(128), "cpu") == "torch"          # a CPU server: the torch reference
    monkeypatch.setattr(sdpa, "READ_BACKEND", "triton")             # tests: the kernel under the interpreter
    assert sdpa.read_backend(store(128), "cpu") == "triton"


@pytest.mark.skipif(DEVICE == "cpu", reason="flash attention needs CUDA")
@pytest.mark.parametrize("kv", ["torch-decides", "expanded", "gqa"])
def test_sdpa_path_runs_on_flash_attention_on_a_gpu(monkeypatch, kv):
    # With only the flash backend allowed, a bf16 prefill over a prefix (GQA 4:1) either runs on it or raises:
    # with the KV heads expanded, as they are (enable_gqa), and as the server runs it (torch's check decides).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from oscar_sglang.kernels.extend import sdpa

    monkeypatch.setattr(sdpa, "GQA_NATIVE", {"torch-decides": None, "expanded": False, "gqa": True}[kv])
    args = _sdpa_case(128, 4, 16, True, FORMATS[0], torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = api.extend_attention(*args, backend="sdpa")
    ref = reference.extend_attention(*args)
    assert torch.allclose(out.float(), ref.float(), atol=BF16_ATOL, rtol=BF16_RTOL)


def test_gqa_check_hands_torch_the_call_as_it_is_made():
    # flash_takes_gqa asks torch only on CUDA; what it asks is built here on any device, so a torch whose
    # SDPAParams take other arguments (the GPU run's 2.11 in the dry run, CI's) fails here, not mid-prefill there.
    from oscar_sglang.kernels.extend import sdpa

    q, k, v = torch.zeros(1, 8, 5, 64), torch.ones(1, 2, 9, 64), torch.full((1, 2, 9, 64), 2.0)
    p = sdpa.gqa_params(q, k, v)
    assert (p.query.shape, p.key.shape, p.value.shape) == (q.shape, k.shape, v.shape)
    assert p.key.eq(1).all() and p.value.eq(2).all()
    assert p.attn_mask is None and p.dropout == 0.0 and p.is_causal is False and p.enable_gqa is True
    assert sdpa.flash_takes_gqa(q, k, v) is False  # tensors off CUDA: expanded, torch not asked


def test_bf16_dots_err_like_bf16_rounding_of_the_operands():
    # The dots choice is honoured: bf16 operands err visibly more than fp32 / TF32 ones (8 vs 10+ mantissa
    # bits), by about what bf16 rounding of the operands makes (2^-9 relative each): neither nothing nor more.
    prefix, extend, d = [150, 40], [20, 33], 128
    paged, rot, store = build(prefix, extend, d, None, 16, True, 21, sink=4, recent=8)
    q, k, v = new_tokens(sum(extend), KV * 4, d, 21)
    pre, ext = torch.tensor(prefix, device=DEVICE), torch.tensor(extend, device=DEVICE)
    args = (q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices, pre, ext)
    ref = reference.extend_attention(*args, d**-0.5)
    diff = {dots: (api.extend_attention(*args, backend="triton", dots=dots) - ref).abs() for dots in ("tf32", "bf16")}
    err = {dots: e.max().item() for dots, e in diff.items()}
    assert err["bf16"] > 1.5 * err["tf32"], err
    assert 2**-12 < err["bf16"] / ref.abs().max().item() < 2**-5, err
    assert diff["bf16"].mean() < 2**-6 * ref.abs().mean(), (diff["bf16"].mean(), ref.abs().mean())


def test_unknown_dots_are_refused():
    paged, rot, store = build([3], [2], 64, None, 1, False, 1)
    q, k, v = new_tokens(2, KV, 64, 1)
    with pytest.raises(ValueError, match="dots must be one of"):
        api.extend_attention(q, k, v, store, rot, paged.req_to_token, paged.req_pool_indices,
                             torch.tensor([3], device=DEVICE), torch.tensor([2], device=DEVICE),
                             backend="triton", dots="fp16")
