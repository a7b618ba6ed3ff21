"""How the split-K decode cuts a request's tokens into its splits (``triton_helpers.program_split``), run as a
kernel (compiled on CUDA, the interpreter on CPU): every token in exactly one split, runs of
``ceil(seq_len / splits)`` tokens rounded up to whole blocks, and the empty splits at the end starting at the
request's end (not past it, where the hot blocks' loop would step through blocks the request does not have).
"""

import pytest
import torch
import triton
import triton.language as tl
from kernel_device import DEVICE

from oscar_sglang.kernels.common import triton_helpers


@triton.jit
def _splits_kernel(seq_lens, req_pool_indices, out, NUM_SPLITS, BLOCK_N: tl.constexpr):
    b, kvh, sp, req, start, end = triton_helpers.program_split(seq_lens, req_pool_indices, NUM_SPLITS, BLOCK_N)
    i = (b * NUM_SPLITS + sp) * 3
    tl.store(out + i, start)
    tl.store(out + i + 1, end)
    tl.store(out + i + 2, req.to(tl.int32))


def splits(lens, num_splits, block_n, pool_rows=None):
    """``[(start, end, pool row)] * num_splits`` per request, as the kernel cut them."""
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor(pool_rows or list(range(len(lens))), device=DEVICE)
    out = torch.full((len(lens), num_splits, 3), -1, dtype=torch.int32, device=DEVICE)
    _splits_kernel[(len(lens), 1, num_splits)](seq_lens, rows, out, num_splits, BLOCK_N=block_n)
    return out.cpu().tolist()


@pytest.mark.parametrize("seq_len,num_splits,block_n", [
    (32768, 99, 64), (32768, 64, 64), (32768, 33, 64), (16384, 3, 64), (1000, 7, 32), (300, 5, 16), (5, 4, 16),
    (64, 2, 64), (1, 3, 16), (0, 2, 16)])
def test_splits_cover_the_request_once_in_whole_blocks(seq_len, num_splits, block_n):
    per = max(1, -(-(-(-seq_len // num_splits)) // block_n) * block_n)   # ceil(seq_len / splits), whole blocks
    want = [(s, min(s + per, seq_len)) for s in range(0, seq_len, per)]
    want += [(seq_len, seq_len)] * (num_splits - len(want))               # empty splits: at the request's end
    assert [(s, e) for s, e, _ in splits([seq_len], num_splits, block_n)[0]] == want


def test_requests_of_a_batch_are_cut_each_by_its_own_length_and_read_their_own_pool_row():
    lens, rows = [32768, 100, 1, 4096], [7, 0, 3, 5]
    got = splits(lens, 8, 64, rows)
    for b, n in enumerate(lens):
        assert [(s, e) for s, e, _ in got[b]] == [(s, e) for s, e, _ in splits([n], 8, 64)[0]]
        assert {r for _, _, r in got[b]} == {rows[b]}
