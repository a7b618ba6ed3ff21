"""Decode attention over the quantized/BF16 store: split-K (flash-decoding) partials, then a reduce.

Stage 1, grid ``(batch, kv_heads, num_splits)``: a program reads its split of
one request's tokens for one KV head once, for all the query heads of the
group (padded to at least 16 rows for ``tl.dot``), and writes a normalised
partial output and its log2-sum-exp.  Stage 2, grid ``(batch, q_heads)``,
merges the splits, de-rotates the output and casts it to the query's dtype
(one launch; these were three in torch).  The query is rotated inside stage 1
on small grids (``rotate_rows``, as the write kernel rotates keys, with TF32
dots here, each program its own group's rows), so a small batch's decode is two
launches per layer, as SGLang's own Triton decode is; on large grids it is
rotated before, by a launch of its own (``query_rotation.py``), to keep stage 1's
registers low (see ``decode_attention``).

Keys and values are read in their own formats (constexprs ``K_BITS``/``K_G``,
``V_BITS``/``V_G``; 2, 4 or 8 bits, from ``store.k_format``/``v_format``),
unpacked by ``common/triton_helpers.fetch_rows``/``dequant_rows``.
"""

import functools

import torch
import triton
import triton.language as tl

from ..common.triton_helpers import (attend_cold_block, attend_cold_block_folded, attend_fetched_block,
                                     attend_hot_block, attend_hot_block_folded, bf16_rne, block_slots,
                                     fetch_block, folded_bias, folded_sums, load_row_pieces, program_split,
                                     rotate_rows, slot_entries, store_pieces)
from ..interpret import interpreted
from ..layout import DeviceRotation, LayerStore, require_contiguous, triton_unsupported
from ..occupancy import Multiprocessor, compiled_resources, resident_programs
from .query_rotation import rotated_queries
from .split_cut import HOT_WEIGHT_DEFAULT, HOT_WEIGHT_FOLD, check_cut

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MAX_WAVE_SPLITS = 128  # choose_splits' bound where it sizes the grid to the resident programs (``whole_waves``)
ROTATE_IN_KERNEL_WAVES = 2  # decode_attention's automatic choice of where the queries are rotated
# fp32 dot operands: TF32 tensor cores on the GPU (about 1e-3 relative per
# product, below bf16's 4e-3); the interpreter computes them in fp32.
DOT_PRECISION = "tf32"
# ``decode_attention(dots=...)``: "tf32" (the default, fp32 operands) or "bf16" (every dot operand rounded to bf16,
# fp32 accumulation, as the extend kernel's default: half the operand bytes through shared memory); a variant
# for the GPU to time (scripts/device/decode_variants.py), not yet measured there
DOT_CHOICES = ("tf32", "bf16")
# The default block of tokens holds at most this many elements of a row side (64 tokens at d 128 and d 64): at
# d 256, 64 tokens took 144 KiB of shared memory and a 256-byte stack (sm_89 and sm_90), over sm_86/89's 99 KiB
# (A10, L4, L40S, RTX 30/40), where the launch is refused; 32 tokens take 80 KiB and no stack (compile_check).
BLOCK_ELEMENTS = 64 * 128


def default_block_n(head_dim: int) -> int:
    """``decode_attention``'s block of tokens for rows of ``head_dim``: 64 up to d 128, 32 at d 256, at least 16."""
    return max(16, min(64, BLOCK_ELEMENTS // head_dim))


@triton.jit
def _decode_split_kernel(q_ptr, q_rot, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_hot, v_hot, hot_index,
                         req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
                         stride_qb, stride_qh, stride_r2t, KV, Q_HEADS, NUM_SPLITS, qk_scale, hot_sink, hot_recent,
                         GQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         D: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, V_BITS: tl.constexpr,
                         V_G: tl.constexpr, PREC: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
                         ROTATE_Q: tl.constexpr, HOT_SKIP: tl.constexpr, PREFETCH: tl.constexpr,
                         FOLD: tl.constexpr, PACKED: tl.constexpr, HOT_LOOP: tl.constexpr,
                         UNPACK_FIRST: tl.constexpr, HOT_WEIGHT: tl.constexpr):
    b, kvh, sp, req, start, end = program_split(seq_lens, req_pool_indices, NUM_SPLITS, hot_sink, hot_recent,
                                                BLOCK_N, HOT_WEIGHT)

    h = tl.arange(0, BLOCK_H)
    hmask = h < GQ
    qh = kvh * GQ + h
    if ROTATE_Q:  # q @ R_K[kvh] here (q_ptr: the unrotated queries, any float dtype), TF32 dots on a GPU: every
        # split repeats it, and IEEE fp32 dots took the program ~3300 instructions before its loop (sm_90, triton
        # 3.6), TF32 ~1200-1500; the dots after round the queries to TF32 (default) or fp16 (fold) anyway
        q0, q1, q2, q3 = rotate_rows(q_ptr + b * stride_qb + qh * stride_qh, q_rot, q_rot + kvh * D * D, hmask,
                                     False, BLOCK_H, D, 32, "tf32")
    else:  # q_ptr: fp32 queries rotated before the launch
        q0, q1, q2, q3 = load_row_pieces(q_ptr + b * stride_qb + qh * stride_qh, hmask, D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    if FOLD:  # transposed (attend_affine_t): fp16 queries [D/4, BLOCK_H] times the softmax's scale, their sum
        # and what the keys' biased codes add to a dot (folded_bias), outputs [D/4, BLOCK_H], and per row
        # [BLOCK_N, BLOCK_H] the softmax's sum, the values' zeros' term and the weights' sum (for the values'
        # biased codes)
        q0, q1 = (q0 * qk_scale).to(tl.float16), (q1 * qk_scale).to(tl.float16)
        q2, q3 = (q2 * qk_scale).to(tl.float16), (q3 * qk_scale).to(tl.float16)
        qsum, kbias = folded_bias(q0, q1, q2, q3, K_BITS, K_SYM)
        q0, q1, q2, q3 = tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3)
        lt = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
        zt = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
        wt = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
        a0 = tl.zeros([D // 4, BLOCK_H], tl.float32)
        a1 = tl.zeros([D // 4, BLOCK_H], tl.float32)
        a2 = tl.zeros([D // 4, BLOCK_H], tl.float32)
        a3 = tl.zeros([D // 4, BLOCK_H], tl.float32)
    else:
        a0 = tl.zeros([BLOCK_H, D // 4], tl.float32)
        a1 = tl.zeros([BLOCK_H, D // 4], tl.float32)
        a2 = tl.zeros([BLOCK_H, D // 4], tl.float32)
        a3 = tl.zeros([BLOCK_H, D // 4], tl.float32)
    tok_row = req_to_token + req * stride_r2t
    n = tl.arange(0, BLOCK_N)
    hot_lo = end  # HOT_LOOP: the first and last block starts with a hot row (none: an empty range)
    hot_hi = start - BLOCK_N
    if FOLD:  # the same per lane, reduced after the loop (no reduction across warps inside it)
        hot_lo_rows = tl.full([BLOCK_N], 0, tl.int32) + end
        hot_hi_rows = tl.full([BLOCK_N], 0, tl.int32) + (start - BLOCK_N)
    # PREFETCH 0: each block's three dependent loads (slot, hot entry, rows) in turn.  Else a software pipeline
    # over them: block j+2's slots and block j+1's hot entries are loaded while block j is computed (PREFETCH 1:
    # its rows loaded then); PREFETCH 2: also block j+1's rows, and block j+3's slots, j+2's entries.  Past
    # ``end`` the slots read 0 (the padding slot, whose codes are read, never weighed) and the rest is masked.
    LEAD: tl.constexpr = PREFETCH + 1  # blocks ahead whose slots are loaded
    if PREFETCH > 0:
        s0 = block_slots(start + n, start + n < end, tok_row)
        e0 = slot_entries(s0, start + n < end, hot_index)
        s1 = block_slots(start + BLOCK_N + n, start + BLOCK_N + n < end, tok_row)
    if PREFETCH == 2:
        e1 = slot_entries(s1, start + BLOCK_N + n < end, hot_index)
        s2 = block_slots(start + 2 * BLOCK_N + n, start + 2 * BLOCK_N + n < end, tok_row)
        kw, ks, kz, vw, vs, vz = fetch_block(s0, e0, start + n < end, kvh, KV, k_codes, k_scale, k_zero,
                                             v_codes, v_scale, v_zero, D, K_BITS, K_G, V_BITS, V_G, K_SYM, V_SYM, FOLD)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + n
        tmask = t < end
        if PREFETCH == 0:
            s0 = block_slots(t, tmask, tok_row)
            e0 = slot_entries(s0, tmask, hot_index)
            kw, ks, kz, vw, vs, vz = fetch_block(s0, e0, tmask, kvh, KV, k_codes, k_scale, k_zero,
                                                 v_codes, v_scale, v_zero, D, K_BITS, K_G, V_BITS, V_G,
                                                 K_SYM, V_SYM, FOLD)
        else:
            t_lead = n0 + LEAD * BLOCK_N + n
            s_lead = block_slots(t_lead, t_lead < end, tok_row)
            if PREFETCH == 2:  # block j+2's entries, block j+1's rows (block j's were fetched the turn before)
                t1 = t + BLOCK_N
                e2 = slot_entries(s2, t1 + BLOCK_N < end, hot_index)
                nkw, nks, nkz, nvw, nvs, nvz = fetch_block(s1, e1, t1 < end, kvh, KV, k_codes, k_scale, k_zero,
                                                           v_codes, v_scale, v_zero, D, K_BITS, K_G, V_BITS, V_G,
                                                           K_SYM, V_SYM, FOLD)
            else:  # block j+1's entries, block j's rows
                e1 = slot_entries(s1, t + BLOCK_N < end, hot_index)
                kw, ks, kz, vw, vs, vz = fetch_block(s0, e0, tmask, kvh, KV, k_codes, k_scale, k_zero,
                                                     v_codes, v_scale, v_zero, D, K_BITS, K_G, V_BITS, V_G,
                                                     K_SYM, V_SYM, FOLD)
        if FOLD:  # every block's cold rows, without a branch (no reduction across warps, nothing kept in the loop
            # but the sums); each hot row's block start noted in its lane (the first and last hot blocks, for the loop
            # after this one: its hot rows only)
            hot = tmask & (e0 >= 0)
            hot_lo_rows = tl.minimum(hot_lo_rows, tl.where(hot, n0, end))
            hot_hi_rows = tl.maximum(hot_hi_rows, tl.where(hot, n0, start - BLOCK_N))
            m, lt, zt, wt, a0, a1, a2, a3 = attend_cold_block_folded(
                kw, ks, kz, vw, vs, vz, q0, q1, q2, q3, qsum, kbias, m, lt, zt, wt,
                a0, a1, a2, a3, K_BITS, V_BITS, K_SYM, V_SYM, PACKED, UNPACK_FIRST)
        elif HOT_LOOP:  # a block with a hot row: its first and last start noted, attended in the loop after this one
            if tl.max((tmask & (e0 >= 0)).to(tl.int32), 0) > 0:
                hot_lo = tl.minimum(hot_lo, n0)
                hot_hi = n0
            else:
                m, l, a0, a1, a2, a3 = attend_cold_block(kw, ks, kz, vw, vs, vz, tmask, q0, q1, q2, q3, qk_scale,
                                                         m, l, a0, a1, a2, a3, K_BITS, V_BITS, PREC)
        else:  # the BF16 copies read here where hot (hot_skip: in a block with a hot row; the second run's loop)
            m, l, a0, a1, a2, a3 = attend_fetched_block(
                e0, tmask, kvh, KV, kw, ks, kz, vw, vs, vz, k_hot, v_hot,
                q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3, D, K_BITS, V_BITS, PREC, HOT_SKIP)
        if PREFETCH == 2:
            kw, ks, kz, vw, vs, vz = nkw, nks, nkz, nvw, nvs, nvz
            e0, e1 = e1, e2
            s0, s1, s2 = s1, s2, s_lead
        elif PREFETCH == 1:
            s0, e0 = s1, e1
            s1 = s_lead
    if FOLD:
        hot_lo = tl.min(hot_lo_rows, 0)
        hot_hi = tl.max(hot_hi_rows, 0)
    if HOT_LOOP:  # the blocks with a hot row, from the first to the last noted (a split's are few: sink, recent)
        for n0 in range(hot_lo, hot_hi + 1, BLOCK_N):
            t = n0 + n
            tmask = t < end
            entries = slot_entries(block_slots(t, tmask, tok_row), tmask, hot_index)
            if tl.max((tmask & (entries >= 0)).to(tl.int32), 0) > 0:
                if FOLD:
                    m, lt, zt, wt, a0, a1, a2, a3 = attend_hot_block_folded(
                        n0, end, tok_row, hot_index, kvh, KV, k_hot, v_hot, q0, q1, q2, q3, qsum, m, lt, zt, wt,
                        a0, a1, a2, a3, D, BLOCK_N)
                else:
                    m, l, a0, a1, a2, a3 = attend_hot_block(
                        n0, end, tok_row, hot_index, kvh, KV, k_hot, v_hot, q0, q1, q2, q3, qk_scale, m, l,
                        a0, a1, a2, a3, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, D, K_BITS, K_G,
                        V_BITS, V_G, K_SYM, V_SYM, PREC, BLOCK_N)
    if FOLD:
        l, a0, a1, a2, a3 = folded_sums(lt, zt, wt, a0, a1, a2, a3, V_BITS, V_SYM)
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)[:, None]
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    part = (b * Q_HEADS + qh).to(tl.int64) * NUM_SPLITS + sp
    store_pieces(mid_o + part * D, hmask, a0 * inv_l, a1 * inv_l, a2 * inv_l, a3 * inv_l, D)
    tl.store(mid_lse + part, lse, mask=hmask)


@triton.jit
def _decode_reduce_kernel(mid_o, mid_lse, out, v_rot, NUM_SPLITS, Q_HEADS, S_PAD: tl.constexpr, D: tl.constexpr,
                          GQ: tl.constexpr, DEROTATE: tl.constexpr, EC: tl.constexpr, OUT_BF16: tl.constexpr):
    """Merge the splits of one (request, query head): weights ``2^(lse_s - max)``; all-empty gives 0.

    ``DEROTATE``: the merged row times ``R_V[kv head]^T`` (``EC`` output columns at a time), as
    ``oscar_sglang.rotation.derotate_output``.  ``OUT_BF16``: ``out`` is bf16, rounded to nearest-even as
    torch's cast (the interpreter's own cast truncates); else fp32.
    """
    pid = tl.program_id(0).to(tl.int64)  # b * q_heads + h
    s = tl.arange(0, S_PAD)
    smask = s < NUM_SPLITS
    lse = tl.load(mid_lse + pid * NUM_SPLITS + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    d = tl.arange(0, D)
    o = tl.load(mid_o + (pid * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    if DEROTATE:
        rot = v_rot + ((pid % Q_HEADS) // GQ) * D * D
        e = tl.arange(0, EC)
        for e0 in tl.static_range(0, D, EC):
            r = tl.load(rot + (e0 + e)[:, None] * D + d[None, :])  # rows e of R: out[e] = sum_d res[d] R[e, d]
            part = tl.sum(r * res[None, :], 1)
            if OUT_BF16:
                part = bf16_rne(part)
            tl.store(out + pid * D + e0 + e, part)
    else:
        if OUT_BF16:
            res = bf16_rne(res)
        tl.store(out + pid * D + d, res)


@functools.lru_cache(maxsize=8)
def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_splits(batch: int, kv_heads: int, device: torch.device, max_seq_len: int | None = None,
                  block_n: int = 32, num_warps: int = 4, resident: int | None = None) -> int:
    """Splits per request, without a host sync.

    Without ``resident``: about 8 warps per streaming multiprocessor (2 programs of 4 warps, 4 of 2), rounded up,
    at most :data:`MAX_SPLITS`.  With ``resident``, the programs one multiprocessor holds at once
    (``kernels/occupancy.resident_programs`` of the compiled kernel): as many splits as fit in one whole wave
    of the device (rounded down, at least 1, at most :data:`MAX_WAVE_SPLITS`), since a grid of 1.5 waves of
    equal programs takes as long as 2.  Either way at most one split per ``2 * block_n`` tokens of
    ``max_seq_len``.
    """
    if resident:
        s = max(1, resident * _processors(device) // max(1, batch * kv_heads))
        cap = MAX_WAVE_SPLITS
    else:
        s = triton.cdiv(max(1, 8 // num_warps) * _processors(device), max(1, batch * kv_heads))
        cap = MAX_SPLITS
    if max_seq_len is not None:
        s = min(s, triton.cdiv(max(1, max_seq_len), 2 * block_n))
    return max(1, min(cap, s))


def rotates_q_in_kernel(batch: int, kv_heads: int, splits: int, device: torch.device) -> bool:
    """``decode_attention``'s automatic choice: rotate the queries in the split kernel when its grid is at most
    :data:`ROTATE_IN_KERNEL_WAVES` programs per multiprocessor."""
    return batch * kv_heads * splits <= ROTATE_IN_KERNEL_WAVES * _processors(device)


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, v_rot: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stage 2: ``mid_o [B, H, S, D]``, ``mid_lse [B, H, S]`` (log2) -> ``[B, H, D]`` in ``dtype``.

    With ``v_rot [kv_heads, D, D]`` (fp32, contiguous) the merged rows are also de-rotated, query head ``h``
    by ``v_rot[h // (H / kv_heads)]``.  fp32 and bf16 are written by the kernel; another dtype is a cast after.
    """
    b, h, s, d = mid_o.shape
    direct = dtype in (torch.float32, torch.bfloat16)
    out = torch.empty(b, h, d, dtype=dtype if direct else torch.float32, device=mid_o.device)
    gq = h // v_rot.shape[0] if v_rot is not None else 1
    _decode_reduce_kernel[(b * h,)](mid_o, mid_lse, out, v_rot if v_rot is not None else mid_lse, s, h,
                                    S_PAD=triton.next_power_of_2(s), D=d, GQ=gq, DEROTATE=v_rot is not None,
                                    EC=min(d, 32), OUT_BF16=out.dtype == torch.bfloat16, enable_fp_fusion=True)
    return out if direct else out.to(dtype)


def decode_attention(q: torch.Tensor, store: LayerStore, rot: DeviceRotation, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                     num_splits: int | None = None, max_seq_len: int | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                     rotate_q_in_kernel: bool | None = None, hot_skip: bool = True,
                     prefetch: int = 1, dots: str = DOT_PRECISION, fold: bool = False, hot_loop: bool = False,
                     max_registers: int | None = None, resident: int | None = None, whole_waves: bool = False,
                     unpack_first: bool = False, hot_windows: tuple[int, int] | None = None,
                     hot_weight: int | None = None, report: dict | None = None) -> torch.Tensor:
    """Triton version of :func:`oscar_sglang.kernels.decode.reference.decode_attention`.

    ``rotate_q_in_kernel`` (default: automatic): rotate the queries inside the split kernel (two launches
    in all) or before it (three: ``query_rotation.rotated_queries``, one launch where torch's cast, matmul and
    copies were four, until 2026-12-05).  Automatic chooses the kernel where the
    grid is at most :data:`ROTATE_IN_KERNEL_WAVES` programs per multiprocessor (small batches, where a
    launch costs more than the work and occupancy does not matter: ``choose_splits`` sizes such grids to
    2 per multiprocessor, all resident at once), the rotation's own launch beyond (inside, the rotation costs
    the split kernel registers and every split repeats it:
    for d 128 INT2, GQA 4, on sm_90, 125 -> 196 with triton 3.6, the GPU machine's, and 167 -> 178 with
    3.8: programs resident per multiprocessor 4 -> 2 and 3 -> 2).

    ``hot_skip``: read the BF16 hot copies only in blocks that have a hot row.  ``prefetch`` (0, 1, 2): how far
    the split kernel's loop loads ahead (0: a block's slots, hot entries and rows one after the other, three
    memory latencies in turn per block; 1: slots two blocks ahead and entries one; 2: also the rows one
    block ahead, in registers).  ``block_n`` (default :func:`default_block_n`: 64 tokens up to d 128, 32 at
    d 256).  The defaults (block_n 64, prefetch 1, hot_skip) are the fastest of the
    variants timed on the H200 (docs/gpu/run2/decode_variants.md, 2026-12-04): 1.23x, 1.69x and 1.60x the
    speed of the first run's loop (block_n 32, prefetch 0, no hot_skip) at batch 1 / 32 at 32k and batch
    128 at 16k.

    ``fold``: blocks without a hot row attended over the codes themselves, each row's scale and zero folded
    into the logits and the softmax weights (``common/triton_helpers.attend_fetched_block_folded``: the codes
    unpacked to fp16 two per instruction by inline PTX on a GPU, transposed fp16 dots so that the GQA group
    fills the MMA's 8-wide side, blocks with a hot row dequantized 16 rows at a time); for formats of one
    group per row, with ``hot_skip`` (else ignored); the rotated queries and the hot rows' BF16 copies must
    fit fp16's range (|x| < 65504; a model's are tens, rarely hundreds).  The loop has no branch: every
    block's rows without a hot copy are attended there, and the blocks with a hot row (the first to the last
    noted) attend their hot rows in a loop of their own after it (``attend_hot_block_folded``), which keeps
    the kernel's registers to the cold loop's need.  A variant for the GPU to time
    (scripts/device/decode_variants.py): compiled for sm_90 (kernels/compile_check.py --sass) it issues 36
    warp-instructions per token with triton 3.6 (the default 112) and 39 with 3.8 (the default 60); 19-20 with
    ``num_warps=2`` under either (18 over symmetric rows), at 161-167 registers (12 warps per
    multiprocessor; the default's 220-255: 8).  The codes stay biased (``B_p + c``, one PTX instruction per
    two codes), the biases taken off the logits and the outputs (``folded_bias``, ``folded_sums``).

    ``unpack_first`` (with ``fold``; else ignored): the values' codes unpacked to fp16 before they cross to the
    transposed layout their dots read, through shared memory by ``ldmatrix.trans``, rather than as bytes after
    (byte shuffles; ``common/triton_helpers.attend_cold_block_folded``).  The same numbers; sm_90, d 128, 2 warps,
    per 64-token block and warp: 612 -> 552 instructions with triton 3.6, 630 -> 545 with 3.8, but 200 shared-memory
    wavefronts instead of 88 (kernels/compile_check.py --sass): by these counts bound by shared memory, ~400 cycles
    a block where the fold issues for ~315 (docs/KERNELS.md).  A variant for the GPU to time
    (scripts/device/decode_variants.py), not a candidate of the server's startup timing.

    ``hot_loop`` (with ``hot_skip``; the folded loop always does): blocks with a hot row (the sink's, the recent
    window's) are noted in the loop over the blocks and attended in a loop of their own after it, 16 rows at a
    time (``attend_hot_block``): inside the loop, with its loads ahead live, that rare branch sets the kernel's
    registers.  A variant for the GPU to time, not the default: compiled for sm_90 it helps one compiler and
    hurts the other (d 128 INT2 GQA 4: triton 3.6, the H200 machine's, 255 registers, a 184-byte stack and
    1797 instructions per cold block -> 200 registers, 1006 instructions; 3.8, 220 and 959 -> 168 (12 warps
    per multiprocessor instead of 8) and 1089; d 64 GQA 8 with 3.8: 162 and 1093 -> 255, spilling, and 2141).

    ``max_registers``: the compiler's registers per thread at most (Triton's ``maxnreg``; spills beyond).  The
    default loop compiles to 220-255 on sm_90, which holds a multiprocessor to 8 warps (``kernels/occupancy.py``),
    the folded one to 167-168 at 2 warps (12 warps); 128 gives 16, at the cost of some local loads and stores
    (with ``fold`` and 2 warps: none in the cold loop with triton 3.8, 36 per block with 3.6).
    ``resident`` (without ``num_splits``): the split count for one whole wave of this many programs per
    multiprocessor (``choose_splits(resident=...)``, up to :data:`MAX_WAVE_SPLITS`), not the fixed 8 warps per
    multiprocessor: a number the GPU reported (``report``), so that a CUDA graph's split count, fixed before
    its capture, can follow it.  ``whole_waves`` (without ``num_splits`` or ``resident``): on a GPU, the same
    from the compiled kernel's own residency (``kernels/occupancy.py``); elsewhere ignored.  Variants for the
    GPU to time (scripts/device/decode_variants.py).
    ``hot_windows=(sink, recent)``: where the requests' hot rows are (their first ``sink`` and last ``recent``
    tokens; the server's windows), a hint for cutting the splits by work rather than evenly
    (``split_cut.py``): a block of the windows weighs ``hot_weight`` quarters of a cold block (default
    :data:`~.split_cut.HOT_WEIGHT_FOLD` for the folded loop, :data:`~.split_cut.HOT_WEIGHT_DEFAULT` for the
    others; 0: the even cut).  Without it, or where the hint is wrong, every split still attends its own hot
    rows: the cut moves time between the splits, never the result.
    ``report``: a dict filled with the launch's ``splits``, ``rotate_q_in_kernel`` and, on a GPU, the compiled
    split kernel's
    ``registers``, ``spills``, ``shared``, ``resident`` programs per multiprocessor and ``waves`` of the grid
    (or a ``note`` saying why they could not be read).
    """
    if prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2, got {prefetch!r}")
    if dots not in DOT_CHOICES:
        raise ValueError(f"dots must be one of {DOT_CHOICES}, got {dots!r}")
    bsz, q_heads, d = q.shape
    kv, kf, vf = store.kv_heads, store.k_format, store.v_format
    gq = q_heads // kv
    assert (problem := triton_unsupported(d, kf, vf)) is None, problem
    assert req_to_token.stride(1) == 1, "req_to_token rows must be contiguous"
    if bsz == 0:
        return torch.zeros_like(q)
    require_contiguous(store, rot)
    block_n = block_n or default_block_n(d)
    if resident is not None and not 1 <= resident <= 64:
        raise ValueError(f"resident must be within 1..64 programs per multiprocessor, got {resident!r}")
    splits = num_splits or choose_splits(bsz, kv, q.device, max_seq_len, block_n, num_warps, resident)
    if rotate_q_in_kernel is None:
        rotate_q_in_kernel = rotates_q_in_kernel(bsz, kv, splits, q.device)
    if not rotate_q_in_kernel:
        q_in = rotated_queries(q, rot.q_rot)
    else:
        q_in = q if q.stride(-1) == 1 else q.contiguous()
    fold = bool(fold and hot_skip and kf.group_for(d) == d and vf.group_for(d) == d)
    if fold and block_n % 16:  # the fp16 dots over a block's tokens, and the hot parts of 16 rows
        raise ValueError(f"fold needs block_n a multiple of 16, got {block_n}")
    check_cut(hot_windows, hot_weight)
    if hot_windows is None:
        hot_windows, hot_weight = (0, 0), 0
    elif hot_weight is None:
        hot_weight = HOT_WEIGHT_FOLD if fold else HOT_WEIGHT_DEFAULT
    if max_registers is not None and not 16 <= max_registers <= 255:
        raise ValueError(f"max_registers must be within 16..255, got {max_registers!r}")
    consts = dict(GQ=gq, BLOCK_H=max(8 if fold else 16, triton.next_power_of_2(gq)), BLOCK_N=block_n, D=d,
                  K_BITS=kf.bits, K_G=kf.group, V_BITS=vf.bits, V_G=vf.group, PREC=dots,
                  K_SYM=kf.symmetric, V_SYM=vf.symmetric, ROTATE_Q=rotate_q_in_kernel, HOT_SKIP=hot_skip,
                  PREFETCH=prefetch, FOLD=fold, HOT_LOOP=bool((hot_loop or fold) and hot_skip),
                  UNPACK_FIRST=bool(fold and unpack_first), HOT_WEIGHT=hot_weight,
                  PACKED=not interpreted(_decode_split_kernel) and torch.version.hip is None,  # inline PTX: NVIDIA only
                  num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True,
                  **({"maxnreg": max_registers} if max_registers is not None else {}))

    def launch(splits, warmup=False):
        mid_o = torch.empty(bsz, q_heads, splits, d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(bsz, q_heads, splits, dtype=torch.float32, device=q.device)
        args = (q_in, rot.q_rot, *store.row_args(), store.k_hot, store.v_hot, store.hot_index, req_to_token,
                req_pool_indices, seq_lens, mid_o, mid_lse, q_in.stride(0), q_in.stride(1), req_to_token.stride(0),
                kv, q_heads, splits, sm_scale * LOG2E, *hot_windows)
        if warmup:
            return _decode_split_kernel.warmup(*args, grid=(1, 1, 1), **consts)
        return _decode_split_kernel[(bsz, kv, splits)](*args, **consts), mid_o, mid_lse

    on_gpu = q.device.type == "cuda" and not interpreted(_decode_split_kernel)
    if whole_waves and num_splits is None and resident is None and on_gpu:
        key = (q.device, q_in.dtype, tuple(sorted(consts.items())))
        if key not in _RESIDENT:
            compiled = launch(splits, warmup=True)
            _RESIDENT[key] = _resident(compiled, q.device) if compiled is not None else None
        if _RESIDENT[key]:
            splits = choose_splits(bsz, kv, q.device, max_seq_len, block_n, num_warps, resident=_RESIDENT[key])
    compiled, mid_o, mid_lse = launch(splits)
    if report is not None:
        report.update(splits=splits, rotate_q_in_kernel=rotate_q_in_kernel)
        if on_gpu and compiled is not None:
            try:  # a diagnosis: never the decode's failure
                resident = _resident(compiled, q.device)
                report.update(compiled_resources(compiled), resident=resident,
                              waves=bsz * kv * splits / max(1, resident * _processors(q.device)))
            except Exception as e:  # noqa: BLE001
                report["note"] = f"registers not read: {type(e).__name__}: {str(e)[:120]}"
    return merge_splits(mid_o, mid_lse, rot.v_rot, q.dtype)


# (device, query dtype, constexprs and options) -> programs of the split kernel resident per multiprocessor
# (None: unknown, the fixed rule)
_RESIDENT: dict[tuple, int | None] = {}


def _resident(compiled, device: torch.device) -> int:
    r = compiled_resources(compiled)
    return resident_programs(r["registers"], r["shared"], r["num_warps"], Multiprocessor.of(device))
