"""Read kernel (Triton, under the interpreter on CPU) against the plain-torch reference, bit for bit.

The kernel dequantizes ``zero + code * scale`` in fp32 without contraction and
rounds once to the buffer's dtype, as the reference does: every row must be
equal, hot rows (their BF16 copies) and cold rows alike, for every format
pair, both head sizes, and slots in any order (repeats, slots never written
read as they are stored).
"""

import pytest
import torch
from kernel_device import DEVICE

from oscar_sglang import format as fmt
from oscar_sglang.kernels import api, layout, scenario
from oscar_sglang.kernels.read import reference

KV = 3
F = fmt.RowFormat
FORMATS = [(F(2), F(2)), (F(2, 32), F(2, 32)), (F(4), F(2, 16)), (F(8), F(8)),
           (F(2, symmetric=True), F(4, 32, True))]


def stored(n, d, formats, seed, hot=True):
    """A store of ``n`` written tokens (every fifth one also hot) and the slots they went to."""
    kf, vf = formats
    store = layout.empty_store(n + 7, KV, d, None, n, DEVICE, k_format=kf, v_format=vf)
    slots = torch.randperm(n + 7, generator=torch.Generator().manual_seed(seed))[:n].to(DEVICE)
    k, v = scenario.random_kv(n, KV, d, seed, DEVICE)
    rot = scenario.random_rotation(KV, d, seed, device=DEVICE)
    hot_loc = torch.where(torch.arange(n, device=DEVICE) % 5 == 0, torch.arange(n, device=DEVICE), -1) \
        if hot else None
    if hot:
        store.hot_index[slots] = hot_loc.to(store.hot_index.dtype)
    api.write_kv(k, v, slots, store, rot, hot_loc, backend="torch")
    return store, slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("formats", FORMATS, ids=lambda f: f"K{f[0].name(64)}-V{f[1].name(64)}")
def test_read_kernel_equals_the_reference(formats, d, dtype):
    store, slots = stored(70, d, formats, seed=d + len(formats[0].name(d)))
    # Out of order, with repeats, and slots of the pool that were never written (zeros as stored).
    unwritten = torch.ones(store.num_slots, dtype=torch.bool, device=DEVICE)
    unwritten[slots] = False
    order = torch.cat([slots.flip(0), slots[:9], unwritten.nonzero()[:2, 0]])
    k_ref, v_ref = reference.read_rows(store, order, dtype)
    k, v = api.read_rows(store, order, dtype, backend="triton")
    assert k.dtype == v.dtype == dtype and k.shape == k_ref.shape == (len(order), KV, d)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    hot = store.hot_index[order.long()] >= 0
    assert hot.any() and (~hot).any()


def test_read_kernel_without_hot_rows_and_of_no_rows():
    store, slots = stored(33, 64, (F(2), F(2)), seed=5, hot=False)
    k_ref, v_ref = reference.read_rows(store, slots, torch.bfloat16)
    k, v = api.read_rows(store, slots, torch.bfloat16, backend="triton")
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    k0, v0 = api.read_rows(store, slots[:0], torch.bfloat16, backend="triton")
    assert k0.shape == v0.shape == (0, KV, 64)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rows_are_read_into_the_head_of_a_larger_buffer(backend):
    # The sdpa path reads a prefix into the first rows of its keys and values, the new tokens after them.
    store, slots = stored(21, 128, (F(2), F(4, 32)), seed=7)
    k_ref, v_ref = reference.read_rows(store, slots, torch.bfloat16)
    keys = torch.full((24, KV, 128), 7.0, dtype=torch.bfloat16, device=DEVICE)
    vals = keys.clone()
    got = api.read_rows(store, slots, torch.bfloat16, (keys[:21], vals[:21]), backend=backend)
    assert got[0].data_ptr() == keys.data_ptr() and got[1].data_ptr() == vals.data_ptr()
    assert torch.equal(keys[:21], k_ref) and torch.equal(vals[:21], v_ref)
    assert (keys[21:] == 7).all() and (vals[21:] == 7).all()          # nothing written past the rows
    for bad in ((keys[:20], vals[:21]), (keys[:21].float(), vals[:21].float()), (keys[:21, :, ::2], vals[:21, :, ::2])):
        with pytest.raises(ValueError, match="out must be two contiguous"):
            api.read_rows(store, slots, torch.bfloat16, bad, backend=backend)


def test_read_kernel_refuses_other_dtypes():
    store, slots = stored(4, 64, (F(2), F(2)), seed=6)
    with pytest.raises(ValueError, match="read as"):
        api.read_rows(store, slots, torch.int8, backend="triton")
