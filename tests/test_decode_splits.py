"""How the split-K decode cuts a request's tokens into its splits (``triton_helpers.program_split``), run as a
kernel (compiled on CUDA, the interpreter on CPU), against its plain-Python reference
(``kernels/decode/split_cut.split_bounds``) and an independent statement of what a cut must be: every token in
exactly one split, whole blocks, the empty splits at the end starting at the request's end (not past it,
where the hot blocks' loop would step through blocks the request does not have).  The even cut: runs of
``ceil(seq_len / splits)`` tokens rounded up to whole blocks.  The cut by work (the windows' blocks heavier):
within one block of the ideal boundaries, and its longest split never longer than the even cut's by the work
model with the fold's weight, much shorter where the recent window sat in one split.
"""

import itertools

import pytest
import torch
import triton
import triton.language as tl
from kernel_device import DEVICE

from oscar_sglang.kernels.common import triton_helpers
from oscar_sglang.kernels.decode import split_cut
from oscar_sglang.kernels.decode.split_cut import COLD_WEIGHT, HOT_WEIGHT_DEFAULT, HOT_WEIGHT_FOLD


@triton.jit
def _splits_kernel(seq_lens, req_pool_indices, out, NUM_SPLITS, hot_sink, hot_recent, BLOCK_N: tl.constexpr,
                   HOT_WEIGHT: tl.constexpr):
    b, kvh, sp, req, start, end = triton_helpers.program_split(seq_lens, req_pool_indices, NUM_SPLITS, hot_sink,
                                                               hot_recent, BLOCK_N, HOT_WEIGHT)
    i = (b * NUM_SPLITS + sp) * 3
    tl.store(out + i, start)
    tl.store(out + i + 1, end)
    tl.store(out + i + 2, req.to(tl.int32))


def splits(lens, num_splits, block_n, pool_rows=None, windows=(0, 0), hot_weight=0):
    """``[(start, end, pool row)] * num_splits`` per request, as the kernel cut them."""
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor(pool_rows or list(range(len(lens))), device=DEVICE)
    out = torch.full((len(lens), num_splits, 3), -1, dtype=torch.int32, device=DEVICE)
    _splits_kernel[(len(lens), 1, num_splits)](seq_lens, rows, out, num_splits, *windows, BLOCK_N=block_n,
                                                HOT_WEIGHT=hot_weight)
    return out.cpu().tolist()


def assert_a_cut(bounds, seq_len, block_n):
    """Every token once, in order, whole blocks (the last may end at the request's end), empty splits at the end
    of the request or between two splits, never past the end."""
    assert bounds[0][0] == 0 and bounds[-1][1] == seq_len
    for (s, e), (s2, _) in zip(bounds, bounds[1:]):
        assert e == s2
    for s, e in bounds:
        assert 0 <= s <= e <= seq_len
        assert s % block_n == 0 or s == seq_len


SHAPES = [(32768, 99, 64), (32768, 64, 64), (32768, 33, 64), (16384, 3, 64), (1000, 7, 32), (300, 5, 16),
          (5, 4, 16), (64, 2, 64), (1, 3, 16), (0, 2, 16), (131072, 128, 64), (2049, 1, 16)]


@pytest.mark.parametrize("seq_len,num_splits,block_n", SHAPES)
def test_even_splits_cover_the_request_once_in_whole_blocks(seq_len, num_splits, block_n):
    per = max(1, -(-(-(-seq_len // num_splits)) // block_n) * block_n)   # ceil(seq_len / splits), whole blocks
    want = [(s, min(s + per, seq_len)) for s in range(0, seq_len, per)]
    want += [(seq_len, seq_len)] * (num_splits - len(want))               # empty splits: at the request's end
    assert [(s, e) for s, e, _ in splits([seq_len], num_splits, block_n)[0]] == want
    assert split_cut.split_bounds(seq_len, num_splits, block_n) == want
    assert split_cut.split_bounds(seq_len, num_splits, block_n, (64, 256), 0) == want   # weight 0: the even cut


WINDOWS = [(64, 256), (4, 256), (0, 256), (64, 0), (0, 0), (3, 20), (5000, 100), (16, 40000)]


@pytest.mark.parametrize("windows", WINDOWS, ids=[f"sink{s}-recent{r}" for s, r in WINDOWS])
def test_the_kernel_cuts_by_work_as_its_reference(windows):
    """The kernel's weighted cut equals ``split_bounds``' (integers both: exact), for lengths around the blocks
    and windows, split counts from 1 to 128, both weights; and each is a cut."""
    for seq_len, num_splits, block_n in SHAPES:
        for hot_weight in (HOT_WEIGHT_FOLD, HOT_WEIGHT_DEFAULT):
            want = split_cut.split_bounds(seq_len, num_splits, block_n, windows, hot_weight)
            assert_a_cut(want, seq_len, block_n)
            got = splits([seq_len], num_splits, block_n, windows=windows, hot_weight=hot_weight)[0]
            assert [(s, e) for s, e, _ in got] == want, (seq_len, num_splits, block_n, hot_weight)


def test_weighted_boundaries_are_the_nearest_to_even_shares_of_the_work():
    """Independently of the reference's piecewise inversion: split ``s`` starts at the block boundary whose
    weight before it (blocks of the windows weighing ``hot_weight``, the others 4) is nearest ``s / splits`` of
    the request's, by a search over every boundary (ties: the later)."""
    for seq_len, num_splits, block_n, windows, hot_weight in itertools.product(
            (1, 63, 64, 65, 1000, 4097, 32768), (1, 3, 7, 33, 99), (16, 64), WINDOWS, (HOT_WEIGHT_FOLD, 7)):
        nb = -(-seq_len // block_n)
        sink, recent = windows
        weight = [hot_weight if b * block_n < sink or (recent and (b + 1) * block_n > seq_len - recent)
                  else COLD_WEIGHT for b in range(nb)]
        before = [sum(weight[:b]) for b in range(nb + 1)]
        starts = []
        for s in range(num_splits):
            share = s * before[-1] / num_splits
            starts.append(min(range(nb + 1), key=lambda b: (abs(before[b] - share), -b)))
        got = split_cut.split_bounds(seq_len, num_splits, block_n, windows, hot_weight)
        assert [min(b * block_n, seq_len) for b in starts] == [s for s, _ in got], (seq_len, num_splits, windows)


def test_the_cut_by_work_shortens_the_longest_split_and_is_never_longer_with_the_folds_weight():
    """By the work model (a window's block ``HOT_WEIGHT_FOLD``, another 4): over lengths 1-131k, 1-128 splits,
    block_n 16-64 and the windows, the weighted cut's longest split is never longer than the even cut's; at
    32k, 99 / 64 / 33 splits of 64-token blocks with the default windows (64, 256) it goes 14 -> 6, 24 -> 10
    and 32 -> 17 cold blocks' worth (the numbers docs/KERNELS.md quotes)."""
    w = HOT_WEIGHT_FOLD
    for seq_len in range(1, 140000, 4999):
        for num_splits, block_n, windows in itertools.product((1, 3, 16, 33, 64, 99, 128), (16, 64),
                                                              ((64, 256), (4, 128), (0, 1024))):
            even = split_cut.longest_split(split_cut.split_bounds(seq_len, num_splits, block_n), seq_len,
                                           block_n, windows, w)
            cut = split_cut.longest_split(split_cut.split_bounds(seq_len, num_splits, block_n, windows, w),
                                          seq_len, block_n, windows, w)
            assert cut <= even, (seq_len, num_splits, block_n, windows, cut, even)
    got = {}
    for num_splits in (99, 64, 33):
        bounds = [split_cut.split_bounds(32768, num_splits, 64, (64, 256), hw) for hw in (0, w)]
        got[num_splits] = tuple(split_cut.longest_split(b, 32768, 64, (64, 256), w) / COLD_WEIGHT for b in bounds)
    assert got == {99: (14, 6), 64: (24, 10), 33: (32, 17)}


def test_requests_of_a_batch_are_cut_each_by_its_own_length_and_read_their_own_pool_row():
    lens, rows = [32768, 100, 1, 4096], [7, 0, 3, 5]
    for windows, hot_weight in (((0, 0), 0), ((64, 256), HOT_WEIGHT_FOLD)):
        got = splits(lens, 8, 64, rows, windows, hot_weight)
        for b, n in enumerate(lens):
            assert [(s, e) for s, e, _ in got[b]] == split_cut.split_bounds(n, 8, 64, windows, hot_weight)
            assert {r for _, _, r in got[b]} == {rows[b]}


@pytest.mark.parametrize("windows,hot_weight", [((1, 2, 3), 20), ((-1, 4), 20), ((4, 256), 3), ((4, 256), 65),
                                                ((4.0, 256), 20)])
def test_a_bad_hint_is_refused(windows, hot_weight):
    with pytest.raises(ValueError, match="hot_windows|hot_weight"):
        split_cut.split_bounds(100, 2, 16, windows, hot_weight)
