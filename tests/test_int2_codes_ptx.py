"""The inline PTX that unpacks INT2 codes for the folded decode (``triton_helpers.int2_piece_ptx``), executed
here by a small model of its three instructions (PTX ISA semantics of ``prmt.b32``, ``lop3.b32`` and
``fma.rn.f16x2``), against the codes read from the bytes directly.  The interpreter cannot run PTX, so this is
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


def _fma_f16x2(a, b, c):
    """``fma.rn.f16x2``: per half ``a * b + c`` computed exactly (float64 holds it), rounded once to fp16."""
    out = []
    for xa, xb, xc in zip(_halves(a), _halves(b), _halves(c)):
        r = (xa.astype(np.float64) * xb.astype(np.float64) + xc.astype(np.float64)).astype(np.float16)
        out.append(r.view(np.uint16).astype(np.uint32))
    return out[0] | (out[1] << np.uint32(16))


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
        if op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), int(args[3], 0))
        elif op == "lop3.b32":
            regs[args[0]] = _lop3(val(args[1]), val(args[2]), val(args[3]), int(args[4], 0))
        elif op == "fma.rn.f16x2":
            regs[args[0]] = _fma_f16x2(val(args[1]), val(args[2]), val(args[3]))
        else:
            raise AssertionError(f"instruction not modelled: {op}")
    return regs


def test_int2_codes_ptx_gives_every_code_of_four_bytes_exactly():
    """Four bytes (words 0..3, word 0 the low byte) in ``$2``: the PTX of piece p must give, in output ``$(w //
    2)``, half ``w % 2``, the code of piece p of word w, ``(byte >> 2p) & 3``, as an fp16 value, for every byte
    value in every place.  (That placement is Triton's packing for ``pack=4``, read in its LLVM IR: the input an
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
        regs = run_ptx(ptx, {"$2": words})
        for w in range(4):
            got = _halves(regs[f"${w // 2}"])[w % 2].astype(np.float64)
            want = ((words >> (8 * w + 2 * p)) & 3).astype(np.float64)
            assert np.array_equal(got, want), (p, w)


def test_ptx_model_knows_its_instructions():
    """The model itself against hand-worked cases (so that a wrong model cannot pass the test above)."""
    one = lambda v: np.array([v], dtype=np.uint32)  # noqa: E731
    assert _prmt(one(0x44332211), one(0), 0x4140)[0] == 0x00220011          # bytes 0, 1 to the halves
    assert _prmt(one(0x44332211), one(0xAA000000), 0x7342)[0] == 0xAA440033  # byte 7 = b's top byte
    assert _lop3(one(0xFFFF0F0F), one(0x00030003), one(0x64006400), 0xEA)[0] == 0x64036403  # (a & b) | c
    assert _lop3(one(0b1100), one(0b1010), one(0), 0x3C)[0] == 0b0110          # a ^ b
    # low half (1024 + 3) * 1 - 1024 = 3.0 (0x4200), high half (1024 + 64) / 64 - 16 = 1.0 (0x3C00)
    assert _fma_f16x2(one(0x64406403), one(0x24003C00), one(0xCC00E400))[0] == 0x3C004200
