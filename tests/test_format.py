"""The quantized row format (INT2, INT4, INT8) against its definition (oscar_sglang/format.py docstring)."""

import itertools

import pytest
import torch

from oscar_sglang import format as fmt


def test_pack_unpack_exact_inverse_for_every_code_pattern():
    # All 4^4 = 256 byte patterns, i.e. every combination of four codes.
    patterns = torch.tensor(list(itertools.product(range(4), repeat=4)), dtype=torch.uint8)
    packed = fmt.pack(patterns)
    assert packed.shape == (256, 1) and packed.dtype == torch.uint8
    assert sorted(packed.flatten().tolist()) == list(range(256))
    assert torch.equal(fmt.unpack(packed), patterns)
    # And byte -> codes -> byte over all 256 values.
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(-1, 1)
    assert torch.equal(fmt.pack(fmt.unpack(every_byte)), every_byte)


def test_packing_order_is_little_endian_within_the_byte():
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    packed = fmt.pack(codes)
    assert packed.tolist() == [[1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2 | 0 << 4 | 1 << 6]]


def _reference_quantize(x, group, clip=None, bits=2):
    """Scalar-by-scalar restatement of the format, independent of the vectorised code."""
    top = 2 ** bits - 1
    d = x.shape[-1]
    rows = x.reshape(-1, d).double()
    out = torch.empty_like(rows)
    scales = torch.empty(rows.shape[0], d // group, dtype=torch.float64)
    for i, row in enumerate(rows):
        for gi in range(d // group):
            g = row[gi * group:(gi + 1) * group].clone()
            lo, hi = g.min().item(), g.max().item()
            if clip is not None:
                mid, half = (lo + hi) / 2, (hi - lo) / 2 * clip
                g = g.clamp(mid - half, mid + half)
                lo, hi = g.min().item(), g.max().item()
            zero = torch.tensor(lo).half().double().item()
            scale = torch.tensor((hi - zero) / top).half().double().item()
            c = torch.zeros_like(g) if scale == 0 else torch.round((g - zero) / scale).clamp(0, top)
            out[i, gi * group:(gi + 1) * group] = zero + c * scale
            scales[i, gi] = scale
    return out.reshape(x.shape), scales


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [32, 64, None])
def test_quantize_error_bounded_by_half_scale(d, group):
    torch.manual_seed(d)
    x = torch.randn(7, 3, d) * torch.linspace(0.1, 5, d)  # uneven channel ranges
    x[0, 0, 5] = 40.0  # an outlier
    g = d if group is None else group
    q = fmt.quantize(x, group)
    assert q.codes.shape == (7, 3, d // 4) and q.codes.dtype == torch.uint8
    assert q.scale.shape == (7, 3, d // g) and q.scale.dtype == torch.float16
    assert q.zero.dtype == torch.float16 and q.group_size == g and q.dim == d
    xh = fmt.dequantize(q)
    err = (xh - x).abs().reshape(7, 3, d // g, g)
    half = q.scale.float().unsqueeze(-1) / 2
    # fp16 storage of zero and scale perturbs the grid by at most a few fp16 ulps of the range.
    slack = 4e-3 * x.abs().reshape(7, 3, d // g, g).amax(-1, keepdim=True)
    assert (err <= half + slack).all()
    ref, _ = _reference_quantize(x, g)
    assert torch.allclose(xh.double(), ref, atol=1e-6)


@pytest.mark.parametrize("group", [32, None])
def test_clipped_elements_excepted_and_clip_matches_definition(group):
    torch.manual_seed(0)
    x = torch.randn(5, 2, 64)
    clip = 0.8
    q = fmt.quantize(x, group, clip_ratio=clip)
    xh = fmt.dequantize(q)
    ref, _ = _reference_quantize(x, group or 64, clip)
    assert torch.allclose(xh.double(), ref, atol=1e-6)
    # Unclipped elements keep the half-scale bound; clipped ones land on the clip range.
    g = group or 64
    xg = x.reshape(5, 2, 64 // g, g)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    mid, half_range = (lo + hi) / 2, (hi - lo) / 2 * clip
    inside = (xg >= mid - half_range) & (xg <= mid + half_range)
    err = (xh.reshape_as(xg) - xg).abs()
    bound = q.scale.float().unsqueeze(-1) / 2 + 4e-3 * xg.abs().amax(-1, keepdim=True)
    assert (err[inside.expand_as(err)] <= bound.expand_as(err)[inside.expand_as(err)]).all()
    assert (~inside).any(), "the test must actually clip something"


def test_per_head_clip_ratio_broadcasts():
    torch.manual_seed(1)
    x = torch.randn(9, 3, 64)
    ratios = torch.tensor([1.0, 0.9, 0.5]).reshape(3, 1)
    q = fmt.quantize(x, clip_ratio=ratios)
    for h, r in enumerate([1.0, 0.9, 0.5]):
        single = fmt.quantize(x[:, h], clip_ratio=r)
        assert torch.equal(q.codes[:, h], single.codes)
        assert torch.equal(q.scale[:, h], single.scale)
    with pytest.raises(ValueError):
        fmt.quantize(x, clip_ratio=0.0)


@pytest.mark.parametrize("value", [0.0, 1.5, -3.25, 1000.0])
@pytest.mark.parametrize("group", [32, None])
def test_constant_rows_round_trip_exactly(value, group):
    x = torch.full((4, 64), value, dtype=torch.bfloat16)
    q = fmt.quantize(x, group)
    assert (q.scale == 0).all()
    xh = fmt.dequantize(q, dtype=torch.bfloat16)
    assert torch.equal(xh, x)
    assert torch.isfinite(fmt.dequantize(q)).all()


def test_all_zero_rows_and_mixed_batches_have_no_nan():
    x = torch.zeros(3, 2, 128)
    x[1, 1] = torch.randn(128)
    xh = fmt.fake_quantize(x, 64)
    assert torch.isfinite(xh).all()
    assert torch.equal(xh[0], x[0]) and torch.equal(xh[1, 0], x[1, 0])


def test_extreme_codes_reproduce_row_min_and_max():
    torch.manual_seed(3)
    x = torch.randn(16, 64)
    q = fmt.quantize(x)
    codes = fmt.unpack(q.codes)
    assert ((codes == 0).any(-1) & (codes == 3).any(-1)).all()
    xh = fmt.dequantize(q)
    assert torch.allclose(xh.amin(-1), x.amin(-1), atol=2e-3)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="divide"):
        fmt.quantize(torch.randn(2, 64), group_size=48)
    with pytest.raises(ValueError, match="divisible by 4"):
        fmt.quantize(torch.randn(2, 6))


def test_storage_accounting():
    assert fmt.bits_per_element(64) == 2.5
    assert fmt.bits_per_element(128) == 2.25
    assert fmt.bytes_per_row(64) == 16 + 4
    assert fmt.bytes_per_row(128, 32) == 32 + 16


# --- wider rows: INT4 and INT8 -------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_wider_codes_every_pattern(bits):
    per = 8 // bits
    patterns = torch.tensor(list(itertools.product(range(2 ** bits), repeat=per)), dtype=torch.uint8)
    packed = fmt.pack(patterns, bits)
    assert packed.shape == (256, 1)
    assert sorted(packed.flatten().tolist()) == list(range(256))
    assert torch.equal(fmt.unpack(packed, bits), patterns)


def test_int4_packing_order_low_nibble_first():
    codes = torch.tensor([[1, 15, 7, 0]], dtype=torch.uint8)
    assert fmt.pack(codes, 4).tolist() == [[1 | 15 << 4, 7]]
    assert fmt.pack(codes, 8).tolist() == [[1, 15, 7, 0]]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group,clip", [(None, None), (32, None), (16, 0.8)])
def test_wider_rows_match_the_scalar_definition(bits, group, clip):
    torch.manual_seed(bits)
    x = torch.randn(6, 2, 64) * torch.linspace(0.2, 3, 64)
    x[0, 1, 7] = -25.0
    q = fmt.quantize(x, group, clip, bits=bits)
    g = group or 64
    assert q.bits == bits and q.dim == 64 and q.group_size == g
    assert q.codes.shape == (6, 2, 64 * bits // 8) and q.scale.shape == (6, 2, 64 // g)
    assert int(fmt.unpack(q.codes, bits).max()) <= 2 ** bits - 1
    ref, scales = _reference_quantize(x, g, clip, bits)
    assert torch.allclose(fmt.dequantize(q).double(), ref, atol=1e-6)
    assert torch.allclose(q.scale.double().reshape(-1, 64 // g), scales, atol=0)
    assert torch.allclose(fmt.fake_quantize(x, group, clip, bits=bits).double(), ref, atol=1e-6)


def test_more_bits_cut_the_error_by_the_level_ratio():
    torch.manual_seed(5)
    x = torch.randn(512, 64)
    err = {b: (fmt.fake_quantize(x, bits=b) - x).square().mean().sqrt().item() for b in (2, 4, 8)}
    # uniform rounding error is step / sqrt(12) with step = range / (2^b - 1)
    assert 3.0 < err[2] / err[4] < 7.0 and 12.0 < err[4] / err[8] < 22.0


def test_row_format_accounting_and_names():
    f = fmt.RowFormat(4)
    assert f.bytes_per_row(128) == 64 + 4 and f.bits_per_element(128) == 4.25
    assert fmt.RowFormat(2, 32).bytes_per_row(64) == 16 + 8 and fmt.RowFormat(2, 32).bits_per_element(64) == 3.0
    assert fmt.RowFormat(8, 64).bytes_per_row(64) == 64 + 4
    assert fmt.RowFormat(2).name(64) == "int2" and fmt.RowFormat(2, 16).name(64) == "int2/g16"
    assert fmt.RowFormat(4, 64).resolved(64) == fmt.RowFormat(4, 64) == fmt.RowFormat(4).resolved(64)
    with pytest.raises(ValueError, match="bits"):
        fmt.RowFormat(3)
    with pytest.raises(ValueError, match="divide"):
        fmt.RowFormat(2, 48).resolved(64)


def _reference_symmetric(x, group, clip=None, bits=2):
    """Scalar restatement of symmetric rows: clip about 0, scale = fp16(2a / L), zero = -(L/2) scale."""
    top = 2 ** bits - 1
    d = x.shape[-1]
    rows = x.reshape(-1, d).double()
    out = torch.empty_like(rows)
    for i, row in enumerate(rows):
        for gi in range(d // group):
            g = row[gi * group:(gi + 1) * group]
            a = g.abs().max().item() * (1.0 if clip is None else clip)
            scale = torch.tensor(2 * a / top, dtype=torch.float32).half().double().item()
            zero = -top / 2 * scale
            c = torch.zeros_like(g) if scale == 0 else torch.round((g - zero) / scale).clamp(0, top)
            out[i, gi * group:(gi + 1) * group] = zero + c * scale
    return out.reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group,clip", [(None, None), (32, None), (16, 0.7)])
def test_symmetric_rows_match_the_scalar_definition(bits, group, clip):
    torch.manual_seed(10 + bits)
    x = torch.randn(5, 3, 64) * torch.linspace(0.2, 3, 64)
    x[1, 2, 9] = 30.0
    f = fmt.RowFormat(bits, group, symmetric=True)
    q = f.quantize(x, clip)
    g = group or 64
    assert q.symmetric and q.zero is None and q.scale.shape == (5, 3, 64 // g)
    assert torch.allclose(fmt.dequantize(q).double(), _reference_symmetric(x, g, clip, bits), atol=1e-6)
    assert torch.equal(f.fake_quantize(x, clip), fmt.dequantize(q))
    # the grid is symmetric about 0: codes c and L - c dequantize to opposite values
    top = 2 ** bits - 1
    assert torch.equal(q.zero_f32() + top * q.scale.float(), -q.zero_f32())


def test_symmetric_rows_cost_16_bits_less_per_group_and_suit_centered_rows():
    sym, asym = fmt.RowFormat(2, symmetric=True), fmt.RowFormat(2)
    assert sym.bits_per_element(64) == 2.25 and sym.bytes_per_row(64) == 16 + 2
    assert fmt.RowFormat(4, 32, symmetric=True).bytes_per_row(64) == 32 + 4
    assert sym.name(64) == "int2sym" and fmt.RowFormat(2, 16, True).name(64) == "int2sym/g16"
    assert sym.to_json() == {"bits": 2, "group": None, "symmetric": True} and "symmetric" not in asym.to_json()
    assert sym != asym and sym.resolved(64).symmetric
    with pytest.raises(ValueError, match="symmetric"):
        fmt.RowFormat(2, symmetric=1)
    torch.manual_seed(0)
    x = torch.randn(4096, 64)
    e = lambda f, y: (f.fake_quantize(y) - y).square().mean().item()  # noqa: E731
    assert e(sym, x) < 1.35 * e(asym, x)                 # centered: close to the stored-zero rows
    assert e(sym, x + 3.0) > 3 * e(asym, x + 3.0)        # offset rows waste the symmetric grid
    assert torch.equal(sym.fake_quantize(torch.zeros(2, 64)), torch.zeros(2, 64))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fake_quantize_is_the_stored_rows_read_back_bit_for_bit(bits, symmetric):
    """fake_quantize skips packing the codes into bytes; its values are dequantize(quantize(x)) exactly, for
    every format, per-row clip ratios, constant and all-zero rows, and half-precision input."""
    torch.manual_seed(bits)
    x = torch.randn(6, 4, 64) * torch.linspace(0.1, 4, 64) + 0.5
    x[0, 1] = 0.0
    x[2, 3] = 1.25
    x[4, 0, 17] = -40.0
    clip = torch.linspace(0.45, 1.0, 4).reshape(4, 1)
    for group, ratio, dtype in ((None, None, torch.float32), (16, clip, torch.float32), (32, 0.8, torch.bfloat16)):
        y = x.to(dtype)
        got = fmt.fake_quantize(y, group, ratio, bits, symmetric)
        assert got.dtype == dtype
        assert torch.equal(got, fmt.dequantize(fmt.quantize(y, group, ratio, bits, symmetric), dtype)), (group, ratio)
