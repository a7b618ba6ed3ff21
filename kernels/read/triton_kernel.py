"""Read kernel: the rotated K/V rows at some slots, dequantized into dense ``[n, kv_heads, d]`` buffers.

One launch per side (keys, then values, each in its format: constexprs
``BITS``, ``G``, ``SYM``), grid ``(cdiv(n, BLOCK_T), kv_heads)``; a program
looks up ``BLOCK_T`` slots' hot entries, loads their code words, scales and
zeros, computes ``zero + code * scale`` in fp32 or takes the BF16 copy where
the slot is hot, and stores the rows in the buffer's dtype (rounded to
nearest-even, as torch's cast; ``kernels.interpret`` makes the interpreter's
bf16 cast round so too).  One side at a time and 32 tokens per program, as
this kernel only streams: 74-76 registers at d 128 with triton 3.8, 80 with
3.6 (both sides and 64 tokens: 255).

What the sdpa prefill path (``extend/sdpa.py``) attends to: a request's
prefix read once per chunk in one pass over its codes, where the torch
reference (``reference.py``) makes several fp32 passes and an fp32 copy of
the prefix twice the size of the bf16 one.

Compiled without floating-point contraction, as the write kernel: ``zero +
code * scale`` rounded twice, as torch does it, so the rows equal the
reference's bit for bit.
"""

import torch
import triton
import triton.language as tl

from ..common.triton_helpers import dequant_rows, fetch_rows, slot_entries, store_pieces
from ..layout import LayerStore, require_contiguous, triton_unsupported
from .reference import check_out

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _read_kernel(slots_ptr, n, out, codes, scale, zero, hot_rows, hot_index, KV, BLOCK_T: tl.constexpr,
                 D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kvh = tl.program_id(1)
    tmask = t < n
    slot = tl.load(slots_ptr + t, mask=tmask, other=0).to(tl.int64)
    entry = slot_entries(slot, tmask, hot_index)
    hot = tmask & (entry >= 0)
    word, s, z = fetch_rows(codes, scale, zero, slot * KV + kvh, tmask & ~hot, D, G, BITS, SYM, False, 0.0)
    x0, x1, x2, x3 = dequant_rows(word, s, z, hot_rows, entry * KV + kvh, hot, D, BITS, True)
    store_pieces(out + (t.to(tl.int64) * KV + kvh) * D, tmask, x0, x1, x2, x3, D)  # cast to out's dtype, RNE


def read_rows(store: LayerStore, slots: torch.Tensor, dtype: torch.dtype,
              out: tuple[torch.Tensor, torch.Tensor] | None = None, block_t: int = 32,
              num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`oscar_sglang.kernels.read.reference.read_rows` (same arguments)."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"rows can be read as {OUT_DTYPES}, not {dtype}")
    kv, d, kf, vf = store.kv_heads, store.head_dim, store.k_format, store.v_format
    n = slots.shape[0]
    if out is None:
        k = torch.empty(n, kv, d, dtype=dtype, device=store.k_hot.device)
        v = torch.empty_like(k)
    else:
        check_out(out, (n, kv, d), dtype)
        k, v = out
    if n == 0:
        return k, v
    assert (problem := triton_unsupported(d, kf, vf)) is None, problem
    require_contiguous(store)
    slots = slots.contiguous()
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = store.row_args()
    for buf, codes, scale, zero, hot_rows, form in ((k, k_codes, k_scale, k_zero, store.k_hot, kf),
                                                    (v, v_codes, v_scale, v_zero, store.v_hot, vf)):
        _read_kernel[(triton.cdiv(n, block_t), kv)](
            slots, n, buf, codes, scale, zero, hot_rows, store.hot_index, kv, BLOCK_T=block_t, D=d,
            BITS=form.bits, G=form.group, SYM=form.symmetric, num_warps=num_warps,
            enable_fp_fusion=False,  # zero + code * scale rounded twice, as torch: the reference's rows bit for bit
        )
    return k, v
