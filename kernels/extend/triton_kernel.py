"""Extend (prefill) attention: new tokens over a cached prefix read from the store, plus causal new-vs-new.

Grid ``(cdiv(max_extend_len, BLOCK_M), batch, kv_heads)`` (token blocks on the
axis without the 65535 limit).  A program holds
``BLOCK_M`` new tokens times the query heads of one KV head (``BLOCK_M * GQP``
rows, ``GQP`` = group padded to a power of two), reads the prefix straight
from the quantized/hot store (never materialised; keys and values each in
their format, constexprs ``K_BITS``/``K_G``, ``V_BITS``/``V_G``), then the new tokens' exact
rotated rows with a causal mask, in one online softmax: the same result as
merging the two parts by log-sum-exp.  Everything is in the rotated, centred
space; queries are rotated before and the output de-rotated after, in torch.

Split along the prefix (split-K, as decode): when few new tokens meet a long
cached prefix (chunked prefill of a short chunk over 100k cached tokens), the
grid above has too few programs to fill a GPU. Then the third grid axis is
``kv_heads x splits``: split ``s`` reads its share of the prefix, the last
split also the new tokens, each writes a normalised partial output and its
log-sum-exp, and decode's reduce kernel merges them per (token, query head).
"""

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from oscar_sglang.rotation import derotate_output, rotate_kv, rotate_queries

from ..common.triton_helpers import attend_block, attend_stored_block, load_row_pieces, store_pieces
from ..decode.triton_kernel import LOG2E, MAX_SPLITS, _processors, merge_splits
from ..layout import DeviceRotation, LayerStore, require_contiguous, triton_unsupported

# The dots' operands. Prefill attention is compute-bound (every new token
# against the whole prefix), unlike decode, which reads the cache once and
# keeps TF32: as in flash attention and SGLang's own Triton extend, queries,
# keys, softmax weights and values enter the dots as bf16 with fp32
# accumulation, twice the tensor-core rate of TF32 on sm_80/sm_90. The
# rounding (2^-9 relative per operand) is far below the INT2 rows' own error
# and what a BF16 cache holds anyway; the kernel tests bound it against the
# fp32 reference. "tf32" keeps fp32 operands (the benchmark times both).
DOT_CHOICES = ("bf16", "tf32")
DOTS = "bf16"


@triton.jit
def _extend_kernel(q_ptr, kn_ptr, vn_ptr, out_ptr,
                   k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_hot, v_hot, hot_index,
                   req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start,
                   mid_lse, stride_r2t, KV, Q_HEADS, NUM_SPLITS, qk_scale,
                   GQ: tl.constexpr, GQP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   D: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, V_BITS: tl.constexpr,
                   V_G: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr, K_SYM: tl.constexpr,
                   V_SYM: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    sp = tl.program_id(2) % NUM_SPLITS
    ext_len = tl.load(extend_lens + b).to(tl.int32)
    if m0 >= ext_len:
        return
    prefix = tl.load(prefix_lens + b).to(tl.int32)
    first = tl.load(extend_start + b).to(tl.int64)
    req = tl.load(req_pool_indices + b).to(tl.int64)

    r = tl.arange(0, BLOCK_M * GQP)
    tok = m0 + r // GQP
    hh = r % GQP
    rmask = (tok < ext_len) & (hh < GQ)
    qrow = (first + tok) * Q_HEADS + kvh * GQ + hh  # row of q' and of the output
    q0, q1, q2, q3 = load_row_pieces(q_ptr + qrow * D, rmask, D)
    if PREC == "bf16":  # rounded once here, not in every block's dots
        q0, q1, q2, q3 = q0.to(tl.bfloat16), q1.to(tl.bfloat16), q2.to(tl.bfloat16), q3.to(tl.bfloat16)
    m = tl.full([BLOCK_M * GQP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * GQP], tl.float32)
    a0 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)
    a1 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)
    a2 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)
    a3 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)

    # Cached prefix, from the store: every new token sees all of it (this split: its share).
    per_split = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
    p_lo = sp * per_split
    p_hi = tl.minimum(p_lo + per_split, prefix)
    for n0 in range(p_lo, p_hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < p_hi
        m, l, a0, a1, a2, a3 = attend_stored_block(
            t, tmask, req_to_token + req * stride_r2t, hot_index, kvh, KV,
            k_codes, k_scale, k_zero, k_hot, v_codes, v_scale, v_zero, v_hot,
            q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3, D, K_BITS, K_G, V_BITS, V_G, PREC, K_SYM, V_SYM,
            False)

    # New tokens, exact, causal among themselves (in the last split).
    hi = tl.where(sp == NUM_SPLITS - 1, tl.minimum(ext_len, m0 + BLOCK_M), 0)
    for n0 in range(0, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        nrow = (first + t) * KV + kvh
        k0, k1, k2, k3 = load_row_pieces(kn_ptr + nrow * D, tmask, D)
        v0, v1, v2, v3 = load_row_pieces(vn_ptr + nrow * D, tmask, D)
        valid = tmask[None, :] & (t[None, :] <= tok[:, None])
        m, l, a0, a1, a2, a3 = attend_block(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3,
                                            valid, qk_scale, m, l, a0, a1, a2, a3, PREC)

    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)[:, None]
    if SPLIT:  # partial output and its log2-sum-exp, rows [token, query head, split] as decode's reduce reads them
        part = qrow.to(tl.int64) * NUM_SPLITS + sp
        store_pieces(out_ptr + part * D, rmask, a0 * inv_l, a1 * inv_l, a2 * inv_l, a3 * inv_l, D)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(mid_lse + part, lse, mask=rmask)
    else:
        store_pieces(out_ptr + qrow * D, rmask, a0 * inv_l, a1 * inv_l, a2 * inv_l, a3 * inv_l, D)


def choose_prefix_splits(new_token_blocks: int, batch: int, kv_heads: int, device: torch.device,
                         max_prefix_len: int | None, block_n: int) -> int:
    """Prefix splits so that about 2 programs run per multiprocessor; 1 without a host-known longest prefix."""
    if not max_prefix_len:
        return 1
    s = triton.cdiv(2 * _processors(device), max(1, new_token_blocks * batch * kv_heads))
    return max(1, min(MAX_SPLITS, s, triton.cdiv(max_prefix_len, 2 * block_n)))


# The launches (device, constexprs and options) whose pipelined staging did not fit their GPU's shared memory:
# launched with one stage since (launch_fitting), without trying two stages again.
_ONE_STAGE: set = set()


def launch_fitting(kernel, grid, device: torch.device, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``, or with ``num_stages=1`` where the GPU's shared memory cannot hold the
    compiled kernel's pipeline stages.

    With TF32 dots at d 128 the extend kernel's two stages take 98-101.5 KiB of shared memory on sm_80/86/89
    (``compile_check``; 64-96 KiB on sm_90), over sm_86/89's 99 KiB (A10, L4, L40S, RTX 30/40): Triton
    refuses such a launch (``OutOfResources``) before the kernel runs, so nothing was written; one stage
    (96 KiB) fits. Remembered per device and launch, so the refusal is paid once.
    """
    key = lambda: (str(device), tuple(sorted(kwargs.items())))  # noqa: E731  (made only where a GPU refused one)
    if _ONE_STAGE and key() in _ONE_STAGE:
        kwargs = {**kwargs, "num_stages": 1}
    try:
        kernel[grid](*args, **kwargs)
    except OutOfResources as e:
        if e.name != "shared memory" or kwargs.get("num_stages", 1) <= 1:
            raise
        _ONE_STAGE.add(key())
        kernel[grid](*args, **{**kwargs, "num_stages": 1})


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, rot: DeviceRotation,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float, extend_start_loc: torch.Tensor | None = None,
                     max_extend_len: int | None = None, max_prefix_len: int | None = None,
                     num_splits: int | None = None, block_rows: int = 64, block_n: int = 32,
                     num_warps: int = 8, num_stages: int = 2, dots: str = DOTS) -> torch.Tensor:
    """Triton version of :func:`oscar_sglang.kernels.extend.reference.extend_attention`.

    ``block_rows`` = new tokens times padded group per program (at least 16).
    ``num_splits`` splits the cached prefix (default: chosen from the grid size and
    ``max_prefix_len``, the longest prefix as the host knows it; 1 without it).
    ``dots``: ``"bf16"`` (operands rounded to bf16, fp32 accumulation) or
    ``"tf32"`` (fp32 operands on TF32 tensor cores); see :data:`DOTS`.
    """
    if dots not in DOT_CHOICES:
        raise ValueError(f"dots must be one of {DOT_CHOICES}, got {dots!r}")
    n, q_heads, d = q.shape
    kv, kf, vf = store.kv_heads, store.k_format, store.v_format
    gq = q_heads // kv
    assert (problem := triton_unsupported(d, kf, vf)) is None, problem
    assert req_to_token.stride(1) == 1, "req_to_token rows must be contiguous"
    if n == 0:
        return torch.zeros_like(q)
    require_contiguous(store, rot)
    gqp = triton.next_power_of_2(gq)
    block_m = max(1, triton.next_power_of_2(max(block_rows, 16)) // gqp)
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, 0) - extend_lens
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    if max_extend_len == 0:
        return torch.zeros_like(q)
    qr = rotate_queries(q, rot.q_rot).contiguous()
    kn = rotate_kv(k.reshape(n, kv, d), rot.k_rot, rot.k_mean).contiguous()
    vn = rotate_kv(v.reshape(n, kv, d), rot.v_rot).contiguous()
    blocks, batch = triton.cdiv(max_extend_len, block_m), extend_lens.shape[0]
    splits = num_splits or choose_prefix_splits(blocks, batch, kv, q.device, max_prefix_len, block_n)
    if splits > 1:
        out = torch.empty(n, q_heads, splits, d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(n, q_heads, splits, dtype=torch.float32, device=q.device)
    else:
        out = torch.zeros(n, q_heads, d, dtype=torch.float32, device=q.device)
        mid_lse = out  # unused
    launch_fitting(_extend_kernel, (blocks, batch, kv * splits), q.device, (
        qr, kn, vn, out, *store.row_args(),
        store.k_hot, store.v_hot, store.hot_index, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start_loc, mid_lse, req_to_token.stride(0), kv, q_heads, splits, sm_scale * LOG2E,
    ), dict(
        GQ=gq, GQP=gqp, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
        K_BITS=kf.bits, K_G=kf.group, V_BITS=vf.bits, V_G=vf.group, PREC=dots,
        K_SYM=kf.symmetric, V_SYM=vf.symmetric, SPLIT=splits > 1,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True,
    ))
    if splits > 1:
        return merge_splits(out, mid_lse, rot.v_rot, q.dtype)  # merged, de-rotated and cast in one launch
    return derotate_output(out, rot.v_rot).to(q.dtype)
