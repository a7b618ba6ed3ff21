"""The one rerun on the warm GPU machine, decided from a run's files (scripts/device/next_rerun.py).

Summaries are written by device_check.sh's own ``step`` function (cut out of the script, run in bash over small
commands), server reports by serve_bench's own writer, so the advisor reads what the producers write.
"""

import argparse
import json
import subprocess
from pathlib import Path

from script_modules import load_script, shell_function

ROOT = Path(__file__).resolve().parents[1]
serve_bench = load_script("device/serve_bench.py")
next_rerun = load_script("device/next_rerun.py")
DONE_LINE = next(ln for ln in (ROOT / "scripts/device_check.sh").read_text().splitlines()
                 if ln.startswith('echo "== done in'))

WHOLE = {"kernel_tests": "true", "servers": "true", "bench_kernels": "true", "calibration": "true"}


def _run(tmp_path: Path, steps: dict, done: bool = True, only: str = "", bf16=None, int2=None, kernels=None) -> Path:
    """A run's results folder: summary.txt from the script's own step function over ``steps`` (name: bash
    command; "TIMEOUT" sleeps past a 1 s limit), optionally without the closing line (the device tool cut it),
    serve_bench.json from its writer, bench_kernels.json as given."""
    res = tmp_path / "results"
    res.mkdir(parents=True)
    lines = ["step env 60 true"]
    for name, cmd in steps.items():
        lines.append(f"step {name} 1 sleep 5" if cmd == "TIMEOUT" else f"step {name} 60 {cmd}")
    harness = "\n".join(["set -u -o pipefail", f'RES="{res}"; OUT="{tmp_path}/out"; WORK="{tmp_path}"; '
                         f'ONLY="{only}"; T0=$SECONDS; rc=0; mkdir -p "$OUT"',
                         shell_function("device_check.sh", "publish"), shell_function("device_check.sh", "wanted"),
                         shell_function("device_check.sh", "step"),
                         *lines, *([DONE_LINE] if done else []), "true"])
    subprocess.run(["bash", "-c", harness], check=True, capture_output=True, text=True, timeout=60)
    results = [r for r in (bf16, int2) if r is not None]
    if results:
        args = argparse.Namespace(out=res, tag="", kv_budget_gib=16.0, mem_fraction_static=0.85,
                                  model=Path("llama3-8b"), dummy=True, tp=1, output_len=256)
        serve_bench.write_report(results, args, cpu=True)
    if kernels is not None:
        (res / "bench_kernels.json").write_text(json.dumps(kernels))
    return res


def _runs(*specs):
    """serve_bench runs from (input, concurrency, out tok/s, ITL ms, TTFT ms); a 2-tuple (input, concurrency)
    is a run skipped for time."""
    return [{"input_len": s[0], "concurrency": s[1], "skipped": "time limit (12 s left)"} if len(s) == 2 else
            {"input_len": s[0], "concurrency": s[1], "output_throughput": s[2], "median_itl_ms": s[3],
             "p99_itl_ms": 2 * s[3], "median_ttft_ms": s[4], "p99_ttft_ms": s[4]} for s in specs]


BF16 = {"cache": "bf16", "capacity": 131_072, "start_s": 50.0,
        "runs": _runs((32768, 1, 60.0, 7.0, 1500.0), (32768, 3, 150.0, 9.0, 3000.0))}
KERNELS = {"decode": [{"d": 128, "batch": 1, "context": 32768, "int2_copy_frac": 0.8, "speedup": 5.0,
                       "best_bf16": "sdpa"}]}


def _int2(*runs, start=55.0, **extra):
    return {"cache": "oscar-int2", "capacity": 886_000, "start_s": start, "runs": _runs(*runs), **extra}


def test_all_done_gives_the_machine_back(tmp_path):
    res = _run(tmp_path, WHOLE, bf16=BF16, int2=_int2((32768, 1, 65.0, 6.5, 1600.0), (32768, 26, 800.0, 12.0, 9e4)),
               kernels=KERNELS)
    command, why = next_rerun.advise(res)
    assert command == "give_back" and why.startswith("every step ended with rc 0")


def test_a_benchmark_cut_by_its_limit_or_never_started_is_run_again_first(tmp_path):
    int2 = _int2((32768, 1, 65.0, 6.5, 1600.0), (32768, 26))   # its wave missing too: the benchmark comes first
    res = _run(tmp_path / "a", dict(WHOLE, bench_kernels="TIMEOUT"), bf16=BF16, int2=int2)
    command, why = next_rerun.advise(res)
    assert command == "DEVICE_LIMIT_S=160 BENCH_BUDGET_S=90 ONLY=bench_kernels bash scripts/device_check.sh"
    assert why.endswith("was cut by its time limit")
    # the device tool cut the script in the servers step: no benchmark, no closing line
    res = _run(tmp_path / "b", {"kernel_tests": "true", "servers": "TIMEOUT"}, done=False, bf16=BF16)
    command, why = next_rerun.advise(res)
    assert "ONLY=bench_kernels" in command and why.endswith("never started")
    # a benchmark that failed by itself is not rerun (fixed here): the next rule's rerun, the failure said
    res = _run(tmp_path / "c", dict(WHOLE, bench_kernels="false"), bf16=BF16, int2=int2)
    command, why = next_rerun.advise(res)
    assert "--largest-only" in command and "ONLY=bench_kernels" not in command
    assert why.endswith("; also failed by itself: bench_kernels (fix here from its log, with a test; a rerun "
                        "without a code change fails the same way)")


def test_a_missing_wave_that_fits_is_served_alone_with_the_first_runs_knobs(tmp_path):
    int2 = _int2((32768, 1, 65.0, 10.0, 1500.0), (32768, 26), knobs={"OSCAR_SGLANG_EXTEND_KERNEL": "sdpa"})
    res = _run(tmp_path, dict(WHOLE, servers="false"), bf16=BF16, int2=int2, kernels=KERNELS)
    command, why = next_rerun.advise(res)   # servers rc 1 for a skipped run is no failure of ours
    assert command == ('DEVICE_LIMIT_S=160 OSCAR_SGLANG_EXTEND_KERNEL=sdpa SERVE_ARGS="--input-lens 32768 '
                       '--largest-only --cuda-graph-max-bs 26" ONLY=servers SERVE_CACHES=oscar-int2 '
                       'bash scripts/device_check.sh')
    assert "needs ~97 s, which fits" in why     # 55 s + 26 x 1.5 s + 256 x 10 ms


def test_a_wave_that_does_not_fit_gives_way_to_the_kernel_tests_or_the_machine_back(tmp_path):
    int2 = _int2((32768, 1, 65.0, 10.0, 4000.0), (32768, 26))    # 26 x 4 s: no rerun can serve it
    res = _run(tmp_path / "a", dict(WHOLE, kernel_tests="TIMEOUT"), bf16=BF16, int2=int2, kernels=KERNELS)
    assert next_rerun.advise(res)[0] == "DEVICE_LIMIT_S=160 ONLY=kernel_tests bash scripts/device_check.sh"
    res = _run(tmp_path / "b", WHOLE, bf16=BF16, int2=int2, kernels=KERNELS)
    command, why = next_rerun.advise(res)
    assert command == "give_back" and "which does not fit the ~115 s a servers rerun has" in why


def test_a_missed_itl_goal_with_a_clearly_faster_decode_tile_reruns_int2_with_it(tmp_path):
    def tuning(block_n, warps, ms):
        return [{"d": 128, "batch": b, "context": 32768, "block_n": block_n, "num_warps": warps, "num_stages": 2,
                 "int2_ms": ms} for b in (1, 32)]

    kernels = dict(KERNELS, tuning=tuning(32, 4, 0.30) + tuning(64, 8, 0.24))   # 1.25x the default's speed
    int2 = _int2((32768, 1, 65.0, 7.5, 1600.0), (32768, 26, 800.0, 12.0, 9e4))  # ITL 7.5 vs 7.0 ms: missed
    res = _run(tmp_path / "a", WHOLE, bf16=BF16, int2=int2, kernels=kernels)
    command, why = next_rerun.advise(res)
    assert command == ('DEVICE_LIMIT_S=160 OSCAR_SGLANG_DECODE_KERNEL=block_n=64,num_warps=8,num_stages=2 '
                       'OSCAR_SGLANG_EXTEND_KERNEL=sdpa SERVE_ARGS="--input-lens 32768" ONLY=servers '
                       'SERVE_CACHES=oscar-int2 bash scripts/device_check.sh')
    assert "batch-1 median ITL" in why and "1.25x" in why
    # the first run's server needed its graphs off: the rerun starts so
    res = _run(tmp_path / "c", WHOLE, bf16=BF16, int2=dict(int2, remedies=["eager"]), kernels=kernels)
    assert 'SERVE_ARGS="--input-lens 32768 --remedies eager"' in next_rerun.advise(res)[0]
    # 1.10x is not worth the machine's last minutes
    kernels = dict(KERNELS, tuning=tuning(32, 4, 0.30) + tuning(64, 8, 0.273))
    res = _run(tmp_path / "b", WHOLE, bf16=BF16, int2=int2, kernels=kernels)
    command, why = next_rerun.advise(res)
    assert command == "give_back" and "only 1.10x the default's" in why


def test_failures_of_our_code_are_fixed_here_not_rerun(tmp_path):
    int2 = _int2((32768, 1, 65.0, 6.5, 1600.0), (32768, 26, 800.0, 12.0, 9e4))
    int2["runs"][0] = {"input_len": 32768, "concurrency": 1, "error": "bench_serving exited 1: Traceback ..."}
    res = _run(tmp_path, dict(WHOLE, kernel_tests="false", servers="false"), bf16=BF16, int2=int2, kernels=KERNELS)
    command, why = next_rerun.advise(res)
    assert command == "give_back" and why.startswith("failed by itself: kernel_tests, servers (fix here")


def test_a_servers_only_call_is_followed_by_the_plan_s_kernel_call_and_that_one_by_nothing_it_skipped(tmp_path):
    """docs/GPU.md's lent session: step 1 serves only (goals 3-4), step 2 the fold's native tests and the kernel
    benchmark (goals 1-2); after step 2, whose summary skips the servers, nothing is asked for again."""
    res = _run(tmp_path / "1", {"kernel_tests": "true", "servers": "true", "bench_kernels": "true"},
               only="install models prefill_probe servers", bf16=BF16,
               int2=_int2((32768, 1, 65.0, 6.5, 1600.0), (32768, 26, 800.0, 12.0, 9e4)))
    text = (res / "summary.txt").read_text()
    assert "== bench_kernels: skipped" in text and "== kernel_tests: skipped" in text
    command, why = next_rerun.advise(res)
    assert command == next_rerun.BENCH_CALL and "goals 1-2 are not measured" in why
    for test_id in next_rerun.FOLD_TESTS.split():   # each names a test that exists
        path, _, name = test_id.partition("::")
        assert (ROOT / "tests" / path).is_file() and (not name or f"def {name}(" in (ROOT / "tests" / path).read_text())
    gpu_md = " ".join((ROOT / "docs" / "GPU.md").read_text().split())
    assert " ".join(next_rerun.FOLD_TESTS.split()) in gpu_md.replace('\\"', '"')   # the plan's step 2 runs the same

    res = _run(tmp_path / "2", {"kernel_tests": "true", "servers": "true", "bench_kernels": "true"},
               only="install kernel_tests bench_kernels", kernels=KERNELS)
    assert "== servers: skipped" in (res / "summary.txt").read_text()
    assert next_rerun.advise(res)[0] == "give_back"


def test_the_command_line_prints_the_advice(tmp_path, capsys):
    res = _run(tmp_path, WHOLE, bf16=BF16, int2=_int2((32768, 1, 65.0, 6.5, 1600.0), (32768, 26, 800.0, 12.0, 9e4)),
               kernels=KERNELS)
    assert next_rerun.main([str(res)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "next (scripts/device/next_rerun.py): give_back" and out[1].startswith("   why: ")
    assert next_rerun.advise(tmp_path / "nowhere") == ("give_back", f"no summary.txt in {tmp_path / 'nowhere'}")
