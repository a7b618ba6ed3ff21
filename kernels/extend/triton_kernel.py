"""Extend (prefill) attention: new tokens over a cached prefix read from the store, plus causal new-vs-new.

Grid ``(cdiv(max_extend_len, BLOCK_M), batch, kv_heads)`` (token blocks on the
axis without the 65535 limit).  A program holds
``BLOCK_M`` new tokens times the query heads of one KV head (``BLOCK_M * GQP``
rows, ``GQP`` = group padded to a power of two), reads the prefix straight
from the INT2/hot store (never materialised), then the new tokens' exact
rotated rows with a causal mask, in one online softmax: the same result as
merging the two parts by log-sum-exp.  Everything is in the rotated, centred
space; queries are rotated before and the output de-rotated after, in torch.
"""

import torch
import triton
import triton.language as tl

from oscar_sglang.rotation import rotate_kv

from ..common.rotate import derotate_output, rotate_queries
from ..common.triton_helpers import attend_block, attend_stored_block, load_query_pieces, store_pieces
from ..decode.triton_kernel import DOT_PRECISION, LOG2E
from ..layout import LayerRotation, LayerStore, require_contiguous, triton_unsupported


@triton.jit
def _extend_kernel(q_ptr, kn_ptr, vn_ptr, out_ptr,
                   k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_hot, v_hot, hot_index,
                   req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start,
                   stride_r2t, KV, Q_HEADS, qk_scale,
                   GQ: tl.constexpr, GQP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   D: tl.constexpr, G: tl.constexpr, PREC: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    kvh = tl.program_id(2)
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
    q0, q1, q2, q3 = load_query_pieces(q_ptr + qrow * D, rmask, D)
    m = tl.full([BLOCK_M * GQP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * GQP], tl.float32)
    a0 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)
    a1 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)
    a2 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)
    a3 = tl.zeros([BLOCK_M * GQP, D // 4], tl.float32)

    # Cached prefix, from the store: every new token sees all of it.
    for n0 in range(0, prefix, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < prefix
        m, l, a0, a1, a2, a3 = attend_stored_block(
            t, tmask, req_to_token + req * stride_r2t, hot_index, kvh, KV,
            k_codes, k_scale, k_zero, k_hot, v_codes, v_scale, v_zero, v_hot,
            q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3, D, G, PREC)

    # New tokens, exact, causal among themselves.
    hi = tl.minimum(ext_len, m0 + BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        nrow = (first + t) * KV + kvh
        k0, k1, k2, k3 = load_query_pieces(kn_ptr + nrow * D, tmask, D)
        v0, v1, v2, v3 = load_query_pieces(vn_ptr + nrow * D, tmask, D)
        valid = tmask[None, :] & (t[None, :] <= tok[:, None])
        m, l, a0, a1, a2, a3 = attend_block(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3,
                                            valid, qk_scale, m, l, a0, a1, a2, a3, PREC)

    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)[:, None]
    store_pieces(out_ptr + qrow * D, rmask, a0 * inv_l, a1 * inv_l, a2 * inv_l, a3 * inv_l, D)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, rot: LayerRotation,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float, extend_start_loc: torch.Tensor | None = None,
                     max_extend_len: int | None = None, block_rows: int = 64, block_n: int = 32,
                     num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """Triton version of :func:`oscar_sglang.kernels.extend.reference.extend_attention`.

    ``block_rows`` = new tokens times padded group per program (at least 16).
    """
    n, q_heads, d = q.shape
    kv, g = store.kv_heads, store.group_size
    gq = q_heads // kv
    assert (problem := triton_unsupported(d)) is None, problem
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
    qr = rotate_queries(q, rot.k_rot).contiguous()
    kn = rotate_kv(k.reshape(n, kv, d), rot.k_rot, rot.k_mean).contiguous()
    vn = rotate_kv(v.reshape(n, kv, d), rot.v_rot).contiguous()
    out = torch.zeros(n, q_heads, d, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(max_extend_len, block_m), extend_lens.shape[0], kv)
    _extend_kernel[grid](
        qr, kn, vn, out, store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero,
        store.k_hot, store.v_hot, store.hot_index, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start_loc, req_to_token.stride(0), kv, q_heads, sm_scale * LOG2E,
        GQ=gq, GQP=gqp, BLOCK_M=block_m, BLOCK_N=block_n, D=d, G=g, PREC=DOT_PRECISION,
        num_warps=num_warps, num_stages=num_stages,
    )
    return derotate_output(out, rot.v_rot).to(q.dtype)
