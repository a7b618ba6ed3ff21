"""Session-wide test setup.

Triton decides between compiling and interpreting when it is imported, and
sglang and transformers may import it before the kernel tests do.  Without
CUDA the kernel tests run Triton through its interpreter, so the choice is
made here, before any test module is collected.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow: the long forms of the server, scheduling, soak and "
                          "calibration tests (the default run holds a fast form of each), and under Triton's "
                          "interpreter the kernel grids' every case (slow_interpreted)")


def pytest_collection_modifyitems(config, items):
    """Deselect the tests marked ``slow`` unless ``--slow`` is given or ``-m`` names the marker; under Triton's
    interpreter also those marked ``slow_interpreted`` (the kernel grids' cases outside their covering subset,
    ``tests/case_grid.py``) unless ``--slow`` is given or ``-m`` names that marker; a GPU runs them by default."""
    if config.getoption("--slow"):
        return
    markexpr = config.getoption("markexpr") or ""
    names_slow = "slow" in markexpr.replace("slow_interpreted", "")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and "slow_interpreted" not in markexpr
    slow = [item for item in items
            if (item.get_closest_marker("slow") and not names_slow)
            or (interpreted and item.get_closest_marker("slow_interpreted"))]
    if slow:
        config.hook.pytest_deselected(items=slow)
        left_out = set(map(id, slow))
        items[:] = [item for item in items if id(item) not in left_out]
