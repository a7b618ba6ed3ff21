"""Triton device functions shared by the kernels.

Rows are handled in four *pieces*: piece ``p`` of a row holds its elements
``4 i + p`` (``i < d / 4``).  With the little-endian packing of
``oscar_sglang.format``, the four codes of elements ``4i .. 4i+3`` fill one
*word* of ``4 * BITS`` bits, word ``i`` of the packed row, piece ``p`` at bits
``BITS * p``:

* INT2: the word is byte ``i`` (bits ``2p``), the row ``d / 4`` bytes;
* INT4: bytes ``2i, 2i+1`` (piece ``p`` in byte ``2i + p // 2``, bits ``4 (p % 2)``),
  loaded as one little-endian uint16, the row ``d / 2`` bytes;
* INT8: bytes ``4i .. 4i+3`` (piece ``p`` = byte ``4i + p``), one uint32, the row ``d`` bytes.

So every format is unpacked with one load per word and shifts only (no
reshapes, no repeated loads); INT2 keeps its single byte load.  Dot products
and outputs are summed / stored piece by piece, the same math in another
order.  Keys and values each have their own ``BITS`` and group ``G``
(``G`` a multiple of 4, so a word never straddles two groups), and may be
symmetric rows (``SYM``: no stored zero).
"""

import struct

import triton
import triton.language as tl


@triton.jit
def bf16_rne(x):
    """fp32 -> bf16 rounding to nearest-even (the interpreter's own cast truncates)."""
    u = x.to(tl.int32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
    return u.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def round_half_even(y):
    """``torch.round`` semantics for fp32 (ties to even)."""
    f = tl.floor(y)
    r = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (r > 0.5) | ((r == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def load_piece_scale(ptr, row, mask, D: tl.constexpr, G: tl.constexpr, OTHER: tl.constexpr):
    """fp16 scale (or zero) of the groups of piece columns, as fp32 ``[BLOCK_N, D // 4]`` or ``[BLOCK_N, 1]``;
    ``OTHER`` outside ``mask``."""
    NG: tl.constexpr = D // G
    if NG == 1:
        s = tl.load(ptr + row, mask=mask, other=OTHER).to(tl.float32)[:, None]
    else:
        grp = tl.arange(0, D // 4) // (G // 4)
        s = tl.load(ptr + row[:, None] * NG + grp[None, :], mask=mask[:, None], other=OTHER).to(tl.float32)
    return s


@triton.jit
def code_word_ptr(codes_ptr, BITS: tl.constexpr):
    """``codes_ptr`` (uint8) as a pointer to the words of four codes: uint8, uint16 or uint32 for 2, 4, 8 bits.

    Word ``row * (D // 4) + i`` of it holds the codes of elements ``4i .. 4i+3`` of ``row``.
    """
    if BITS == 2:
        return codes_ptr
    elif BITS == 4:
        return codes_ptr.to(tl.pointer_type(tl.uint16))
    else:
        tl.static_assert(BITS == 8, "codes must have 2, 4 or 8 bits")
        return codes_ptr.to(tl.pointer_type(tl.uint32))


@triton.jit
def fetch_rows(codes_ptr, scale_ptr, zero_ptr, row, cold, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
               SYM: tl.constexpr, ALL_CODES: tl.constexpr, NONE: tl.constexpr):
    """The stored (cold) part of rows ``row`` as loaded: code words ``[BLOCK_N, D // 4]`` (int32, four codes
    each) and fp32 scale and zero per piece column (``[BLOCK_N, D // 4]``, or ``[BLOCK_N, 1]`` for one group per
    row).  ``SYM``: symmetric rows, no stored zero (``zero_ptr`` unused): ``zero = -(L / 2) * scale``, exact in
    fp32.  Rows outside ``cold`` read as code 0, scale 0, zero 0; with ``ALL_CODES`` their codes are read as
    stored (every ``row`` must exist: the decode's tokens past the end are slot 0's), which is what the decode
    needs, since a row of scale and zero 0 is 0 whatever its codes and the folded loop gives such rows no weight:
    the mask then only on the scales, in the layout they are loaded in (sm_90, the folded loop: 3-5% fewer
    instructions per block without the codes' mask moved to the codes' layout).  ``NONE``: the scale read outside
    ``cold`` (0, or the folded loop's -1 for its values, which marks a row it gives no weight: a stored scale is
    never negative, so no mask need move to the logits' layout)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    i = tl.arange(0, D // 4)
    if ALL_CODES:
        word = tl.load(code_word_ptr(codes_ptr, BITS) + row[:, None] * (D // 4) + i[None, :])
    else:
        word = tl.load(code_word_ptr(codes_ptr, BITS) + row[:, None] * (D // 4) + i[None, :], mask=cold[:, None],
                       other=0)
    if BITS == 8:
        word = word.to(tl.int32, bitcast=True)  # the top code's bits land in the sign bit: shift, then mask
    else:
        word = word.to(tl.int32)
    scale = load_piece_scale(scale_ptr, row, cold, D, G, NONE)
    if SYM:
        zero = scale * (-0.5 * MASK)
    else:
        zero = load_piece_scale(zero_ptr, row, cold, D, G, 0.0)
    return word, scale, zero


@triton.jit
def code_rows(word, scale, zero, BITS: tl.constexpr):
    """Rows ``zero + code * scale`` as four fp32 pieces ``[BLOCK_N, D // 4]`` from :func:`fetch_rows`' words."""
    MASK: tl.constexpr = (1 << BITS) - 1
    x0 = zero + (word & MASK).to(tl.float32) * scale
    x1 = zero + ((word >> BITS) & MASK).to(tl.float32) * scale
    x2 = zero + ((word >> (2 * BITS)) & MASK).to(tl.float32) * scale
    x3 = zero + ((word >> (3 * BITS)) & MASK).to(tl.float32) * scale
    return x0, x1, x2, x3


@triton.jit
def dequant_rows(word, scale, zero, hot_ptr, hot_row, hot, D: tl.constexpr, BITS: tl.constexpr,
                 HOT_SKIP: tl.constexpr):
    """Rows as four fp32 pieces ``[BLOCK_N, D // 4]`` from :func:`fetch_rows`' words, scale and zero, the BF16
    copy at ``hot_row`` where ``hot``.  ``HOT_SKIP``: the BF16 copies are read only in a block with a hot row
    (one branch per block; a long context's blocks are all cold but the sink's and the recent window's)."""
    x0, x1, x2, x3 = code_rows(word, scale, zero, BITS)
    if HOT_SKIP:
        if tl.max(hot.to(tl.int32), 0) > 0:
            x0, x1, x2, x3 = _hot_pieces(hot_ptr, hot_row, hot, x0, x1, x2, x3, D)
    else:
        x0, x1, x2, x3 = _hot_pieces(hot_ptr, hot_row, hot, x0, x1, x2, x3, D)
    return x0, x1, x2, x3


@triton.jit
def _hot_pieces(hot_ptr, hot_row, hot, x0, x1, x2, x3, D: tl.constexpr):
    """``x`` with the rows in ``hot`` replaced by their BF16 copies at ``hot_row`` (as fp32 pieces)."""
    h0, h1, h2, h3 = load_row_pieces(hot_ptr + hot_row * D, hot, D)
    hm = hot[:, None]
    return tl.where(hm, h0, x0), tl.where(hm, h1, x1), tl.where(hm, h2, x2), tl.where(hm, h3, x3)


@triton.jit
def rotate_rows(x_ptr, mean_ptr, rot_ptr, tmask, HAS_MEAN: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                KC: tl.constexpr, PREC: tl.constexpr):
    """Pieces of ``(x - mean) @ R`` for rows at ``x_ptr[BLOCK_T]`` (row starts; fp32, IEEE dots, ``KC`` input
    columns at a time, small operands, no register spills): the write kernel's keys and values, the decode
    kernel's queries.  ``PREC``: the dots' precision, "ieee" (the write kernel's, for bit-exact codes) or "tf32"
    (tensor cores on a GPU, each product's operands rounded to 10-bit mantissas; the decode's queries, which its
    dots round as much).  Passed by every caller: Triton 3.6 fails on a string constexpr left to its default."""
    i = tl.arange(0, D // 4)
    c = tl.arange(0, KC)
    x0 = tl.zeros([BLOCK_T, D // 4], tl.float32)
    x1 = tl.zeros([BLOCK_T, D // 4], tl.float32)
    x2 = tl.zeros([BLOCK_T, D // 4], tl.float32)
    x3 = tl.zeros([BLOCK_T, D // 4], tl.float32)
    for k0 in tl.static_range(0, D, KC):
        x = tl.load(x_ptr[:, None] + k0 + c[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + k0 + c)[None, :]
        r = rot_ptr + (k0 + c)[:, None] * D + 4 * i[None, :]
        x0 += tl.dot(x, tl.load(r + 0), input_precision=PREC)
        x1 += tl.dot(x, tl.load(r + 1), input_precision=PREC)
        x2 += tl.dot(x, tl.load(r + 2), input_precision=PREC)
        x3 += tl.dot(x, tl.load(r + 3), input_precision=PREC)
    return x0, x1, x2, x3


@triton.jit
def load_row_pieces(ptr, mask, D: tl.constexpr):
    """Four pieces ``[ROWS, D // 4]`` of rows at ``ptr[ROWS]`` (row starts; any float dtype, loaded as fp32; rows
    outside ``mask`` read as 0): the queries, the new keys and values, the hot rows' BF16 copies."""
    i = tl.arange(0, D // 4)
    p = ptr[:, None] + 4 * i[None, :]
    m = mask[:, None]
    q0 = tl.load(p + 0, mask=m, other=0.0).to(tl.float32)
    q1 = tl.load(p + 1, mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(p + 2, mask=m, other=0.0).to(tl.float32)
    q3 = tl.load(p + 3, mask=m, other=0.0).to(tl.float32)
    return q0, q1, q2, q3


@triton.jit
def store_pieces(ptr, mask, x0, x1, x2, x3, D: tl.constexpr):
    """Store four pieces back as rows at ``ptr[ROWS]`` (row starts)."""
    i = tl.arange(0, D // 4)
    p = ptr[:, None] + 4 * i[None, :]
    m = mask[:, None]
    tl.store(p + 0, x0, mask=m)
    tl.store(p + 1, x1, mask=m)
    tl.store(p + 2, x2, mask=m)
    tl.store(p + 3, x3, mask=m)


@triton.jit
def half(x, PREC: tl.constexpr):
    """``x`` as a half-precision dot operand: bf16 for ``PREC == "bf16"``, else fp16."""
    if PREC == "bf16":
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def softmax_step(s, valid, qk_scale, m, l):
    """The online softmax (base 2) over a block's logits ``s [ROWS, BLOCK_N]``: the new running max, the new
    sum, the factor ``alpha`` that rescales what came before, and the block's weights ``p``."""
    s = tl.where(valid, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - base)
    p = tl.exp2(s - base[:, None])
    return m_new, l * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def attend_block(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, qk_scale,
                 m, l, a0, a1, a2, a3, PREC: tl.constexpr):
    """One online-softmax step (base 2) over a key block; ``valid [ROWS, BLOCK_N]`` masks logits.

    ``m`` starts at -inf and ``l`` at 0; a row with no valid key so far keeps
    ``l = 0`` and a zero accumulator (no NaN).

    ``PREC``: the dots' ``input_precision`` for fp32 operands (``"tf32"``,
    ``"ieee"``), or ``"bf16"``: every operand (queries, keys, softmax weights,
    values) rounded to bf16, fp32 accumulation, as in flash attention; on a
    GPU bf16 tensor cores run twice as many products per cycle as TF32 ones;
    ``"fp16"`` the same in fp16 (TF32's 10-bit mantissa; the folded decode's blocks with hot rows).
    The running max, sums and accumulators stay fp32 either way.
    """
    if PREC == "bf16" or PREC == "fp16":
        s = tl.dot(half(q0, PREC), tl.trans(half(k0, PREC)))
        s += tl.dot(half(q1, PREC), tl.trans(half(k1, PREC)))
        s += tl.dot(half(q2, PREC), tl.trans(half(k2, PREC)))
        s += tl.dot(half(q3, PREC), tl.trans(half(k3, PREC)))
    else:
        s = tl.dot(q0, tl.trans(k0), input_precision=PREC)
        s += tl.dot(q1, tl.trans(k1), input_precision=PREC)
        s += tl.dot(q2, tl.trans(k2), input_precision=PREC)
        s += tl.dot(q3, tl.trans(k3), input_precision=PREC)
    m_new, l, alpha, p = softmax_step(s, valid, qk_scale, m, l)
    if PREC == "bf16" or PREC == "fp16":
        ph = half(p, PREC)
        a0 = a0 * alpha[:, None] + tl.dot(ph, half(v0, PREC))
        a1 = a1 * alpha[:, None] + tl.dot(ph, half(v1, PREC))
        a2 = a2 * alpha[:, None] + tl.dot(ph, half(v2, PREC))
        a3 = a3 * alpha[:, None] + tl.dot(ph, half(v3, PREC))
    else:
        a0 = a0 * alpha[:, None] + tl.dot(p, v0, input_precision=PREC)
        a1 = a1 * alpha[:, None] + tl.dot(p, v1, input_precision=PREC)
        a2 = a2 * alpha[:, None] + tl.dot(p, v2, input_precision=PREC)
        a3 = a3 * alpha[:, None] + tl.dot(p, v3, input_precision=PREC)
    return m_new, l, a0, a1, a2, a3


def code_bias(p: int, bits: int) -> float:
    """The bias ``B`` of piece ``p``'s values from :func:`code_values` (``B + c``, exact in fp16): INT2 ``2^(10 -
    2p)`` (the code left in bits ``2p`` of its byte, under an exponent that gives those bits weight 1), wider codes
    1024 (shifted to bits 0)."""
    return float(2 ** (10 - 2 * p)) if bits == 2 else 1024.0


def code_magic(p: int, bits: int) -> int:
    """The fp16 bits of :func:`code_bias` (its mantissa all zeros: OR-ing a code into it adds the code)."""
    return int.from_bytes(struct.pack("<e", code_bias(p, bits)), "little")


def int2_piece_ptx(p: int) -> str:
    """PTX for piece ``p`` of :func:`code_values` with INT2 words, four words (one per byte of ``$2``, word 0 the
    low byte) per call: ``prmt`` spreads bytes 0, 1 (2, 3) to the halves of a register, ``lop3`` ``(t & mask) |
    B`` puts the piece's codes (bits 2p of each byte) in the mantissas of two fp16 ``B = 2^(10 - 2p)``
    (:func:`code_bias`), whose mantissa's bits 2p weigh 1: the halves are ``B + c`` exactly, two codes per
    instruction.  Outputs ``$0``: words 0, 1; ``$1``: words 2, 3, the first word in the low half.  One call per
    piece (not one for all four, whose eight outputs the compiler then moved into the MMA's operand registers;
    the four calls' ``prmt`` are the same instructions and are computed once)."""
    mask = 0x00030003 << (2 * p)
    magic = code_magic(p, 2) * 0x10001  # fp16 2^(10 - 2p) in both halves
    return f"""{{
.reg .b32 t<2>;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
lop3.b32 $0, t0, {mask:#010x}, {magic:#010x}, 0xea;
lop3.b32 $1, t1, {mask:#010x}, {magic:#010x}, 0xea;
}}"""


_INT2_PIECE0_PTX = tl.constexpr(int2_piece_ptx(0))
_INT2_PIECE1_PTX = tl.constexpr(int2_piece_ptx(1))
_INT2_PIECE2_PTX = tl.constexpr(int2_piece_ptx(2))
_INT2_PIECE3_PTX = tl.constexpr(int2_piece_ptx(3))
# code_bias and code_magic inside a kernel: INT2's four pieces, and wider codes' (one for every piece)
_INT2_BIAS0, _INT2_BIAS1, _INT2_BIAS2, _INT2_BIAS3 = (tl.constexpr(code_bias(p, 2)) for p in range(4))
_INT2_MAGIC0, _INT2_MAGIC1, _INT2_MAGIC2, _INT2_MAGIC3 = (tl.constexpr(code_magic(p, 2)) for p in range(4))
_WIDE_BIAS = tl.constexpr(code_bias(0, 8))
_WIDE_MAGIC = tl.constexpr(code_magic(0, 8))
# the folded decode's values' scale of a row it gives no weight (hot, or outside the request): a stored scale is
# never negative (oscar_sglang.format), so the mark travels with the scale and no mask moves to the logits' layout
NO_WEIGHT = tl.constexpr(-1.0)


@triton.jit
def code_biases(BITS: tl.constexpr):
    """:func:`code_bias` of the four pieces, inside a kernel."""
    if BITS == 2:
        return _INT2_BIAS0, _INT2_BIAS1, _INT2_BIAS2, _INT2_BIAS3
    else:
        return _WIDE_BIAS, _WIDE_BIAS, _WIDE_BIAS, _WIDE_BIAS


@triton.jit
def code_values(word, BITS: tl.constexpr, PACKED: tl.constexpr, PURE: tl.constexpr):
    """The codes ``c`` of the four pieces of ``word`` (int32, four codes each) as fp16 values ``B_p + c``, exactly
    (:func:`code_bias`; ``c < 2^BITS <= 256``): each code put in the mantissa of an fp16 power of two by integer
    ops, no int-to-float conversion, the power left for the caller to take off after its dots (INT2: the code
    left in its bits, one operation per code).  ``PACKED`` (INT2 on a GPU): the same in inline PTX
    (:func:`int2_piece_ptx`) two codes per instruction, fp16 pairs as the dots read them; else one code per
    operation (the interpreter cannot run PTX; this is the PTX's reference).  ``PURE``: the PTX declared free of
    side effects (as it is); ``False`` keeps Triton from moving a layout conversion of the values above it: the
    compiler then converts the unpacked fp16 values, not the code bytes (:func:`attend_cold_block_folded`'s
    ``UNPACK_FIRST``)."""
    if PACKED and BITS == 2:
        w8 = word.to(tl.uint8)
        x0 = tl.inline_asm_elementwise(_INT2_PIECE0_PTX, "=r,=r,r", [w8], tl.float16, PURE, 4)
        x1 = tl.inline_asm_elementwise(_INT2_PIECE1_PTX, "=r,=r,r", [w8], tl.float16, PURE, 4)
        x2 = tl.inline_asm_elementwise(_INT2_PIECE2_PTX, "=r,=r,r", [w8], tl.float16, PURE, 4)
        x3 = tl.inline_asm_elementwise(_INT2_PIECE3_PTX, "=r,=r,r", [w8], tl.float16, PURE, 4)
    elif BITS == 2:  # the PTX's values: bits 2p kept under fp16 2^(10 - 2p)
        x0 = ((word & 0x03) | _INT2_MAGIC0).to(tl.int16).to(tl.float16, bitcast=True)
        x1 = ((word & 0x0C) | _INT2_MAGIC1).to(tl.int16).to(tl.float16, bitcast=True)
        x2 = ((word & 0x30) | _INT2_MAGIC2).to(tl.int16).to(tl.float16, bitcast=True)
        x3 = ((word & 0xC0) | _INT2_MAGIC3).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        MASK: tl.constexpr = (1 << BITS) - 1
        x0 = ((word & MASK) | _WIDE_MAGIC).to(tl.int16).to(tl.float16, bitcast=True)
        x1 = (((word >> BITS) & MASK) | _WIDE_MAGIC).to(tl.int16).to(tl.float16, bitcast=True)
        x2 = (((word >> (2 * BITS)) & MASK) | _WIDE_MAGIC).to(tl.int16).to(tl.float16, bitcast=True)
        x3 = (((word >> (3 * BITS)) & MASK) | _WIDE_MAGIC).to(tl.int16).to(tl.float16, bitcast=True)
    return x0, x1, x2, x3


@triton.jit
def attend_affine_t(k0, k1, k2, k3, ks, kz, v0, v1, v2, v3, vs, qt0, qt1, qt2, qt3, qsum, kbias, valid, m,
                    o0, o1, o2, o3, K_ZERO: tl.constexpr):
    """One online-softmax step (base 2), transposed, over rows ``scale x + zero`` given by fp16 pieces ``x``
    (``k0..k3``, ``v0..v3``: ``[BLOCK_N, D // 4]``) and per-row ``ks, kz, vs`` (``[BLOCK_N, 1]``; the values' zeros
    are the caller's: ``sum_t p_t zero_t``).  The queries are the dots' right operand, ``qt0..qt3`` ``[D // 4,
    H]`` fp16, the softmax's scale (base 2) already in them (``qsum [H]`` the sum of their values), and so are the
    weights for the outputs ``o0..o3`` ``[D // 4, H]``: the group's few query heads fill the MMA's 8-wide side
    instead of being padded to its 16 rows.

    * logits ``k_t . q = ks_t (x_t . q - kbias) + kz_t sum(q)`` (``kbias [H]``: what the keys' biases add to
      the dots, :func:`folded_bias`; ``K_ZERO``: whether ``kz`` is added, else it is in ``kbias``),
      ``valid [BLOCK_N, 1]``;
    * outputs ``o += x^T ps``, ``ps = p vs`` rounded to fp16 (fp32 sums).

    Returns the new running max ``[H]``, the factor ``alpha [1, H]`` that rescaled what came before, the
    weights ``p`` and ``ps`` ``[BLOCK_N, H]`` and the outputs."""
    s = tl.dot(k0, qt0)
    s += tl.dot(k1, qt1)
    s += tl.dot(k2, qt2)
    s += tl.dot(k3, qt3)
    if K_ZERO:
        s = tl.where(valid, (s - kbias[None, :]) * ks + kz * qsum[None, :], float("-inf"))
    else:
        s = tl.where(valid, (s - kbias[None, :]) * ks, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 0))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - base)[None, :]
    p = tl.exp2(s - base[None, :])
    ps = (p * vs).to(tl.float16)
    o0 = o0 * alpha + tl.dot(tl.trans(v0), ps)
    o1 = o1 * alpha + tl.dot(tl.trans(v1), ps)
    o2 = o2 * alpha + tl.dot(tl.trans(v2), ps)
    o3 = o3 * alpha + tl.dot(tl.trans(v3), ps)
    return m_new, alpha, p, ps, o0, o1, o2, o3


@triton.jit
def folded_bias(q0, q1, q2, q3, K_BITS: tl.constexpr, K_SYM: tl.constexpr):
    """The folded loop's sums of its fp16 queries' pieces ``[H, D // 4]``: ``qsum [H]``, and ``kbias [H]``, what the
    biased key codes (:func:`code_values`, ``B_p + c``) add to a dot, ``sum_p B_p sum(q_p)``, plus for symmetric
    keys their implied zero's share (zero ``-(L / 2)`` scale: ``(L / 2) sum(q)``, so that the logits need no
    zero term)."""
    b0, b1, b2, b3 = code_biases(K_BITS)
    s0 = tl.sum(q0.to(tl.float32), 1)
    s1 = tl.sum(q1.to(tl.float32), 1)
    s2 = tl.sum(q2.to(tl.float32), 1)
    s3 = tl.sum(q3.to(tl.float32), 1)
    qsum = s0 + s1 + s2 + s3
    kbias = b0 * s0 + b1 * s1 + b2 * s2 + b3 * s3
    if K_SYM:
        kbias += (0.5 * ((1 << K_BITS) - 1)) * qsum
    return qsum, kbias


@triton.jit
def folded_sums(lt, zt, wt, o0, o1, o2, o3, V_BITS: tl.constexpr, V_SYM: tl.constexpr):
    """The end of a folded loop: the softmax's sum ``l [H]`` from its rows ``lt``, and the outputs as ``[H, D //
    4]`` pieces, the values' biases taken off (:func:`code_values`: the dots summed ``(B_p + c) ps``, so piece
    ``p`` less ``B_p`` times the weights' sum, from its rows ``wt``) and their zeros added: from the rows ``zt``
    (``sum_t p_t zero_t``), or for symmetric values ``-(L / 2)`` times the weights' sum.
    """
    w = tl.sum(wt, 0)[None, :]
    b0, b1, b2, b3 = code_biases(V_BITS)
    if V_SYM:
        half: tl.constexpr = 0.5 * ((1 << V_BITS) - 1)
        o0, o1, o2, o3 = o0 - (b0 + half) * w, o1 - (b1 + half) * w, o2 - (b2 + half) * w, o3 - (b3 + half) * w
    else:
        z = tl.sum(zt, 0)[None, :]
        o0, o1, o2, o3 = o0 - b0 * w + z, o1 - b1 * w + z, o2 - b2 * w + z, o3 - b3 * w + z
    return tl.sum(lt, 0), tl.trans(o0), tl.trans(o1), tl.trans(o2), tl.trans(o3)


@triton.jit
def _weight_before(b, hs, r0, HOT_WEIGHT: tl.constexpr):
    """The weight of a request's blocks ``[0, b)``: 4 per block, ``HOT_WEIGHT`` for those of the windows."""
    return 4 * b + (HOT_WEIGHT - 4) * (tl.minimum(b, hs) + tl.maximum(b - r0, 0))


@triton.jit
def weighted_boundary(sp, NUM_SPLITS, nb, hs, r0, HOT_WEIGHT: tl.constexpr):
    """The first block of split ``sp`` of the cut weighted by work (``kernels/decode/split_cut._boundary``, its
    reference): the block boundary whose weight before it is nearest ``sp / NUM_SPLITS`` of the request's, the
    weight piecewise linear in the boundary (slopes ``HOT_WEIGHT``, 4, ``HOT_WEIGHT`` over the sink's blocks
    ``[0, hs)``, the cold ones, the recent window's ``[r0, nb)``), so inverted piece by piece; int64 scalars."""
    target = sp * _weight_before(nb, hs, r0, HOT_WEIGHT)
    b = tl.cdiv(target, NUM_SPLITS * HOT_WEIGHT)
    if b > hs:
        b = tl.cdiv(target - NUM_SPLITS * (HOT_WEIGHT - 4) * hs, NUM_SPLITS * 4)
        if b > r0:
            b = tl.cdiv(target + NUM_SPLITS * (HOT_WEIGHT - 4) * (r0 - hs), NUM_SPLITS * HOT_WEIGHT)
    if b > 0:
        if target - NUM_SPLITS * _weight_before(b - 1, hs, r0, HOT_WEIGHT) < \
                NUM_SPLITS * _weight_before(b, hs, r0, HOT_WEIGHT) - target:
            b = b - 1
    return b


@triton.jit
def program_split(seq_lens, req_pool_indices, NUM_SPLITS, hot_sink, hot_recent, BLOCK_N: tl.constexpr,
                  HOT_WEIGHT: tl.constexpr):
    """A split-K decode program's request ``b``, KV head ``kvh``, split ``sp`` (grid ``(batch, kv_heads,
    splits)``), the request's pool row ``req`` (int64) and its tokens ``[start, end)``, runs of whole ``BLOCK_N``
    blocks (reference: ``kernels/decode/split_cut.split_bounds``).  ``HOT_WEIGHT`` 0: the even cut,
    ``ceil(seq_len / NUM_SPLITS)`` tokens rounded up to whole blocks; else cut by work, a block of the request's
    first ``hot_sink`` or last ``hot_recent`` tokens (where its hot rows are, a hint) weighing ``HOT_WEIGHT``
    quarters of a cold block (:func:`weighted_boundary`).  The last splits may be empty; they start at the
    request's end, so that a loop from ``start`` or up to it (the hot blocks' loop runs from the first hot block
    to the last, ``start - BLOCK_N`` when there is none) has nothing to do there: until 2026-12-05 they started
    past it, and an empty split's hot loop stepped through every block between the request's end and its own
    start (at batch 1, 32k, whole waves of 99 splits: 13 empty ones, the last ~76 blocks)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    req = tl.load(req_pool_indices + b).to(tl.int64)
    if HOT_WEIGHT == 0:
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = tl.minimum(sp * per_split, seq_len)
        end = tl.minimum(start + per_split, seq_len)
    else:
        n = seq_len.to(tl.int64)
        zero = n * 0  # int64 scalars (an int argument of 1 reaches a kernel as a constant, not a tensor)
        nb = tl.cdiv(n, BLOCK_N)
        hs = tl.minimum(nb, tl.cdiv(zero + hot_sink, BLOCK_N))
        recent = zero + hot_recent
        r0 = tl.where(recent > 0, tl.maximum(hs, tl.maximum(n - recent, 0) // BLOCK_N), nb)
        splits = zero + NUM_SPLITS
        part = zero + sp
        start = tl.minimum(weighted_boundary(part, splits, nb, hs, r0, HOT_WEIGHT) * BLOCK_N, n).to(tl.int32)
        end = tl.minimum(weighted_boundary(part + 1, splits, nb, hs, r0, HOT_WEIGHT) * BLOCK_N, n).to(tl.int32)
    return b, kvh, sp, req, start, end


@triton.jit
def block_slots(t, tmask, tok_row_ptr):
    """Slots of a request's tokens ``t`` (its ``req_to_token`` row at ``tok_row_ptr``), int64; 0 outside ``tmask``."""
    return tl.load(tok_row_ptr + t, mask=tmask, other=0).to(tl.int64)


@triton.jit
def slot_entries(slot, tmask, hot_index):
    """Hot entries of ``slot`` (-1: none, or outside ``tmask``), int64."""
    return tl.load(hot_index + slot, mask=tmask, other=-1).to(tl.int64)


@triton.jit
def fetch_block(slot, entry, tmask, kvh, KV, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                D: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr,
                K_SYM: tl.constexpr, V_SYM: tl.constexpr, FOLD: tl.constexpr):
    """The stored parts of a block's keys and values (:func:`fetch_rows`, every row's codes, the scales and
    zeros of its cold rows only), for a decode loop that loads the next block while it computes this one.
    ``FOLD``: the values' scale of a row not cold is -1 (:data:`NO_WEIGHT`), the folded loop's mark of a row it
    gives no weight, else 0."""
    cold = tmask & (entry < 0)
    row = slot * KV + kvh
    kw, ks, kz = fetch_rows(k_codes, k_scale, k_zero, row, cold, D, K_G, K_BITS, K_SYM, True, 0.0)
    vw, vs, vz = fetch_rows(v_codes, v_scale, v_zero, row, cold, D, V_G, V_BITS, V_SYM, True,
                            NO_WEIGHT if FOLD else 0.0)
    return kw, ks, kz, vw, vs, vz


@triton.jit
def attend_fetched_block(entry, tmask, kvh, KV, kw, ks, kz, vw, vs, vz, k_hot, v_hot,
                         q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3,
                         D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, PREC: tl.constexpr,
                         HOT_SKIP: tl.constexpr):
    """One online-softmax step over a block fetched by :func:`fetch_block` (its hot rows read here)."""
    hot = tmask & (entry >= 0)
    hot_row = entry * KV + kvh
    k0, k1, k2, k3 = dequant_rows(kw, ks, kz, k_hot, hot_row, hot, D, K_BITS, HOT_SKIP)
    v0, v1, v2, v3 = dequant_rows(vw, vs, vz, v_hot, hot_row, hot, D, V_BITS, HOT_SKIP)
    return attend_block(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, tmask[None, :], qk_scale,
                        m, l, a0, a1, a2, a3, PREC)


@triton.jit
def attend_cold_block(kw, ks, kz, vw, vs, vz, tmask, q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3,
                      K_BITS: tl.constexpr, V_BITS: tl.constexpr, PREC: tl.constexpr):
    """:func:`attend_fetched_block` for a block without a hot row: no BF16 copy read, nor its code compiled in
    (a block with one goes to :func:`attend_hot_block`, in a loop of its own)."""
    k0, k1, k2, k3 = code_rows(kw, ks, kz, K_BITS)
    v0, v1, v2, v3 = code_rows(vw, vs, vz, V_BITS)
    return attend_block(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, tmask[None, :], qk_scale,
                        m, l, a0, a1, a2, a3, PREC)


@triton.jit
def fetch_part(t0, end, tok_row_ptr, hot_index, kvh, KV, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
               D: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr,
               K_SYM: tl.constexpr, V_SYM: tl.constexpr, ROWS: tl.constexpr):
    """Tokens ``t0 + arange(ROWS)`` of a request (``< end``): their mask, hot entries and stored parts
    (:func:`fetch_block`), looked up afresh (the hot blocks' loops)."""
    t = t0 + tl.arange(0, ROWS)
    tm = t < end
    slot = block_slots(t, tm, tok_row_ptr)
    ent = slot_entries(slot, tm, hot_index)
    kw, ks, kz, vw, vs, vz = fetch_block(slot, ent, tm, kvh, KV, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                         D, K_BITS, K_G, V_BITS, V_G, K_SYM, V_SYM, False)
    return tm, ent, kw, ks, kz, vw, vs, vz


@triton.jit
def attend_hot_block(n0, end, tok_row_ptr, hot_index, kvh, KV, k_hot, v_hot, q0, q1, q2, q3, qk_scale,
                     m, l, a0, a1, a2, a3, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                     D: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, V_BITS: tl.constexpr,
                     V_G: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_N: tl.constexpr, HOT_ROWS: tl.constexpr = 16):
    """The decode loop's step over a block with a hot row, tokens ``n0 + arange(BLOCK_N)`` (``< end``):
    ``HOT_ROWS`` tokens at a time (a loop, not unrolled) looked up and fetched again, dequantized with the BF16
    copies where hot (:func:`attend_fetched_block`'s step).  In a loop of its own after the cold blocks', as
    :func:`attend_hot_block_folded`: inside the cold loop, with that loop's loads ahead live, this rare branch
    sets the kernel's registers (sm_90, d 128 INT2: 220 with triton 3.8, 255 and a 184-byte stack with 3.6;
    200 and 168 in a loop of their own, ``decode_attention(hot_loop=True)``)."""
    for j in range(0, BLOCK_N, HOT_ROWS):
        tm, ent, hkw, hks, hkz, hvw, hvs, hvz = fetch_part(n0 + j, end, tok_row_ptr, hot_index, kvh, KV, k_codes,
                                                           k_scale, k_zero, v_codes, v_scale, v_zero, D, K_BITS,
                                                           K_G, V_BITS, V_G, K_SYM, V_SYM, HOT_ROWS)
        m, l, a0, a1, a2, a3 = attend_fetched_block(ent, tm, kvh, KV, hkw, hks, hkz, hvw, hvs, hvz, k_hot, v_hot,
                                                    q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3, D, K_BITS,
                                                    V_BITS, PREC, False)
    return m, l, a0, a1, a2, a3


@triton.jit
def attend_cold_block_folded(kw, ks, kz, vw, vs, vz, qt0, qt1, qt2, qt3, qsum, kbias, m, lt, zt,
                             wt, o0, o1, o2, o3, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_SYM: tl.constexpr,
                             V_SYM: tl.constexpr, PACKED: tl.constexpr, UNPACK_FIRST: tl.constexpr):
    """:func:`attend_fetched_block` over a block's cold rows (in the request, without a hot copy: those whose
    values' scale ``vs`` is not :data:`NO_WEIGHT`, :func:`fetch_block` with ``FOLD``), of rows of
    one scale and zero each (the decode's ``fold``), transposed (:func:`attend_affine_t`, the queries scaled for
    the softmax): the dots read the codes themselves, biased
    (:func:`code_values`: ``B_p + c`` in fp16, exact; INT2's PTX one instruction per two codes), each row's
    scale and zero folded in where they are constant (``scale c + zero``).  What the keys' biases add to the
    logits is taken off them (``kbias``, :func:`folded_bias`, with symmetric keys' implied zero); the softmax's
    sum, the values' weights (``ps``, for their biases) and, unless symmetric, their zeros' term are kept per
    row, ``lt``, ``wt`` and ``zt`` ``[BLOCK_N, H]`` (rescaled as the outputs), and summed once at the end
    (:func:`folded_sums`), so that a block reduces across warps for its maximum only.  Every block comes here,
    without a branch: the hot rows are :func:`attend_hot_block_folded`'s, in a loop of their own.

    The values' dots read their codes transposed (``[D // 4, BLOCK_N]``, two tokens per fp16 pair), which on a GPU
    means a trip through shared memory.  By default Triton makes it with the code bytes, before they are
    unpacked (byte shuffles, sm_90: ~50 ``PRMT`` and 16 shared loads and stores per block and warp);
    ``UNPACK_FIRST`` (with ``PACKED``) makes it with the unpacked fp16 values (``ldmatrix.trans``: 8 times the
    bytes through shared memory, far fewer instructions), by declaring the values' PTX impure (:func:`code_values`)."""
    k0, k1, k2, k3 = code_values(kw, K_BITS, PACKED, True)
    v0, v1, v2, v3 = code_values(vw, V_BITS, PACKED, not UNPACK_FIRST)
    m, alpha, p, ps, o0, o1, o2, o3 = attend_affine_t(k0, k1, k2, k3, ks, kz, v0, v1, v2, v3, vs,
                                                      qt0, qt1, qt2, qt3, qsum, kbias, vs != NO_WEIGHT, m,
                                                      o0, o1, o2, o3, not K_SYM)
    lt = lt * alpha + p
    wt = wt * alpha + ps.to(tl.float32)
    if not V_SYM:
        zt = zt * alpha + p * vz
    return m, lt, zt, wt, o0, o1, o2, o3


@triton.jit
def attend_hot_block_folded(n0, end, tok_row_ptr, hot_index, kvh, KV, k_hot, v_hot, qt0, qt1, qt2, qt3, qsum,
                            m, lt, zt, wt, o0, o1, o2, o3, D: tl.constexpr, BLOCK_N: tl.constexpr,
                            HOT_ROWS: tl.constexpr = 16):
    """The folded loop's hot rows in a block that has some, tokens ``n0 + arange(BLOCK_N)`` (``< end``), whose
    other rows :func:`attend_cold_block_folded` attended: ``HOT_ROWS`` tokens at a time (a loop, not unrolled)
    looked up again, their BF16 copies read and attended in fp16 as there (scale 1, zero 0, no biases: ``wt``
    and ``zt`` only rescaled), each part's sum put in row 0 of ``lt``.  In a loop of its own after the cold
    loop and one part at a time: the kernel is allocated registers for its largest need, and this rare branch
    inside the cold loop, with that loop's loads ahead live, had set it (sm_90, d 128, triton 3.8: 255
    registers, 8 warps per multiprocessor, at 2 and at 4 warps; 167 and 128 since)."""
    first = (tl.arange(0, BLOCK_N) == 0)[:, None]
    one = tl.full([HOT_ROWS, 1], 1.0, tl.float32)
    for j in range(0, BLOCK_N, HOT_ROWS):
        t = n0 + j + tl.arange(0, HOT_ROWS)
        tm = t < end
        ent = slot_entries(block_slots(t, tm, tok_row_ptr), tm, hot_index)
        hot = tm & (ent >= 0)
        x0, x1, x2, x3 = load_row_pieces(k_hot + (ent * KV + kvh) * D, hot, D)
        y0, y1, y2, y3 = load_row_pieces(v_hot + (ent * KV + kvh) * D, hot, D)
        m, part_alpha, part_p, _, o0, o1, o2, o3 = attend_affine_t(
            x0.to(tl.float16), x1.to(tl.float16), x2.to(tl.float16), x3.to(tl.float16), one, tl.zeros_like(one),
            y0.to(tl.float16), y1.to(tl.float16), y2.to(tl.float16), y3.to(tl.float16), one,
            qt0, qt1, qt2, qt3, qsum, tl.zeros_like(qsum), hot[:, None], m, o0, o1, o2, o3, False)
        lt = lt * part_alpha + tl.where(first, tl.sum(part_p, 0)[None, :], 0.0)
        zt = zt * part_alpha
        wt = wt * part_alpha
    return m, lt, zt, wt, o0, o1, o2, o3


@triton.jit
def attend_stored_block(t, tmask, tok_row_ptr, hot_index, kvh, KV,
                        k_codes, k_scale, k_zero, k_hot, v_codes, v_scale, v_zero, v_hot,
                        q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3,
                        D: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, V_BITS: tl.constexpr,
                        V_G: tl.constexpr, PREC: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
                        HOT_SKIP: tl.constexpr):
    """One online-softmax step over stored tokens ``t`` of a request (``tok_row_ptr`` = its
    ``req_to_token`` row): slot lookup, BF16 where the slot has a hot entry, quantized rows elsewhere
    (keys ``K_BITS`` bits in groups of ``K_G``, values ``V_BITS`` / ``V_G``; ``K_SYM``/``V_SYM``: symmetric rows)."""
    slot = block_slots(t, tmask, tok_row_ptr)
    entry = slot_entries(slot, tmask, hot_index)
    kw, ks, kz, vw, vs, vz = fetch_block(slot, entry, tmask, kvh, KV, k_codes, k_scale, k_zero, v_codes, v_scale,
                                         v_zero, D, K_BITS, K_G, V_BITS, V_G, K_SYM, V_SYM, False)
    return attend_fetched_block(entry, tmask, kvh, KV, kw, ks, kz, vw, vs, vz, k_hot, v_hot,
                                q0, q1, q2, q3, qk_scale, m, l, a0, a1, a2, a3, D, K_BITS, V_BITS, PREC, HOT_SKIP)
