"""The device run's files turned into docs/gpu_results.md (scripts/device/record.py).

The summary and the tarball are written here by device_check.sh's own ``step``, ``wanted`` and ``publish``
functions (cut out of the script and run in bash over small commands), and the server report by
serve_bench's own writer, so the recorder reads what the producers write.
"""

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest

from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "device_check.sh").read_text()


serve_bench = load_script("device/serve_bench.py")
record = load_script("device/record.py")


def _function(name: str) -> str:
    """A shell function's whole definition, as device_check.sh has it."""
    m = re.search(rf"^{name}\(\) {{.*?^}}$", SCRIPT, re.S | re.M)
    assert m, f"device_check.sh has no function {name}()"
    return m.group(0)


DONE_LINE = next(ln for ln in SCRIPT.splitlines() if ln.startswith('echo "== done in'))


def _serve_report(folder: Path, *results: dict) -> None:
    """serve_bench.{md,json} in ``folder``, by serve_bench's own writer, as the 8B-geometry run writes them."""
    args = argparse.Namespace(out=folder, tag="", kv_budget_gib=16.0, mem_fraction_static=0.85,
                              model=Path("llama3-8b"), dummy=True, tp=1, output_len=256)
    serve_bench.write_report(list(results), args, cpu=True)


def _device_run(tmp_path, steps: str, only: str = "") -> Path:
    """A device_check-like run: RES with serve_bench's report, the script's own step functions over ``steps``
    (bash lines), then its closing line and last publish; returns OUT as the device tool brings it back."""
    work, out = tmp_path / "work", tmp_path / "out"
    res = work / "results"
    res.mkdir(parents=True, exist_ok=True)   # a test may have put files there first
    out.mkdir()
    run = {"input_len": 32768, "concurrency": 1, "output_throughput": 60.0, "median_ttft_ms": 900.0,
           "p99_ttft_ms": 950.0, "median_itl_ms": 7.0, "p99_itl_ms": 9.0}
    _serve_report(res, {"cache": "bf16", "capacity": 131_072, "start_s": 50.0, "runs": [
        run, dict(run, concurrency=3, output_throughput=150.0, median_itl_ms=9.0)]})
    # the servers' own logs: BF16 served, INT2 died at start (serve_bench then retried it with a remedy)
    (res / "server_bf16.log").write_text("The server is fired up and ready to roll!\n")
    (res / "server_oscar-int2.log").write_text("Capture cuda graph begin.\nTraceback (most recent call last):\n"
                                               '  File "cuda_graph_runner.py", line 1\n'
                                               "RuntimeError: operation not permitted when stream is capturing\n")
    harness = "\n".join([
        "set -u -o pipefail", f'RES="{res}"; OUT="{out}"; WORK="{work}"; ONLY="{only}"; T0=$SECONDS; rc=0',
        _function("publish"), _function("wanted"), _function("step"), steps, DONE_LINE, "publish"])
    subprocess.run(["bash", "-c", harness], check=True, capture_output=True, text=True, timeout=120)
    return out


STEPS = """
step env 60 bash -c 'echo "name, driver_version, memory.total [MiB], clocks.max.sm [MHz]"
  echo "NVIDIA H200, 580.159.03, 143771 MiB, 1980 MHz"; echo "ldd (GNU libc) 2.39"; echo 16
  echo "3.12.3 2.11.0+cu130 13.0 3.6.0 5.17.0 NVIDIA H200"'
echo "== SGLang not installed (the install step failed): server steps skipped" | tee -a "$RES/summary.txt"
step kernel_tests 100 bash -c 'echo "107 passed in 61.2s"'
step servers 1 bash -c 'echo starting; sleep 30'
step bench_kernels 60 bash -c 'echo Traceback; for i in $(seq 40); do echo "  frame $i"; done; echo "RuntimeError: boom"; exit 3'
step calibration 60 true
"""


def test_summary_of_the_scripts_own_steps_is_parsed_step_by_step(tmp_path):
    out = _device_run(tmp_path, STEPS, only="kernel_tests servers bench_kernels")
    summary = record.parse_summary((out / "summary.txt").read_text())
    by = {s.name: s for s in summary.steps}
    assert list(by) == ["env", "kernel_tests", "servers", "bench_kernels", "calibration"]
    assert (by["env"].rc, by["env"].limit, by["kernel_tests"].tail) == (0, 60, ["107 passed in 61.2s"])
    assert by["servers"].timed_out and by["servers"].rc == 124
    assert by["bench_kernels"].rc == 3 and by["bench_kernels"].tail[-1] == "RuntimeError: boom"
    assert by["calibration"].skipped == "ONLY=kernel_tests servers bench_kernels" and by["calibration"].rc is None
    assert summary.notes == ["SGLang not installed (the install step failed): server steps skipped"]
    assert summary.done is not None and summary.done[1] == 124      # the first failing step's code


def test_page_names_the_device_every_step_the_goals_and_what_failed(tmp_path):
    out = _device_run(tmp_path, STEPS, only="kernel_tests servers bench_kernels")
    docs = tmp_path / "docs"
    page = record.record([out], docs, [], "2026-12-09").read_text()
    assert page.startswith("# GPU results (2026-12-09)\n")
    assert ("Device: NVIDIA H200, 580.159.03, 143771 MiB, 1980 MHz; python, torch, CUDA, triton, transformers: "
            "3.12.3 2.11.0+cu130 13.0 3.6.0 5.17.0 NVIDIA H200.") in page
    assert f"## run1: `device tool: {record.FIRST_COMMAND}`" in page
    for row in ("| env | ok |", "| kernel_tests | ok |", "| servers | **timed out** (rc 124) |",
                "| bench_kernels | **failed** (rc 3) |", "| calibration | skipped (ONLY=kernel_tests servers"):
        assert row in page
    # the failure's own log, from the tarball, longer than the summary's 8-line tail
    failed = page[page.index("### What failed"):]
    assert "last 30 lines of bench_kernels.log:" in failed and "  frame 12" in failed
    assert "RuntimeError: boom" in failed and "(from summary.txt)" not in failed
    assert "`servers` (**timed out** (rc 124)), last 1 line of servers.log:\n\n```\nstarting\n```" in failed
    assert "kernel_tests.log" not in failed and "env.log" not in failed
    # a server that died is shown by its own log, whatever its step's exit code; one that served is not
    assert ("A server's traceback, last 4 lines of server_oscar-int2.log:" in failed
            and "RuntimeError: operation not permitted when stream is capturing" in failed)
    assert "server_bf16.log" not in failed
    # the goal table is goals.py's over the same reports: BF16 alone says INT2 is missing
    assert "| batch-1 median ITL no worse than BF16's | " in page and "not measured" in page
    # the server report as a section of run1, its files copied beside the page
    assert "\n### Real SGLang servers, BF16 vs oscar-int2 (CPU (dry run)" in page
    assert sorted(p.name for p in (docs / "gpu" / "2026-12-09" / "run1").iterdir()) == [
        "serve_bench.json", "serve_bench.md", "serve_bench.png"]
    assert "![serve_bench](gpu/2026-12-09/run1/serve_bench.png)" in page
    assert "no bench_kernels.json" in page


def test_the_prefill_probe_s_choice_and_the_calibration_cost_are_on_the_page(tmp_path):
    # from the JSON files the two scripts leave in the results (device_check.tar.gz)
    res = tmp_path / "work" / "results"
    res.mkdir(parents=True)
    probe = {"prompt": 32768, "chunk": 8192, "prefix": 24576, "kv_heads": 8, "d": 128, "cuda": True,
             "device": "NVIDIA H200", "kernel_ms": 9.5, "sdpa_ms": 6.25, "rel_err": 0.004, "choice": "sdpa",
             "why": "the sdpa path is 1.52x as fast (>= 1.2)", "sdpa_kv_heads": "as they are"}
    (res / "prefill_probe.json").write_text(json.dumps(probe))
    cal = {"model": "llama3-8b", "parameters": 8.03e9, "dtype": "bfloat16", "device_name": "NVIDIA H200",
           "method": "oscar-center", "tokens": 8192, "capture_s": 12.5, "total_s": 40.1, "peak_gpu_mb": 17000,
           "peak_rss_mb": 9000, "command": "calibrate_bench.py --tokens 8192"}
    # a report from before 2026-12-06 (no stages per layer) still makes its line
    assert record.calibration_line({"calibrate_bench.json": json.dumps(cal)}).startswith(
        "llama3-8b (8.03 B parameters, random weights, bfloat16) on NVIDIA H200: oscar-center over 8192 tokens, "
        "capture 12.5 s, whole pipeline 40.1 s")
    cal.update(layers=32, fit_s=24.0, fit_s_per_layer=0.75, policy_s=None, policy_s_per_layer=None)
    no_policy = {"calibrate_bench.json": json.dumps({**cal, "bits": None})}
    assert ": oscar-center over 8192 tokens, capture" in record.calibration_line(no_policy)
    # since 2026-12-06 the step runs oscar-calibrate's default pipeline: the policy's budget and the fit's threads
    line = record.calibration_line({"calibrate_bench.json": json.dumps(
        {**cal, "method": "optr", "bits": 2.75, "threads": 16, "policy_s": 8.0, "policy_s_per_layer": 2.0})})
    assert (": optr with the 2.75-bit policy over 8192 tokens (the fit on 16 CPU threads), capture 12.5 s, fit 24.0 s "
            "(0.75 s per layer), policy 8.0 s (2.0 s per layer), whole pipeline") in line
    (res / "calibrate_bench.json").write_text(json.dumps(cal))
    out = _device_run(tmp_path, "step prefill_probe 60 bash -c 'echo choice=sdpa'")
    page = record.record([out], tmp_path / "docs", [], "2026-12-09").read_text()
    assert ("### Prefill probe (before the servers)\n\none layer, 8192 new tokens over 24576 cached (8 KV heads, "
            "d 128) on NVIDIA H200: Triton extend kernel 9.50 ms, sdpa path 6.25 ms (KV heads as they are), max "
            "relative difference "
            "4.0e-03; the INT2 server's prefill: **sdpa** (the sdpa path is 1.52x as fast (>= 1.2))") in page
    assert ("### Calibration cost\n\nllama3-8b (8.03 B parameters, 32 layers, random weights, bfloat16) on NVIDIA "
            "H200: oscar-center over 8192 tokens, capture 12.5 s, fit 24.0 s (0.75 s per layer), whole pipeline 40.1 s"
            ) in page
    assert record.probe_line({}) is None and record.probe_line({"prefill_probe.json": "{"}) is None


def test_a_run_cut_by_the_device_tool_says_so(tmp_path):
    out = _device_run(tmp_path, STEPS, only="kernel_tests servers bench_kernels")
    text = (out / "summary.txt").read_text()
    cut = text[:text.index("   rc=124")]          # the tool stopped the script inside the servers step
    summary = record.parse_summary(cut)
    assert summary.done is None and summary.steps[-1].name == "servers" and summary.steps[-1].rc is None
    table = record.steps_table(summary)
    assert "| servers | **cut while running** (no exit line) |" in table
    assert "no closing line: the device tool stopped the script before its end" in table


def test_a_rerun_is_recorded_beside_the_first_and_judged_with_it(tmp_path):
    first = _device_run(tmp_path / "a", STEPS, only="kernel_tests servers bench_kernels")
    rerun = _device_run(tmp_path / "b", "step env 60 bash -c 'echo 3.12.3'\nstep servers 60 true", only="servers")
    # the rerun served INT2 alone (SERVE_CACHES=oscar-int2): serve_bench's writer over its results
    runs = [{"input_len": 32768, "concurrency": c, "output_throughput": t, "median_ttft_ms": 1.0,
             "p99_ttft_ms": 2.0, "median_itl_ms": itl, "p99_itl_ms": itl * 2} for c, t, itl in ((1, 65.0, 6.5),
                                                                                             (21, 800.0, 12.0))]
    _serve_report(rerun, {"cache": "oscar-int2", "capacity": 900_000, "start_s": 55.0, "runs": runs})
    docs = tmp_path / "docs"
    cmd = "DEVICE_LIMIT_S=160 ONLY=servers SERVE_CACHES=oscar-int2 bash scripts/device_check.sh"
    page = record.record([first, rerun], docs, ["device_check.sh, first run", cmd], "2026-12-09").read_text()
    assert "## run1: `device_check.sh, first run`" in page and f"## run2: `{cmd}`" in page
    assert "server results from: bf16: run1; oscar-int2: run2" in page
    assert "INT2 x21 1750 tok/s vs BF16 x3 333 tok/s: 5.25x" in page      # 21/12 ms vs 3/9 ms
    assert (docs / "gpu" / "2026-12-09" / "run2" / "serve_bench.json").is_file()


def test_an_earlier_date_s_record_is_kept_and_the_same_date_s_replaced(tmp_path):
    """A later session's record moves the page of an earlier date aside, its run folders untouched; recording the
    same date again (after a rerun) replaces that date's page; a second page of a kept date is refused."""
    out = _device_run(tmp_path, STEPS, only="kernel_tests servers bench_kernels")
    docs = tmp_path / "docs"
    (docs / "gpu" / "run1").mkdir(parents=True)          # an earlier record's folder (2026-12-04's layout)
    (docs / "gpu" / "run1" / "serve_bench.md").write_text("# earlier\n")
    (docs / "gpu_results.md").write_text("# GPU results (2026-12-04)\n\nearlier numbers\n")
    page = record.record([out], docs, [], "2026-12-09")
    assert (docs / "gpu_results_2026-12-04.md").read_text() == "# GPU results (2026-12-04)\n\nearlier numbers\n"
    assert (docs / "gpu" / "run1" / "serve_bench.md").read_text() == "# earlier\n"
    assert "Earlier records: [gpu_results_2026-12-04.md](gpu_results_2026-12-04.md)." in page.read_text()
    page = record.record([out, out], docs, [], "2026-12-09")    # the same date again, with a rerun
    assert page.read_text().startswith("# GPU results (2026-12-09)") and "## run2:" in page.read_text()
    assert sorted(p.name for p in docs.glob("gpu_results*.md")) == ["gpu_results.md", "gpu_results_2026-12-04.md"]
    assert "Earlier records: [gpu_results_2026-12-04.md]" in page.read_text()
    (docs / "gpu_results.md").write_text("# GPU results (2026-12-04)\n\nanother\n")
    with pytest.raises(SystemExit, match="exists already"):
        record.record([out], docs, [], "2026-12-10")
    assert (docs / "gpu_results.md").read_text() == "# GPU results (2026-12-04)\n\nanother\n"


def test_a_folder_without_a_summary_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no summary.txt"):
        record.record([tmp_path], tmp_path / "docs", [], "2026-12-09")


@pytest.mark.parametrize("case", ["bundled", "servers_fell_back", "machine", "bundle_failed"])
def test_the_page_says_which_triton_compiled_the_kernels_and_the_servers(tmp_path, case):
    """The env step prints the machine's Triton (3.6); where the carried one (3.8, a user's) passed its step,
    every later step imports it, and the page must say so rather than let the device line's version stand."""
    triton_step = {"bundled": "step triton 120 true", "servers_fell_back": "step triton 120 true",
                   "machine": "", "bundle_failed": "step triton 120 false"}[case]
    lines = [STEPS.split("echo \"== SGLang")[0], triton_step]
    if case in ("bundled", "servers_fell_back"):   # the script's own notes, as device_check.sh writes them
        lines.append("echo \"== the steps below import triton 3.8.0 from the bundle\" | tee -a \"$RES/summary.txt\"")
    if case == "servers_fell_back":
        lines.append("echo \"== the servers run on the machine's triton: torch's compiler (inductor)\" "
                     "\"failed with the bundle's in the triton step\" | tee -a \"$RES/summary.txt\"")
    # (the phrases as device_check.sh prints them, so that a change there fails here)
    assert 'echo "== the steps below import triton $("$PY" -c \'import triton; print(triton.__version__)\' 2>&1) ' \
           'from the bundle"' in SCRIPT
    assert '"== the servers run on the machine\'s triton: torch\'s compiler (inductor)" \\\n' \
           '        "failed with the bundle\'s in the triton step"' in SCRIPT
    out = _device_run(tmp_path, "\n".join(lines))
    page = record.record([out], tmp_path / "docs", [], "2026-12-09").read_text()
    compiler = next(ln for ln in page.splitlines() if ln.startswith("Compiler: "))
    if case == "bundled":
        assert compiler.startswith("Compiler: Triton 3.8.0, carried") and "the servers included" in compiler
    elif case == "servers_fell_back":
        assert "Triton 3.8.0, carried" in compiler and "**the servers on the machine's Triton**" in compiler
        assert "failed with the bundle's" in compiler
    else:
        assert compiler.startswith("Compiler: the machine's Triton (the device line's) for every step")
        assert ("the carried Triton's step: **failed** (rc 1)" in compiler) == (case == "bundle_failed")
