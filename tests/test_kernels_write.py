"""Write kernel (Triton, under the interpreter on CPU) against the plain-torch reference.

Tolerance: with identity rotations the kernel's codes, scales, zeros and hot
rows are byte-identical to the reference.  With random rotations the fp32
matmul may sum in another order, so a value sitting exactly on a rounding
boundary may land on the other side: we allow at most 0.1% of codes to
differ (by one level), scales/zeros within one fp16 ulp, hot rows within one
bf16 ulp (observed: identical).

Keys and values may have different formats (bits 2, 4, 8, their own group):
the INT2 cases cover every (d, G) pair, the mixed cases every format pair of
``MIXED`` with both head sizes, identity and random rotations.  The reference
is checked against ``fmt.quantize(..., bits=)`` directly, so the kernel's
codes follow the format through it.
"""


import pytest
import torch
from kernel_device import DEVICE

from oscar_sglang import format as fmt
from oscar_sglang.kernels import api, layout, scenario
from oscar_sglang.kernels.write import reference, triton_kernel

KV = 2
MAX_CODE_MISMATCH = 1e-3


F = fmt.RowFormat
INT2 = F(2)
# (keys, values): the format pairs beyond INT2 g=d that every kernel is checked on
MIXED = [(F(4), F(2)), (F(2, 16), F(4, 32)), (F(8), F(8)), (F(8), F(2, 32)),
         (F(2, symmetric=True), F(2)), (F(4, symmetric=True), F(2, 32, True))]  # symmetric: no zero


def _store(d, g, hot_entries, seed, num_slots=96, kf=None, vf=None):
    """A store pre-filled with garbage, to catch writes to the wrong place (INT2 in groups of ``g`` by default)."""
    s = layout.empty_store(num_slots, KV, d, g, hot_entries, DEVICE, k_format=kf, v_format=vf)
    gen = torch.Generator().manual_seed(seed)
    for t in (s.k_codes, s.v_codes):
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    for t in (s.k_scale, s.k_zero, s.v_scale, s.v_zero, s.k_hot, s.v_hot):
        t.copy_(torch.randn(t.shape, generator=gen))
    return s


def _rotation(d, seed, identity):
    """Random state with a key mean on a 1/8 grid, so that mean + 0.75 is exact in bf16."""
    r = scenario.random_rotation(KV, d, seed, identity, DEVICE)
    return layout.DeviceRotation(r.k_rot, r.v_rot, (r.k_mean * 8).round() / 8, r.k_clip, r.v_clip)


def _inputs(n, d, rot, identity, seed):
    k, v = scenario.random_kv(n, KV, d, seed, DEVICE)
    # Constant rows: k = mu centres to an all-zero row; v = 0 stays 0 under any rotation.
    k[0] = rot.k_mean.to(k.dtype)
    v[0] = 0
    if identity and n > 2:
        k[1] = (rot.k_mean + 0.75).to(k.dtype)  # constant non-zero after centring
        v[1] = -1.25
    return k, v


def _compare(a, b, exact):
    for name, bits in (("k_codes", a.k_format.bits), ("v_codes", a.v_format.bits)):
        ca, cb = fmt.unpack(getattr(a, name), bits), fmt.unpack(getattr(b, name), bits)
        if exact:
            assert torch.equal(ca, cb), name
        else:
            diff = ca.int() - cb.int()
            assert diff.abs().max() <= 1, name
            assert (diff != 0).float().mean() <= MAX_CODE_MISMATCH, name
    for name in ("k_scale", "k_zero", "v_scale", "v_zero", "k_hot", "v_hot"):
        x, y = getattr(a, name), getattr(b, name)
        assert not torch.isnan(y).any(), name
        if exact:
            assert torch.equal(x, y), name
        else:
            ulp = 2.0**-10 if x.dtype == torch.float16 else 2.0**-7
            assert torch.allclose(x.float(), y.float(), rtol=ulp, atol=1e-6), name


CASES = [  # d, keys, values, identity, hot, n: every INT2 d/group pair, both rotations, hot on and off,
    # n across BLOCK_T=16; then every MIXED pair with both d, once exact (identity) and once rotated
    (64, F(2, 64), F(2, 64), True, True, 1),
    (64, F(2, 64), F(2, 64), False, False, 17),
    (64, F(2, 32), F(2, 32), True, False, 33),
    (64, F(2, 32), F(2, 32), False, True, 16),
    (128, F(2, 128), F(2, 128), True, False, 2),
    (128, F(2, 128), F(2, 128), False, True, 31),
    (128, F(2, 64), F(2, 64), True, True, 17),
    (128, F(2, 64), F(2, 64), False, False, 5),
    (128, F(2, 32), F(2, 32), True, True, 40),
    (128, F(2, 32), F(2, 32), False, True, 15),
    *[(d, kf, vf, (i + j) % 2 == 0, j == 0 or i % 2 == 1, (17, 5, 33, 16)[(i + 2 * j) % 4])
      for i, (kf, vf) in enumerate(MIXED) for j, d in enumerate((64, 128))],
]


def _case_id(c):
    d, kf, vf, identity, hot, n = c
    return f"d{d}-K{kf.name(d)}-V{vf.name(d)}-{'eye' if identity else 'rot'}-{'hot' if hot else 'cold'}-n{n}"


def _check_against_reference(d, kf, vf, identity, hot, n, seed, write):
    """``write(k, v, slots, store, rot, hot_loc)`` into a garbage-filled store against the reference's rows."""
    rot = _rotation(d, seed, identity)
    k, v = _inputs(n, d, rot, identity, seed)
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(seed))[:n].to(DEVICE)
    hot_loc = None
    if hot:
        hot_loc = torch.where(torch.arange(n) % 3 == 1, -1, torch.randperm(n)).to(DEVICE)
    ref = _store(d, None, n, seed, kf=kf, vf=vf)
    assert (ref.k_format, ref.v_format) == (kf.resolved(d), vf.resolved(d))
    out = ref.clone()
    reference.write_kv(k, v, slots, ref, rot, hot_loc)
    write(k, v, slots, out, rot, hot_loc)
    _compare(ref, out, exact=identity)


@pytest.mark.parametrize("d,kf,vf,identity,hot,n", CASES, ids=[_case_id(c) for c in CASES])
def test_write_kernel_matches_reference(d, kf, vf, identity, hot, n):
    _check_against_reference(d, kf, vf, identity, hot, n, d + kf.bits + (kf.group or d) + n,
                             lambda *a: api.write_kv(*a, backend="triton"))


@pytest.mark.parametrize("d,kf,vf,identity", [(128, INT2, INT2, True), (128, INT2, INT2, False),
                                               (64, *MIXED[1], True), (128, *MIXED[5], False)])
def test_write_kernel_in_16_channel_steps_matches_reference(d, kf, vf, identity):
    """``kc=16`` (the rotation's dots over 16 input channels a step; 32 by default): the other tile the kernel
    benchmark times, since 32 spills on sm_89 and with Triton 3.9. The same rows: byte-identical under identity
    rotations, within the rounding-order tolerance under random ones."""
    _check_against_reference(d, kf, vf, identity, True, 33, d + 16, lambda *a: triton_kernel.write_kv(*a, kc=16))


@pytest.mark.parametrize("kc", [8, 24, 256])
def test_write_kernel_refuses_a_channel_step_it_cannot_take(kc):
    d = 128
    rot = _rotation(d, 0, True)
    k, v = _inputs(2, d, rot, True, 0)
    store = _store(d, None, 2, 0)
    with pytest.raises(ValueError, match=f"kc must be a power of two from 16 .* to head_dim {d}, got {kc}"):
        triton_kernel.write_kv(k, v, torch.arange(2, device=DEVICE), store, rot, kc=kc)


@pytest.mark.parametrize("kf,vf", [(INT2, INT2), *MIXED], ids=lambda f: f.name())
def test_reference_writes_each_side_in_its_format(kf, vf):
    # The reference against fmt.quantize(..., bits=) on the rotated rows, side by side: so the kernel, equal
    # to the reference above, follows the format's rounding for every bit width and group.
    from oscar_sglang.rotation import rotate_kv

    d, n = 64, 7
    rot = _rotation(d, 4, identity=False)
    k, v = _inputs(n, d, rot, False, 4)
    slots = torch.tensor([9, 3, 40, 1, 77, 12, 5], device=DEVICE)
    s = _store(d, None, 0, 4, kf=kf, vf=vf)
    before = s.clone()
    reference.write_kv(k, v, slots, s, rot)
    for x, clip, form, side in ((rotate_kv(k, rot.k_rot, rot.k_mean), rot.k_clip, kf, "k"),
                                (rotate_kv(v, rot.v_rot), rot.v_clip, vf, "v")):
        want = form.quantize(x, clip.unsqueeze(-1))
        assert want.codes.shape[-1] == d * form.bits // 8 and want.symmetric == form.symmetric
        assert getattr(s, f"{side}_zero").shape[-1] == (0 if form.symmetric else d // form.group_for(d))
        for name, t in (("codes", want.codes), ("scale", want.scale), ("zero", want.zero)):
            if t is None:
                continue
            got = getattr(s, f"{side}_{name}")
            assert torch.equal(got[slots], t), (side, name)
            untouched = torch.ones(s.num_slots, dtype=torch.bool)
            untouched[slots.cpu()] = False
            assert torch.equal(got[untouched.to(DEVICE)], getattr(before, f"{side}_{name}")[untouched.to(DEVICE)])


def test_constant_rows_quantize_to_zero_codes_and_exact_zero():
    d = 64
    rot = _rotation(d, 1, identity=True)
    k, v = _inputs(4, d, rot, True, 1)
    s = _store(d, d, 4, 1)
    api.write_kv(k, v, torch.arange(4, device=DEVICE), s, rot, backend="triton")
    for codes, scale, zero, want in ((s.k_codes, s.k_scale, s.k_zero, (0.0, 0.75)),
                                     (s.v_codes, s.v_scale, s.v_zero, (0.0, -1.25))):
        assert torch.all(codes[:2] == 0) and torch.all(scale[:2] == 0)
        assert zero[0].float().eq(want[0]).all() and zero[1].float().eq(want[1]).all()


def test_write_reads_strided_inputs():
    # SGLang hands k and v as views into a fused qkv projection output.
    d, n, q_heads = 64, 20, 4
    rot = scenario.random_rotation(KV, d, 5, device=DEVICE)
    qkv = torch.randn(n, (q_heads + 2 * KV) * d, device=DEVICE).bfloat16()
    k = qkv[:, q_heads * d:(q_heads + KV) * d].view(n, KV, d)
    v = qkv[:, (q_heads + KV) * d:].view(n, KV, d)
    slots = torch.arange(3, 3 + n, device=DEVICE)
    ref, out = _store(d, d, 0, 5), _store(d, d, 0, 5)
    reference.write_kv(k.contiguous(), v.contiguous(), slots, ref, rot)
    api.write_kv(k, v, slots, out, rot, backend="triton")
    _compare(ref, out, exact=False)


def test_auto_backend_on_cpu_is_the_reference():
    d = 64
    rot = scenario.random_rotation(KV, d, 2)
    k, v = scenario.random_kv(3, KV, d, 2)
    s1 = layout.empty_store(8, KV, d)
    s2 = layout.empty_store(8, KV, d)
    api.write_kv(k, v, torch.tensor([1, 4, 6]), s1, rot)
    reference.write_kv(k, v, torch.tensor([1, 4, 6]), s2, rot)
    _compare(s1, s2, exact=True)
    with pytest.raises(ValueError, match="backend"):
        api.write_kv(k, v, torch.tensor([1, 4, 6]), s1, rot, backend="cuda")


def test_written_rows_dequantize_to_the_rotated_inputs():
    # End to end through the format: the INT2 error is bounded by half a step, hot rows by bf16 rounding.
    d, n = 128, 24
    rot = scenario.random_rotation(KV, d, 3, device=DEVICE)
    rot = layout.DeviceRotation(rot.k_rot, rot.v_rot, rot.k_mean, torch.ones(KV, device=DEVICE),
                               torch.ones(KV, device=DEVICE))
    k, v = scenario.random_kv(n, KV, d, 3, DEVICE)
    s = layout.empty_store(n, KV, d, 32, n, DEVICE)
    api.write_kv(k, v, torch.arange(n, device=DEVICE), s, rot, torch.arange(n, device=DEVICE), backend="triton")
    from oscar_sglang.rotation import rotate_kv

    kr = rotate_kv(k, rot.k_rot, rot.k_mean)
    kq = fmt.dequantize(fmt.QuantRows(s.k_codes, s.k_scale, s.k_zero))
    step = s.k_scale.float().repeat_interleave(32, -1)
    assert ((kq - kr).abs() <= step / 2 + 1e-2 * step + 1e-3).all()
    assert torch.allclose(s.k_hot.float(), kr, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ties_round_half_to_even_like_the_format(bits):
    # Identity rotation, no clipping, a row spanning [0, L] (L = 2^bits - 1): scale 1, zero 0, and
    # values 0.5, 1.5, 2.5 sit exactly on ties (codes 0, 2, 2 under half-to-even).  Values use the
    # other side's format (INT2 for wider keys), so both quantizers of one launch are checked.
    d, top = 64, 2**bits - 1
    eye = torch.eye(d, device=DEVICE).expand(KV, d, d).contiguous()
    ones = torch.ones(KV, device=DEVICE)
    rot = layout.DeviceRotation(eye, eye, torch.zeros(KV, d, device=DEVICE), ones, ones)
    row = torch.tensor([0.0, top, 0.5, 1.5, 2.5, 1.0, 2.0, 0.25] * (d // 8), device=DEVICE)
    k = row.expand(2, KV, d).bfloat16()
    kf, vf = F(bits), F(2 if bits > 2 else 4, 32)
    ref, out = _store(d, d, 0, 9, kf=kf, vf=vf), _store(d, d, 0, 9, kf=kf, vf=vf)
    slots = torch.tensor([1, 2], device=DEVICE)
    reference.write_kv(k, k, slots, ref, rot)
    api.write_kv(k, k, slots, out, rot, backend="triton")
    _compare(ref, out, exact=True)
    assert out.k_scale[1].float().eq(1.0).all() and out.k_zero[1].float().eq(0.0).all()
    assert fmt.unpack(out.k_codes[1, 0], bits)[:8].tolist() == [0, top, 0, 2, 2, 1, 2, 0]


def test_layout_checks_name_the_offending_tensor():
    s = layout.empty_store(8, KV, 64, 32, 2)
    s.check()
    scenario.random_rotation(KV, 64).check(KV, 64)
    bad = layout.LayerStore(**{**{f: getattr(s, f) for f in s.__dataclass_fields__},
                               "v_zero": torch.zeros(8, KV, 2, dtype=torch.float32)})
    with pytest.raises(ValueError, match="v_zero"):
        bad.check()
    rot = scenario.random_rotation(KV, 64)
    strided = layout.DeviceRotation(rot.k_rot.transpose(1, 2), rot.v_rot, rot.k_mean, rot.k_clip, rot.v_clip)
    with pytest.raises(ValueError, match="k_rot must be contiguous"):
        layout.require_contiguous(s, strided)
    # symmetric rows: an empty zero says so; a zero of another width is refused by name
    sym = layout.empty_store(8, KV, 64, None, 2, k_format=F(2, symmetric=True), v_format=F(4, 32))
    sym.check()
    assert sym.k_format == F(2, 64, True) and sym.v_format == F(4, 32) and sym.k_zero.shape == (8, KV, 0)
    args = sym.row_args()
    assert args[2] is sym.k_scale and args[5] is sym.v_zero       # the kernels get a valid pointer it never reads
    odd = layout.LayerStore(**{**{f: getattr(sym, f) for f in sym.__dataclass_fields__},
                               "k_zero": torch.zeros(8, KV, 3, dtype=torch.float16)})
    with pytest.raises(ValueError, match="k_zero has 3 groups"):
        odd.check()


def test_triton_unsupported_names_the_format():
    assert layout.triton_unsupported(128) is None
    assert layout.triton_unsupported(128, None) is None
    assert layout.triton_unsupported(128, 32) is None  # an int is an INT2 group size (the pool's form)
    assert layout.triton_unsupported(64, F(4), F(2, 16), F(8, 4)) is None
    assert "head_dim" in layout.triton_unsupported(96, F(2))
    assert "int8/g2" in layout.triton_unsupported(64, F(2), F(8, 2))
    assert "group size" in layout.triton_unsupported(64, 2)
    assert "group size" in layout.triton_unsupported(128, F(4, 24))
    s = layout.empty_store(4, KV, 64, None, 0, DEVICE, k_format=F(4), v_format=F(2, 2))
    with pytest.raises(AssertionError, match="int2/g2"):
        api.write_kv(*scenario.random_kv(1, KV, 64, device=DEVICE), torch.tensor([1], device=DEVICE), s,
                     scenario.random_rotation(KV, 64, device=DEVICE), backend="triton")
