"""What to run next on the warm GPU machine after a device run: docs/GPU.md's "After the first run" as code.

    python3 scripts/device/next_rerun.py RESULTS_DIR    # "next (...): COMMAND" or "next (...): give_back", "why: ..."

The device tool gives the machine back 30 s after a call ends and a first run leaves too little device time to
start another, so the one rerun is decided at once, from the first run's summary.txt and reports.
``scripts/device_check.sh`` prints this at its end (the device tool's reply shows it in its output tail); on
files brought back from a run the tool cut before its end, run it here with a bare ``python3``.

The first rule that applies (one rerun only):

1. the kernel benchmark's decode section is missing (goals 1-2 not measured) because its step timed out, was
   cut while running or never started: ``ONLY=bench_kernels`` (no server start, the likeliest to succeed);
2. INT2's 32k wave is missing and the wave alone fits a servers rerun (``goals.wave_rerun``'s estimate from the
   first run's own start and TTFT): that wave alone, with the first run's knobs;
3. a servers-only call (docs/GPU.md's step 1 of a lent session) left goals 1-2 unmeasured: the plan's step 2,
   the fold's native tests and the kernel benchmark (:data:`BENCH_CALL`);
4. the kernel tests timed out or were cut (compiling): ``ONLY=kernel_tests``;
5. the batch-1 ITL or decode-rate goal was missed and the benchmark's decode tile sweep found a tile at least
   ``TILE_GAIN`` x the default's speed: the INT2 server at 32k with that tile;
6. otherwise ``give_back``: every step passed, or nothing left that a rerun could add fits.

A step that ended by itself with an error (not by a time limit; for the servers step, anything but a run cut
by its own time) is a failure to fix here from its log: no rule reruns it, and "why" names it with any advice.

Not automated: the extend-tile rerun of docs/GPU.md (its gain on the server's prefill is a judgement).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goals  # noqa: E402  (beside this file; bare python3)
import record  # noqa: E402

TILE_GAIN = 1.15   # a decode tile must be this much faster over the sweep to be worth the rerun
LIMIT = f"DEVICE_LIMIT_S={goals.RERUN_LIMIT_S}"
# The kernel tests that prove the fold's inline PTX, the read kernel and head size 256 natively, and what the call after a
# servers-only one runs (docs/GPU.md, "The next lent session", step 2, quotes it).
FOLD_TESTS = ("test_int2_codes_ptx.py test_kernels_read.py test_kernels_head_dim_256.py "
              "test_kernels_decode.py::test_decode_with_folded_scales_is_within_fp16_rounding_of_the_reference "
              "test_kernels_decode.py::test_decode_fold_is_ignored_where_it_does_not_apply test_decode_autotune.py")
BENCH_CALL = (f'ONLY="kernel_tests bench_kernels" BENCH_BUDGET_S=70 KERNEL_TEST_IDS="{FOLD_TESTS}" '
              "bash scripts/device_check.sh")


def _cut(step) -> bool:
    """Stopped by a limit: its own timeout, or the device tool's (no exit line)."""
    return step is not None and step.skipped is None and (step.rc is None or step.timed_out)


def _server_failed(serve: dict) -> bool:
    """Whether something failed in a servers report other than a run cut by its own time (serve_bench exits 1
    for those too)."""
    return any(r.get("error") or any(run.get("error") and "timed out after" not in run["error"]
                                     for run in r.get("runs", []))
               for r in serve.get("results", []))


def advise(folder: Path) -> tuple[str, str]:
    """(command, or "give_back"; why) for the run whose files are in ``folder``."""
    try:
        summary = record.parse_summary((folder / "summary.txt").read_text())
    except OSError:
        return "give_back", f"no summary.txt in {folder}"
    kernels = goals.read_report(folder / "bench_kernels.json")
    serve = goals.read_report(folder / "serve_bench.json")
    failed = [s.name for s in summary.steps if s.skipped is None and s.rc not in (None, 0) and not s.timed_out
              and not (s.name == "servers" and serve is not None and not _server_failed(serve))]
    fix = (f"failed by itself: {', '.join(failed)} (fix here from its log, with a test; a rerun without a code "
           "change fails the same way)") if failed else ""
    command, why = _rerun(summary, kernels, serve)
    if command != "give_back":
        return command, why + (f"; also {fix}" if fix else "")
    notes = [n for n in (fix, why) if n]
    return "give_back", "; ".join(notes) or "every step ended with rc 0 and nothing a rerun could add was found"


def _rerun(summary, kernels: dict | None, serve: dict | None) -> tuple[str, str]:
    """The rules of the module's docstring: (command, why), or ("give_back", what was considered or '')."""
    steps = {s.name: s for s in summary.steps}
    notes = []
    bench = steps.get("bench_kernels")
    if all(g["verdict"] == "not measured" for g in goals.kernel_goals(kernels)) and "env" in steps:
        never = bench is None and summary.done is None   # the run was cut before the benchmark started
        if _cut(bench) or never:
            return (f"{LIMIT} BENCH_BUDGET_S=90 ONLY=bench_kernels bash scripts/device_check.sh",
                    "the kernel benchmark's decode section is missing (goals 1-2 not measured): its step "
                    + ("never started" if never else "was cut by its time limit"))

    wave = goals.wave_rerun(serve)
    if wave is not None:
        if wave["fits"]:
            return wave["command"], wave["text"]
        notes.append(wave["text"])

    servers = steps.get("servers")
    if (bench is not None and bench.skipped is not None and servers is not None and servers.skipped is None
            and all(g["verdict"] == "not measured" for g in goals.kernel_goals(kernels))):
        return (BENCH_CALL, "a servers-only call (the plan's step 1) is done and goals 1-2 are not measured: the "
                "kernel benchmark under the same Triton, and the fold's inline PTX natively (docs/GPU.md, step 2; "
                "timeout_s 250 on the warm machine)")

    if _cut(steps.get("kernel_tests")):
        return (f"{LIMIT} ONLY=kernel_tests bash scripts/device_check.sh",
                "the kernel tests were cut by their time limit (compiling): the rest of them, natively")

    missed = [g["goal"] for g in goals.server_goals(serve) if g["verdict"] not in ("met", "not measured")]
    tile = goals.fastest_decode_tile(kernels)
    if missed and tile and not tile["default"]:
        if tile["speedup"] >= TILE_GAIN:
            knobs = dict(goals.int2_knobs(serve), OSCAR_SGLANG_DECODE_KERNEL=tile["knob"])
            return (goals.servers_rerun_command(knobs, f"--input-lens {goals.LONG}" + goals.int2_remedies(serve)),
                    f"missed: {'; '.join(missed)}; the decode tile {tile['knob']} was {tile['speedup']:.2f}x the "
                    "default's speed over the benchmark's sweep: the INT2 server at 32k with it")
        notes.append(f"the fastest decode tile was only {tile['speedup']:.2f}x the default's (< {TILE_GAIN})")
    return "give_back", "; ".join(notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="the run's results folder (the device tool's files_at)")
    a = p.parse_args(argv)
    command, why = advise(a.results)
    print(f"next (scripts/device/next_rerun.py): {command}\n   why: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
