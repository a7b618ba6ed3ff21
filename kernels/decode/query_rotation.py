"""Triton: a decode step's queries rotated for the split kernel, ``q @ R_K[group(h)]`` in fp32, in one launch.

The reference is :func:`oscar_sglang.rotation.rotate_queries` (torch): a cast, the copy that puts each KV head's
rows together for a batched matmul, the matmul and the copy back, four small launches per layer in front of the
split kernel.  At batch 1 a decode step's attention is a few microseconds of work (32k tokens of 8 INT2 KV
heads: 17 MB), and on a GPU every launch costs about as much again, inside a CUDA graph too.  This kernel reads
the queries as the server passes them (bf16 or fp32, strided) and writes the rotated rows the split kernel reads
(``[batch, q_heads, d]`` fp32): one launch, each program one KV head's query rows against ``EC`` columns of its
``R_K`` (fp32 products and sums, as the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EC = 32  # columns of R_K (output columns) per program: d / 32 programs per request and KV head
KC = 32  # input columns per dot


@triton.jit
def _rotate_queries_kernel(q_ptr, q_rot, out, stride_qb, stride_qh, Q_HEADS, GQ: tl.constexpr,
                           BLOCK_H: tl.constexpr, D: tl.constexpr, KC: tl.constexpr, EC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    e = tl.program_id(2) * EC + tl.arange(0, EC)
    h = tl.arange(0, BLOCK_H)
    hmask = h < GQ
    qh = kvh * GQ + h
    rows = q_ptr + b * stride_qb + qh * stride_qh
    c = tl.arange(0, KC)
    acc = tl.zeros([BLOCK_H, EC], tl.float32)
    for k0 in tl.static_range(0, D, KC):
        x = tl.load(rows[:, None] + k0 + c[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
        r = tl.load(q_rot + kvh * D * D + (k0 + c)[:, None] * D + e[None, :])
        acc += tl.dot(x, r, input_precision="ieee")
    tl.store(out + (b * Q_HEADS + qh).to(tl.int64)[:, None] * D + e[None, :], acc, mask=hmask[:, None])


def rotated_queries(q: torch.Tensor, q_rot: torch.Tensor) -> torch.Tensor:
    """``q[batch, q_heads, d] @ R_K[group(h)]`` as contiguous fp32 (``q_rot [kv_heads, d, d]`` fp32; the query
    heads of a group contiguous, as :func:`oscar_sglang.rotation.rotate_queries`); ``q`` any float dtype, its rows
    strided but each contiguous.  Power-of-two ``d >= 32``."""
    bsz, hq, d = q.shape
    kv = q_rot.shape[0]
    if kv <= 0 or hq % kv:
        raise ValueError(f"{hq} query heads cannot be grouped over {kv} KV heads")
    if q_rot.shape != (kv, d, d) or q_rot.dtype != torch.float32:
        raise ValueError(f"q_rot must be float32 [{kv}, {d}, {d}], got {q_rot.dtype} {list(q_rot.shape)}")
    if d < EC or d & (d - 1):
        raise ValueError(f"the query rotation kernel needs a power-of-two head_dim >= {EC}, got {d}")
    out = torch.empty(bsz, hq, d, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return out
    q_in = q if q.stride(-1) == 1 else q.contiguous()
    gq = hq // kv
    _rotate_queries_kernel[(bsz, kv, d // EC)](q_in, q_rot.contiguous(), out, q_in.stride(0), q_in.stride(1), hq,
                                               GQ=gq, BLOCK_H=max(16, triton.next_power_of_2(gq)), D=d, KC=KC,
                                               EC=EC, enable_fp_fusion=True)
    return out
