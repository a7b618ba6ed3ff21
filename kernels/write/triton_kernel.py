"""Write kernel: rotate, clip, quantize and scatter new K/V rows in one launch per layer.

Grid ``(cdiv(n, BLOCK_T), kv_heads, 2)``; a program takes ``BLOCK_T`` tokens of
one KV head, their keys or their values (the third axis: a decode step's few
tokens are two rotations in parallel, not one after the other; since
2026-12-05), computes ``x' = (x - mu) R`` piece by piece with fp32 (IEEE)
dots over ``KC`` input channels at a time (small operands, no register
spills), and writes codes, fp16 scale/zero and, for tokens with a hot entry,
the BF16 rotated rows.  Nothing intermediate touches global memory.

Keys and values each have their own format (constexprs ``K_BITS``/``K_G``,
``V_BITS``/``V_G``; bits in {2, 4, 8}): max code ``L = 2^BITS - 1``, ``fp16``
scale ``= fp16(div_rn(hi - fp16(lo), L))``, round-half-even codes against the
stored fp16 values, exactly as ``oscar_sglang.format.quantize`` (symmetric
rows, ``K_SYM``/``V_SYM``: ``scale = fp16(2 r max|x| / L)``, no zero stored).  The four
codes of elements ``4i .. 4i+3`` are packed into word ``i`` of the row (one
byte for INT2, a little-endian uint16 for INT4, a uint32 for INT8; see
``common/triton_helpers.py``) and stored with one store per word.

Compiled without floating-point contraction (``enable_fp_fusion=False``): with
it the GPU fused ``mid - half`` and ``x - 1.5 scale`` into FMAs, one rounding
fewer than torch's, and a few codes of the first H200 run (2026-12-04) sat on
the other side of a rounding edge from the reference's.
"""

import torch
import triton
import triton.language as tl

from ..common.triton_helpers import bf16_rne, code_word_ptr, rotate_rows, round_half_even
from ..layout import DeviceRotation, LayerStore, require_contiguous, triton_unsupported


@triton.jit
def _codes(x, a, b, z, inv, TOP: tl.constexpr):
    """Codes ``0..TOP`` for clip bounds ``[a, b]``, fp16 zero ``z`` and ``inv = 1 / scale`` (0 if scale is 0)."""
    xc = tl.minimum(tl.maximum(x, a), b)
    c = round_half_even((xc - z) * inv)
    return tl.minimum(tl.maximum(c, 0.0), TOP * 1.0).to(tl.int32)


@triton.jit
def _masked_min(x, in_g):
    return tl.min(tl.where(in_g, x, float("inf")), 1)


@triton.jit
def _masked_max(x, in_g):
    return tl.max(tl.where(in_g, x, float("-inf")), 1)


@triton.jit
def _quantize_store(x0, x1, x2, x3, clip, codes_ptr, scale_ptr, zero_ptr, hot_ptr, row, hot_row, tmask, hmask,
                    HAS_HOT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                    SYM: tl.constexpr):
    """Store rotated rows (four pieces ``[BLOCK_T, D // 4]``) as ``BITS``-bit codes in groups of ``G`` at
    ``row``, BF16 copies at ``hot_row``; ``SYM``: symmetric rows (scale only, ``zero_ptr`` unused)."""
    NG: tl.constexpr = D // G
    TOP: tl.constexpr = (1 << BITS) - 1
    i = tl.arange(0, D // 4)
    if HAS_HOT:
        hp = hot_ptr + hot_row[:, None] * D + 4 * i[None, :]
        hm = hmask[:, None]
        tl.store(hp + 0, bf16_rne(x0), mask=hm)
        tl.store(hp + 1, bf16_rne(x1), mask=hm)
        tl.store(hp + 2, bf16_rne(x2), mask=hm)
        tl.store(hp + 3, bf16_rne(x3), mask=hm)
    grp = i // (G // 4)
    a_col = tl.zeros_like(x0)
    b_col = tl.zeros_like(x0)
    z_col = tl.zeros_like(x0)
    inv_col = tl.zeros_like(x0)
    for gi in tl.static_range(NG):
        in_g = (grp == gi)[None, :]
        lo = tl.minimum(tl.minimum(_masked_min(x0, in_g), _masked_min(x1, in_g)),
                        tl.minimum(_masked_min(x2, in_g), _masked_min(x3, in_g)))
        hi = tl.maximum(tl.maximum(_masked_max(x0, in_g), _masked_max(x1, in_g)),
                        tl.maximum(_masked_max(x2, in_g), _masked_max(x3, in_g)))
        if SYM:
            # Clip about 0 (largest magnitude times the ratio); codes beyond saturate: oscar_sglang.format.quantize.
            mag = tl.maximum(-lo, hi) * clip
            a = tl.full(mag.shape, float("-inf"), tl.float32)
            b = tl.full(mag.shape, float("inf"), tl.float32)
            s16 = (mag * (2.0 / TOP)).to(tl.float16)
            sf = s16.to(tl.float32)
            zf = sf * (-0.5 * TOP)
        else:
            # Clip about the midpoint, exactly as oscar_sglang.format.clip_groups.
            mid = (hi + lo) * 0.5
            half = (hi - lo) * 0.5 * clip
            a = mid - half
            b = mid + half
            lo = tl.minimum(tl.maximum(lo, a), b)
            hi = tl.minimum(tl.maximum(hi, a), b)
            z16 = lo.to(tl.float16)
            zf = z16.to(tl.float32)
            s16 = tl.maximum(tl.math.div_rn(hi - zf, TOP * 1.0), 0.0).to(tl.float16)
            sf = s16.to(tl.float32)
            tl.store(zero_ptr + row * NG + gi, z16, mask=tmask)
        inv = tl.where(sf > 0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), tl.where(sf > 0, sf, 1.0)), 0.0)
        tl.store(scale_ptr + row * NG + gi, s16, mask=tmask)
        a_col = tl.where(in_g, a[:, None], a_col)
        b_col = tl.where(in_g, b[:, None], b_col)
        z_col = tl.where(in_g, zf[:, None], z_col)
        inv_col = tl.where(in_g, inv[:, None], inv_col)
    word = _codes(x0, a_col, b_col, z_col, inv_col, TOP)
    word |= _codes(x1, a_col, b_col, z_col, inv_col, TOP) << BITS
    word |= _codes(x2, a_col, b_col, z_col, inv_col, TOP) << (2 * BITS)
    word |= _codes(x3, a_col, b_col, z_col, inv_col, TOP) << (3 * BITS)
    if BITS == 2:
        word = word.to(tl.uint8)
    elif BITS == 4:
        word = word.to(tl.uint16)
    else:
        word = word.to(tl.uint32, bitcast=True)
    tl.store(code_word_ptr(codes_ptr, BITS) + row[:, None] * (D // 4) + i[None, :], word, mask=tmask[:, None])


@triton.jit
def _write_kernel(k_ptr, v_ptr, slot_ptr, hot_loc_ptr,
                  k_rot, v_rot, k_mean, k_clip, v_clip,
                  k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_hot, v_hot,
                  n, KV, stride_kt, stride_kh, stride_vt, stride_vh,
                  HAS_HOT: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                  K_BITS: tl.constexpr, K_G: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr,
                  KC: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n
    slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
    if HAS_HOT:
        entry = tl.load(hot_loc_ptr + t, mask=tmask, other=-1).to(tl.int64)
    else:
        entry = tl.full([BLOCK_T], -1, tl.int64)
    hmask = tmask & (entry >= 0)
    row = slot * KV + h
    hot_row = entry * KV + h
    t64 = t.to(tl.int64)
    if tl.program_id(2) == 0:  # keys and values in programs of their own: half the serial chain of a few tokens
        x0, x1, x2, x3 = rotate_rows(k_ptr + t64 * stride_kt + h * stride_kh, k_mean + h * D, k_rot + h * D * D,
                                     tmask, True, BLOCK_T, D, KC, "ieee")
        _quantize_store(x0, x1, x2, x3, tl.load(k_clip + h), k_codes, k_scale, k_zero, k_hot,
                        row, hot_row, tmask, hmask, HAS_HOT, D, K_G, K_BITS, K_SYM)
    else:
        x0, x1, x2, x3 = rotate_rows(v_ptr + t64 * stride_vt + h * stride_vh, k_mean, v_rot + h * D * D, tmask,
                                     False, BLOCK_T, D, KC, "ieee")
        _quantize_store(x0, x1, x2, x3, tl.load(v_clip + h), v_codes, v_scale, v_zero, v_hot,
                        row, hot_row, tmask, hmask, HAS_HOT, D, V_G, V_BITS, V_SYM)


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, store: LayerStore, rot: DeviceRotation,
             hot_loc: torch.Tensor | None = None, block_t: int = 16, num_warps: int = 4, kc: int = 32) -> None:
    """Triton version of :func:`oscar_sglang.kernels.write.reference.write_kv` (same arguments).

    ``kc``: input channels per step of the rotation's dots (a power of two, 16 to d). 32, the default, compiles
    to 128 registers on sm_90 with Triton 3.8; 16 avoids the spill that 32 has on sm_89 with 3.8 and on sm_90
    with 3.9 (docs/KERNELS.md, "Triton 3.9"), which the kernel benchmark times side by side."""
    n = k.shape[0]
    kv, d, kf, vf = store.kv_heads, store.head_dim, store.k_format, store.v_format
    if n == 0:
        return
    require_contiguous(store, rot)
    k = k.reshape(n, kv, d)
    v = v.reshape(n, kv, d)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v rows must be contiguous"
    assert (problem := triton_unsupported(d, kf, vf)) is None, problem
    assert block_t >= 16, "tl.dot needs at least 16 rows"
    if not (16 <= kc <= d and kc & (kc - 1) == 0):
        raise ValueError(f"kc must be a power of two from 16 (tl.dot's least) to head_dim {d}, got {kc}")
    _write_kernel[(triton.cdiv(n, block_t), kv, 2)](
        k, v, slots, hot_loc if hot_loc is not None else slots,
        rot.k_rot, rot.v_rot, rot.k_mean, rot.k_clip, rot.v_clip,
        *store.row_args(), store.k_hot, store.v_hot,
        n, kv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HAS_HOT=hot_loc is not None, BLOCK_T=block_t, D=d, K_BITS=kf.bits, K_G=kf.group, V_BITS=vf.bits,
        V_G=vf.group, KC=kc, K_SYM=kf.symmetric, V_SYM=vf.symmetric, num_warps=num_warps,
        enable_fp_fusion=False,  # no a*b+c -> fma: codes bit-equal to the torch reference's (clip, symmetric zero)
    )
