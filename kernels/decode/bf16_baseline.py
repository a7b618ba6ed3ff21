"""BF16 split-K decode over the same paged layout: the benchmark's baseline, not used in serving.

``k_buf, v_buf bf16 [num_slots, kv_heads, d]`` (SGLang's own pool layout),
no rotation, same splits and the same reduce kernel as the INT2 decode.
"""

import torch
import triton
import triton.language as tl

from ..common.triton_helpers import program_split
from .triton_kernel import LOG2E, choose_splits, merge_splits


@triton.jit
def _bf16_split_kernel(q_ptr, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
                       stride_qb, stride_qh, stride_r2t, KV, Q_HEADS, NUM_SPLITS, qk_scale,
                       GQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                       BF16_DOT: tl.constexpr):
    b, kvh, sp, req, start, end = program_split(seq_lens, req_pool_indices, NUM_SPLITS, 0, 0, BLOCK_N, 0)
    h = tl.arange(0, BLOCK_H)
    hmask = h < GQ
    qh = kvh * GQ + h
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    if BF16_DOT:
        q = q.to(tl.bfloat16)
    else:
        q = q.to(tl.float32)  # the interpreter's bf16 tl.dot is wrong
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        slot = tl.load(req_to_token + req * stride_r2t + t, mask=tmask, other=0).to(tl.int64)
        off = (slot * KV + kvh)[:, None] * D + d[None, :]
        k = tl.load(k_buf + off, mask=tmask[:, None], other=0.0)
        v = tl.load(v_buf + off, mask=tmask[:, None], other=0.0)
        if not BF16_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    part = (b * Q_HEADS + qh).to(tl.int64) * NUM_SPLITS + sp
    tl.store(mid_o + part[:, None] * D + d[None, :], acc * inv_l[:, None], mask=hmask[:, None])
    tl.store(mid_lse + part, lse, mask=hmask)


def decode_attention_bf16(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                          req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                          num_splits: int | None = None, max_seq_len: int | None = None,
                          block_n: int = 32, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Plain BF16 paged decode attention, ``q [B, q_heads, d]`` -> ``[B, q_heads, d]`` in ``q.dtype``."""
    bsz, q_heads, d = q.shape
    kv = k_buf.shape[1]
    gq = q_heads // kv
    splits = num_splits or choose_splits(bsz, kv, q.device, max_seq_len, block_n)
    mid_o = torch.empty(bsz, q_heads, splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bsz, q_heads, splits, dtype=torch.float32, device=q.device)
    _bf16_split_kernel[(bsz, kv, splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), req_to_token.stride(0), kv, q_heads, splits, sm_scale * LOG2E,
        GQ=gq, BLOCK_H=max(16, triton.next_power_of_2(gq)), BLOCK_N=block_n, D=d, BF16_DOT=q.is_cuda,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True,
    )
    return merge_splits(mid_o, mid_lse, dtype=q.dtype)  # merged and cast in one launch, as SGLang's own decode
