"""How many Triton kernels the GPU run's kernel tests will compile: their distinct sm_90 specializations.

On the GPU, compiling is most of the ``kernel_tests`` step's time (~1-2 s per specialization, one CPU thread
each), so the step's limit and its pytest-xdist worker count follow from this count. Here the tests run under
Triton's interpreter, and every kernel launch is keyed the way Triton keys its compile cache on a GPU: its own
binder for the CUDA backend at sm_90 (each argument's type, 16-byte alignment of pointers, integers equal to 1
or divisible by 16, the constexprs) plus the launch options (``num_warps``, ``num_stages``). Tests that run only
on CUDA are skipped here and not counted.

    python scripts/device/count_specializations.py [--json OUT] [pytest args...]
"""

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# device_check.sh's kernel_tests step without its CUDA-only graph test (tests/test_device_check_steps.py holds
# the two lists together)
KERNEL_TESTS = ["tests/test_kernels_write.py", "tests/test_kernels_decode.py", "tests/test_kernels_query_rotation.py",
                "tests/test_kernels_extend.py", "tests/test_kernels_read.py", "tests/test_kernels_repin.py",
                "tests/test_kernels_hot_pass.py", "tests/test_kernels_head_dim_256.py", "tests/test_hot_plan.py",
                "tests/test_decode_autotune.py"]


@functools.cache
def _binder(fn):
    """Triton's argument binder for ``fn`` (a plain Python function) as the CUDA backend at sm_90 builds it."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(fn)
    backend = backends["nvidia"].compiler(GPUTarget("cuda", 90, 32))
    return create_function_from_signature(jit.signature, jit.params, backend)


def specialization_key(fn, args, kwargs) -> tuple[str, str]:
    """(kernel name, what Triton keys the compile cache of a GPU launch ``fn[grid](*args, **kwargs)`` by)."""
    _, specialization, options = _binder(fn)(*args, **kwargs)
    return fn.__name__, repr((specialization, sorted(options.items())))


@contextlib.contextmanager
def counting():
    """Within it, every interpreted kernel launch is counted by its key: yields {key: launches}."""
    import triton.runtime.interpreter as interpreter

    counts = collections.Counter()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        counts[specialization_key(self.fn, args, kwargs)] += 1
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = counted
    try:
        yield counts
    finally:
        interpreter.InterpretedFunction.run = run


def per_kernel(counts) -> dict:
    """{kernel name: [distinct specializations, launches]}, most specializations first."""
    table = collections.defaultdict(lambda: [0, 0])
    for (name, _), n in counts.items():
        table[name][0] += 1
        table[name][1] += n
    return dict(sorted(table.items(), key=lambda kv: -kv[1][0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write {kernel: [specializations, launches]} here too")
    args, pytest_args = ap.parse_known_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import pytest

    with counting() as counts:
        rc = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
                         + (pytest_args or [str(ROOT / t) for t in KERNEL_TESTS]))
    table = per_kernel(counts)
    print("\n| kernel | distinct sm_90 specializations | launches |\n|---|---|---|")
    for name, (spec, launches) in table.items():
        print(f"| {name} | {spec} | {launches} |")
    print(f"| all | {len(counts)} | {sum(counts.values())} |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
