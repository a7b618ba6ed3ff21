"""The inline PTX that unpacks INT2 codes for the folded decode (``triton_helpers.int2_piece_ptx``), executed
here by a small model of its two instructions (PTX ISA semantics of ``prmt.b32`` and ``lop3.b32``), against the
codes read from the bytes directly.  The interpreter cannot run PTX, so this is
what proves the string's arithmetic on a machine without a GPU; the kernel tests prove it natively on CUDA."""

import re

import numpy as np

from oscar_sglang.kernels.common import triton_helpers


def _prmt(a, b, sel):
    """``prmt.b32 d, a, b, c`` (default mode): byte k of d is byte ``c[4k:4k+4] & 7`` of the 8 bytes ``{b, a}``
    (a the low four); a selector's bit 3 (sign replication) is not used by the PTX under test."""
    pool = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a)
    for k in range(4):
        nib = (sel >> (4 * k)) & 0xF
        assert nib < 8, "sign-replicating selectors are not modelled"
        byte = (pool >> np.uint64(8 * nib)) & np.uint64(0xFF)
        out |= (byte.astype(np.uint32) << np.uint32(8 * k))
    return out


def _lop3(a, b, c, lut):
    """``lop3.b32 d, a, b, c, immLut``: each result bit is ``immLut``'s bit at index ``4 a + 2 b + c`` of the inputs'
    bits (``immLut = F(0xF0, 0xCC, 0xAA)``)."""
    out = np.zeros_like(a)
    for idx in range(8):
        if (lut >> idx) & 1:
            ma = a if idx & 4 else ~a
            mb = b if idx & 2 else ~b
            mc = c if idx & 1 else ~c
            out |= ma & mb & mc
    return out


def _halves(x):
    return (x & 0xFFFF).astype(np.uint16).view(np.float16), (x >> 16).astype(np.uint16).view(np.float16)


def run_ptx(text: str, inputs: dict) -> dict:
    """Execute the PTX block ``text`` over numpy uint32 registers (``inputs``: ``$n`` -> array); returns them all."""
    regs = dict(inputs)

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full_like(next(iter(inputs.values())), int(tok, 0), dtype=np.uint32)

    for stmt in text.replace("\n", " ").split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), int(args[3], 0))
        elif op == "lop3.b32":
            regs[args[0]] = _lop3(val(args[1]), val(args[2]), val(args[3]), int(args[4], 0))
        else:
            raise AssertionError(f"instruction not modelled: {op}")
    return regs


def test_int2_codes_ptx_gives_every_code_of_four_bytes_exactly():
    """Four bytes (words 0..3, word 0 the low byte) in ``$2``: the PTX of piece p must give, in output ``$(w //
    2)``, half ``w % 2``, the code of piece p of word w, ``(byte >> 2p) & 3``, as an fp16 value, for every byte
    value in every place, plus ``2^(10 - 2p)`` (``code_bias``: the folded decode takes it off after its dots).
    (That placement is Triton's packing for ``pack=4``, read in its LLVM IR: the input an
    ``i32`` bitcast to ``<4 x i8>``, the output two ``<2 x half>``, element 0 the low half.)  The kernel uses
    the same strings (the ``tl.constexpr`` globals)."""
    rng = np.random.default_rng(0)
    b = np.arange(256, dtype=np.uint32)
    words = np.concatenate([b, b << 8, b << 16, b << 24, b * 0x01010101,
                            rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)])
    kernel_ptx = (triton_helpers._INT2_PIECE0_PTX, triton_helpers._INT2_PIECE1_PTX,
                  triton_helpers._INT2_PIECE2_PTX, triton_helpers._INT2_PIECE3_PTX)
    for p in range(4):
        ptx = triton_helpers.int2_piece_ptx(p)
        assert kernel_ptx[p].value == ptx
        assert set(re.findall(r"\$(\d+)", ptx)) == {"0", "1", "2"}
        bias = triton_helpers.code_bias(p, 2)
        assert bias == 2.0 ** (10 - 2 * p) and triton_helpers.code_bias(p, 4) == 1024.0
        regs = run_ptx(ptx, {"$2": words})
        for w in range(4):
            got = _halves(regs[f"${w // 2}"])[w % 2].astype(np.float64)
            want = ((words >> (8 * w + 2 * p)) & 3).astype(np.float64) + bias
            assert np.array_equal(got, want), (p, w)


def test_ptx_model_knows_its_instructions():
    """The model itself against hand-worked cases (so that a wrong model cannot pass the test above)."""
    one = lambda v: np.array([v], dtype=np.uint32)  # noqa: E731
    assert _prmt(one(0x44332211), one(0), 0x4140)[0] == 0x00220011          # bytes 0, 1 to the halves
    assert _prmt(one(0x44332211), one(0xAA000000), 0x7342)[0] == 0xAA440033  # byte 7 = b's top byte
    assert _lop3(one(0xFFFF0F0F), one(0x00030003), one(0x64006400), 0xEA)[0] == 0x64036403  # (a & b) | c
    assert _lop3(one(0b1100), one(0b1010), one(0), 0x3C)[0] == 0b0110          # a ^ b
    # piece 3 of byte 0xC0 (code 3) under fp16 16.0 (0x4C00): 16 + 3 in the low half, 16 + 0 in the high one
    assert _lop3(one(0x000000C0), one(0x00C000C0), one(0x4C004C00), 0xEA)[0] == 0x4C004CC0
    assert [float(h[0]) for h in _halves(one(0x4C004CC0))] == [19.0, 16.0]
