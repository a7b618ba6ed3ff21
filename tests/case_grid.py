"""Covering subsets of the kernel tests' case grids: what runs by default under Triton's interpreter.

The full grids (every case) run on a GPU and with ``--slow``; under the interpreter, where a case takes
~0.5-1 s, the default run keeps a subset that still holds every pair of values of the grid's main factors
and every value of the others (``tests/conftest.py``: the ``slow_interpreted`` marker).
"""

from __future__ import annotations

import itertools

import pytest


def covering_subset(cases: list[tuple], pairs=(), singles=()) -> list[int]:
    """Indices (ascending) of a small subset of ``cases`` holding every pair of values that the full list
    holds at any two of the positions ``pairs`` and every value it holds at each position of ``singles``;
    picked greedily, the case that covers the most still uncovered first (the earliest on a tie)."""
    def needs(case):
        return ({(i, j, case[i], case[j]) for i, j in itertools.combinations(pairs, 2)}
                | {(k, case[k]) for k in singles})

    per_case = [needs(c) for c in cases]
    todo = set().union(*per_case)
    chosen = []
    while todo:
        best = max(range(len(cases)), key=lambda i: (len(per_case[i] & todo), -i))
        chosen.append(best)
        todo -= per_case[best]
    return sorted(chosen)


def params(cases: list, fast: list[int], ids) -> list:
    """``cases`` as pytest params, those not in ``fast`` marked ``slow_interpreted``."""
    keep = set(fast)
    return [pytest.param(*c, id=ids(c), marks=() if i in keep else pytest.mark.slow_interpreted)
            for i, c in enumerate(cases)]
