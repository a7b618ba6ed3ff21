"""The kernel grids' covering subsets (tests/case_grid.py) and what the default run selects with them."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import case_grid

ROOT = Path(__file__).resolve().parent.parent


def test_covering_subset_holds_every_pair_and_every_value_of_the_full_grid():
    cases = [(d, gqa, page, hot, i % 9, 1 + i % 5)
             for i, (d, gqa, page, hot) in enumerate(itertools.product((64, 128), (1, 3, 8), (1, 16), (True, False)))]
    fast = case_grid.covering_subset(cases, pairs=(0, 1, 2, 3), singles=(4, 5))
    assert fast == sorted(set(fast)) and len(fast) < len(cases) / 2
    chosen = [cases[i] for i in fast]
    for a, b in itertools.combinations(range(4), 2):          # every pair the full product holds
        assert {(c[a], c[b]) for c in chosen} == {(c[a], c[b]) for c in cases}, (a, b)
    assert {c[4] for c in chosen} == set(range(9)) and {c[5] for c in chosen} == set(range(1, 6))
    # a grid that a single case covers: that case; an empty list of needs: nothing
    assert case_grid.covering_subset([(1, 2), (1, 2)], pairs=(0, 1)) == [0]
    assert case_grid.covering_subset([(1,), (2,)], []) == []


def test_the_interpreter_runs_the_subsets_by_default_and_every_case_with_slow():
    """Collected, not run: under TRITON_INTERPRET=1 the cases marked slow_interpreted are deselected unless
    --slow is given (on a GPU, without the interpreter, conftest selects them all)."""
    def selected(*extra):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_kernels_decode.py"), "-k", "matches_reference and not loops",
                            *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return [x for x in r.stdout.splitlines() if "::test_decode_kernel_matches_reference[" in x]

    from test_kernels_decode import CASES, FAST

    default, every = selected(), selected("--slow")
    assert len(default) == len(FAST) and len(every) == len(CASES)
    assert set(default) < set(every)
    # -m naming the other marker leaves these as by default; naming this one selects just the others
    assert selected("-m", "not slow") == default
    assert len(selected("-m", "slow_interpreted")) == len(CASES) - len(FAST)
