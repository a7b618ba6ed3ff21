"""Which steps and which tests device_check.sh runs: its ``only_with_needs`` and ``kernel_test_paths`` functions,
cut out of the script and run in bash.

A rerun on the warm GPU machine is one command with ``ONLY=...``; a step it names must get what it needs, and
the kernel tests must run whether SGLang could be installed or not (pytest collects nothing at all when one
named test's module skips, so a missing SGLang once meant no kernel test ran).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from script_modules import load_script, shell_function

ROOT = Path(__file__).resolve().parents[1]
GRAPH_TEST = "tests/test_sglang_cuda_graph.py::test_real_cuda_graphs_match_eager_decode"


def _bash(*lines: str) -> list[str]:
    r = subprocess.run(["bash", "-c", "\n".join(["set -u -o pipefail", *lines])], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("only, needs", [
    ("kernel_tests", {"install"}),                         # its CUDA-graph test serves through SGLang's backend
    ("servers", {"install", "models", "prefill_probe"}),
    ("calibration", {"models"}),
    ("bench_kernels", set()),
    ("kernel_tests bench_kernels", {"install"}),
])
def test_a_rerun_s_steps_get_what_they_need(only, needs):
    steps = _bash(shell_function("device_check.sh", "only_with_needs"), f'only_with_needs "{only}"')
    assert set(steps) == set(only.split()) | needs


@pytest.mark.parametrize("have_sglang", [0, 1])
def test_kernel_tests_run_with_or_without_sglang(have_sglang):
    paths = _bash(f'ROOT="{ROOT}"; HAVE_SGLANG={have_sglang}',
                  shell_function("device_check.sh", "kernel_test_paths"), "kernel_test_paths")
    files = [p.split("::")[0] for p in paths]
    assert all(Path(f).is_file() for f in files) and len(set(files)) == len(files) == 10 + have_sglang
    assert (str(ROOT / GRAPH_TEST) in paths) == bool(have_sglang)
    # every kernel's test module against its reference (compiling alone is the compile check's, on CPU)
    kernel_modules = {p.name for p in (ROOT / "tests").glob("test_kernels_*.py")} - {"test_kernels_compile.py"}
    assert {Path(f).name for f in files} >= kernel_modules | {"test_hot_plan.py"}
    if not have_sglang:  # what scripts/device/count_specializations.py counts; it collects without SGLang
        assert paths == [str(ROOT / t) for t in load_script("device/count_specializations.py").KERNEL_TESTS]
        # (sys.modules["sglang"] = None: a stand-in that fails every import of it)
        hide = "import sys; sys.modules['sglang'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"
        r = subprocess.run([sys.executable, "-c", hide, "--co", "-q", "-p", "no:cacheprovider",
                            "--rootdir", str(ROOT), *paths], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and " collected" in r.stdout.splitlines()[-1], r.stdout[-2000:] + r.stderr[-2000:]
        r = subprocess.run([sys.executable, "-c", hide, "--co", "-q", "-p", "no:cacheprovider",
                            "--rootdir", str(ROOT), *paths, str(ROOT / GRAPH_TEST)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0  # what the step ran before: with the graph test named, nothing is collected


@pytest.mark.parametrize("inductor", ["1", "0", ""])
def test_servers_leave_the_bundled_triton_only_where_torch_s_compiler_failed_with_it(inductor):
    """The triton step's environment file says whether torch 2.11's inductor works with the bundle's Triton 3.8;
    where it does not, the servers (which compile a few functions with it) run on the machine's Triton."""
    setup = ('export PYTHONPATH=/tmp/oscar-device-site:/tmp/oscar-triton:/tmp/pkg OSCAR_TRITON_DIR=/tmp/oscar-triton '
             'TRITON_PTXAS_PATH=/cuda/bin/ptxas')
    if inductor:
        setup += f" OSCAR_TRITON_INDUCTOR={inductor}"
    r = subprocess.run(["bash", "-c", "\n".join([
        "set -u -o pipefail", setup, shell_function("device_check.sh", "servers_env"),
        'mapfile -t E < <(servers_env)', '"${E[@]}" bash -c \'echo "$PYTHONPATH|${TRITON_PTXAS_PATH:-unset}"\''])],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if inductor == "0":
        assert r.stdout.strip() == "/tmp/oscar-device-site:/tmp/pkg|unset"
    else:  # it works, or no GPU tried it: as the triton step left it
        assert r.stdout.strip() == "/tmp/oscar-device-site:/tmp/oscar-triton:/tmp/pkg|/cuda/bin/ptxas"


@pytest.mark.parametrize("left, reserve, seconds", [
    (310, 170, 150),   # a whole run: the kernel benchmark's reserve kept, but never under 150 s
    (400, 170, 230),
    (480, 0, 480),     # the servers-only call: all of what is left (a 420 s cap took ~60 s from INT2's wave)
    (100, 0, 100),     # a short rerun: never more than is left
    (100, 170, 100),
])
def test_the_servers_get_what_is_left_less_what_the_kernel_benchmark_keeps(left, reserve, seconds):
    out = _bash(shell_function("device_check.sh", "serve_seconds"), f"serve_seconds {left} {reserve}")
    assert out == [str(seconds)]
