"""The device run's prefill probe (scripts/device/prefill_probe.py) and how device_check.sh acts on it.

Before the servers on a GPU the probe times the INT2 prefill's two paths on the last chunk of a 32k prompt and
keeps the sdpa path (the default on a GPU) for the INT2 server unless the Triton kernel is clearly faster; the
script's ``probe_prefill`` function (cut out of device_check.sh and run in bash) exports the knob the servers
inherit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from script_modules import load_script, shell_function

ROOT = Path(__file__).resolve().parents[1]
probe = load_script("device/prefill_probe.py")


def test_the_sdpa_path_stays_the_default_unless_the_kernel_is_clearly_faster_and_agreeing():
    assert probe.choose(10.0, 12.0, 1e-3, 3e-2, True)[0] == "kernel"          # the kernel 1.2x: just enough
    assert probe.choose(10.0, 11.9, 1e-3, 3e-2, True)[0] == "sdpa"            # under the margin: the default
    assert probe.choose(30.0, 10.0, 1e-3, 3e-2, True) == ("sdpa", "the sdpa path is 3.00x as fast "
                                                                   "(the kernel would need 1.2x its speed)")
    assert probe.choose(30.0, 10.0, 5e-2, 3e-2, True) == (                    # one is wrong: the tested one
        "kernel", "the paths disagree (max relative difference 0.05, tolerance 0.03)")
    assert probe.choose(30.0, None, None, 3e-2, True) == ("kernel", "the sdpa path was not timed")
    assert probe.choose(None, 10.0, None, 3e-2, True) == ("sdpa", "the kernel was not timed")
    assert probe.choose(5.0, 10.0, 1e-3, 3e-2, False)[0] == "kernel"          # interpreter timings: never taken
    assert probe.choose(5.0, 10.0, 1e-3, 3e-2, True)[1] == "the Triton kernel is 2.00x as fast (>= 1.2)"


def test_the_probe_runs_both_paths_on_cpu_and_keeps_the_kernel(tmp_path):
    # The dry run's form: tiny shapes, the Triton kernel through the interpreter, both paths agreeing.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "device" / "prefill_probe.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "choice=kernel"
    res = json.loads((tmp_path / "prefill_probe.json").read_text())
    assert res["cuda"] is False and res["prefix"] == res["prompt"] - res["chunk"] > 0
    assert res["kernel_ms"] > 0 and res["sdpa_ms"] > 0 and 0 < res["rel_err"] < 3e-2
    assert res["why"].startswith("no CUDA")
    assert res["sdpa_kv_heads"] == "expanded to the query heads"  # torch's flash kernel is CUDA's


def _function(name: str) -> str:
    return shell_function("device_check.sh", name)


@pytest.mark.parametrize("gpu, preset, caches, choice, want_step, want_knob", [
    (1, "", "bf16 oscar-int2", "sdpa", True, "sdpa"),       # chosen on a GPU: the servers inherit it
    (1, "", "oscar-int2", "kernel", True, "kernel"),        # the kernel chosen over the default
    (0, "", "bf16 oscar-int2", "kernel", True, ""),         # the dry run: the probe runs, the choice is not taken
    (1, "block_rows=128", "oscar-int2", "sdpa", False, "block_rows=128"),   # the knob set around the script wins
    (1, "", "bf16", "sdpa", False, ""),                     # no INT2 server to prefill for
])
def test_device_check_exports_the_probe_s_choice_for_the_servers(tmp_path, gpu, preset, caches, choice, want_step,
                                                                 want_knob):
    res, out = tmp_path / "results", tmp_path / "out"
    res.mkdir()
    out.mkdir()
    fake_py = tmp_path / "python"
    fake_py.write_text(f"#!/bin/sh\necho 'INT2 prefill ...: why'\necho choice={choice}\n")
    fake_py.chmod(0o755)
    knob = f"export OSCAR_SGLANG_EXTEND_KERNEL={preset}" if preset else "unset OSCAR_SGLANG_EXTEND_KERNEL"
    harness = "\n".join([
        "set -u -o pipefail", f'RES="{res}"; OUT="{out}"; WORK="{tmp_path}"; ONLY=""; T0=$SECONDS; rc=0',
        f'ROOT="{ROOT}"; PY="{fake_py}"; GPU={gpu}; INTERP=(); SERVE_CACHES="{caches}"; {knob}',
        _function("publish"), _function("wanted"), _function("step"), _function("probe_prefill"),
        "probe_prefill 60", 'echo "KNOB=${OSCAR_SGLANG_EXTEND_KERNEL:-}"'])
    r = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == f"KNOB={want_knob}"
    summary = (res / "summary.txt").read_text() if (res / "summary.txt").exists() else ""
    assert ("== prefill_probe (limit 60 s" in summary) == want_step
    assert ("prefills through the sdpa path" in summary) == (want_knob == "sdpa")
    assert ("prefills with the Triton extend kernel" in summary) == (want_knob == "kernel")
    # a knob set around the script (a rerun naming the first run's choice) is said to skip the probe
    assert (f"prefill_probe: skipped (OSCAR_SGLANG_EXTEND_KERNEL={preset} set" in summary) == (
        bool(preset) and caches != "bf16")
