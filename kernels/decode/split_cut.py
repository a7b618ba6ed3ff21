"""How the split-K decode cuts a request's tokens into its splits: the plain-Python reference of
``common/triton_helpers.program_split`` (which the kernels run), and the work model that judges a cut.

Two cuts, both into whole ``block_n`` blocks, every token in exactly one split, the empty splits starting at
the request's end:

* **even** (``hot_weight`` 0, or no windows): runs of ``ceil(seq_len / splits)`` tokens rounded up to whole
  blocks, the last splits empty when the blocks run out;
* **weighted by work** (``windows=(sink, recent)`` and ``hot_weight`` > 0): a block that may hold a hot row (one
  of the request's first ``sink`` tokens or its last ``recent``) weighs ``hot_weight``, another block
  :data:`COLD_WEIGHT`; the boundary between split ``s - 1`` and ``s`` is the block boundary whose cumulative
  weight is nearest ``s / splits`` of the request's (ties: the later).  The decode loops attend such a block
  twice (its cold rows in the loop over the blocks, its hot rows in a loop of their own after it), so the
  split holding the recent window was the longest, and at batch 1 every split of a launch is on its critical
  path: with the fold's weight (:data:`HOT_WEIGHT_FOLD`) at 32k, block_n 64, windows (64, 256) (the
  artifacts' defaults), the longest split goes from 14 to 6 cold blocks' worth of work with 99 splits, 24 to
  10 with 64, 32 to 17 with 33 (:func:`longest_split`; ``tests/test_decode_splits.py``).

The windows are a hint: the cut only balances the splits, every split attends its own tokens' hot rows
wherever they are, so a wrong hint costs time, never correctness.
"""

from __future__ import annotations

COLD_WEIGHT = 4           # a block without a hot row: the unit (quarters, so that the weights stay integers)
# What a block with hot rows costs the loop over the blocks plus the hot rows' own loop, in quarters of a cold
# block: counted for sm_90 with kernels/compile_check.py --sass (docs/KERNELS.md, "What a hot block costs the
# folded loop"): the 2-warp fold 4.2x (triton 3.6) and 5.0x (3.8) a cold block, the 4-warp fold 3.6-3.8x, the
# default loop's hot branch 1.5x.  Estimates from instruction counts, not times: a GPU's would refine them.
HOT_WEIGHT_FOLD = 20
HOT_WEIGHT_DEFAULT = 6
MAX_HOT_WEIGHT = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_cut(windows, hot_weight) -> None:
    """Raise ``ValueError`` for windows that are not two ints >= 0 or a weight outside {0} and 4..64."""
    if windows is not None:
        if len(windows) != 2 or any(not isinstance(w, int) or isinstance(w, bool) or w < 0 for w in windows):
            raise ValueError(f"hot_windows must be (sink, recent), two ints >= 0, got {windows!r}")
    if hot_weight is not None and hot_weight != 0 and not COLD_WEIGHT <= hot_weight <= MAX_HOT_WEIGHT:
        raise ValueError(f"hot_weight must be 0 (the even cut) or within {COLD_WEIGHT}..{MAX_HOT_WEIGHT} "
                         f"(quarters of a cold block), got {hot_weight!r}")


def hot_blocks(seq_len: int, block_n: int, sink: int, recent: int) -> tuple[int, int, int]:
    """``(blocks, sink_end, recent_start)``: the request's block count, the sink's blocks ``[0, sink_end)`` and the
    recent window's ``[recent_start, blocks)`` (``recent_start >= sink_end``; ``blocks`` when ``recent`` is 0)."""
    nb = cdiv(seq_len, block_n)
    hs = min(nb, cdiv(sink, block_n))
    r0 = max(hs, max(seq_len - recent, 0) // block_n) if recent > 0 else nb
    return nb, hs, r0


def _boundary(sp: int, splits: int, nb: int, hs: int, r0: int, h: int) -> int:
    """The first block of split ``sp`` (0..splits) of the weighted cut: as the kernel computes it."""
    c = COLD_WEIGHT
    cum = lambda b: c * b + (h - c) * (min(b, hs) + max(0, b - r0))  # noqa: E731  (weight of blocks [0, b))
    target = sp * cum(nb)                                     # compared with splits * cum(b): integers throughout
    b = cdiv(target, splits * h)                              # the first b with splits * cum(b) >= target ...
    if b > hs:
        b = cdiv(target - splits * (h - c) * hs, splits * c)
        if b > r0:
            b = cdiv(target + splits * (h - c) * (r0 - hs), splits * h)
    if b > 0 and target - splits * cum(b - 1) < splits * cum(b) - target:   # ... or the one before, if nearer
        b -= 1
    return b


def split_bounds(seq_len: int, splits: int, block_n: int, windows: tuple[int, int] | None = None,
                 hot_weight: int = 0) -> list[tuple[int, int]]:
    """``[(start, end)] * splits``: the tokens of each split of a request of ``seq_len`` tokens (module docstring)."""
    check_cut(windows, hot_weight)
    if windows is None or not hot_weight:
        per = cdiv(cdiv(seq_len, splits), block_n) * block_n
        out = []
        for sp in range(splits):
            start = min(sp * per, seq_len)
            out.append((start, min(start + per, seq_len)))
        return out
    nb, hs, r0 = hot_blocks(seq_len, block_n, *windows)
    cuts = [min(_boundary(sp, splits, nb, hs, r0, hot_weight) * block_n, seq_len) for sp in range(splits + 1)]
    return [(cuts[sp], cuts[sp + 1]) for sp in range(splits)]


def longest_split(bounds: list[tuple[int, int]], seq_len: int, block_n: int, windows: tuple[int, int],
                  hot_weight: int) -> int:
    """The work of the longest split of ``bounds``, in quarters of a cold block, blocks of the windows weighing
    ``hot_weight``: what a launch whose programs all run at once (batch 1, one wave) waits for."""
    nb, hs, r0 = hot_blocks(seq_len, block_n, *windows)
    longest = 0
    for start, end in bounds:
        blocks = range(start // block_n, cdiv(end, block_n))
        longest = max(longest, sum(hot_weight if b < hs or b >= r0 else COLD_WEIGHT for b in blocks))
    return longest
