"""The GPU script's server benchmark serves a failed cache again with the remedy its log calls for.

Neither server has run on a GPU; a lent machine gives ~15 minutes, so the
script must recover by itself from the failures foreseen in docs/GPU.md (a JIT
kernel refused by SGLANG_CRASH_ON_JIT_COMPILE, CUDA graphs that do not
capture) instead of costing a rerun. Here the serving is replaced by a script
of outcomes; what is checked is which remedies each attempt gets, in which
order, when the ladder stops, and what the report says.
"""

import argparse
import json
import sys
import time
import types
from pathlib import Path

import pytest

from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
serve_bench = load_script("device/serve_bench.py")

# the message SGLang 0.5.23's JIT loader raises under the crash flag (kernels/jit/utils/compile/loader.py)
JIT_LOG = ("RuntimeError: JIT module 'store_cache' has no usable cached build under /root/.cache/x, and "
           "SGLANG_CRASH_ON_JIT_COMPILE forbids compiling at runtime. Seed the cache with prebuilt artifacts")
GRAPH_LOG = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
# a capture that failed inside the INT2 backend's recorded hot pool update (the traceback passes through it)
HOT_LOG = ('  File "/site/oscar_sglang/sglang/backend.py", line 189, in init_forward_metadata_in_graph\n'
           + GRAPH_LOG)


def test_the_loader_still_words_its_refusal_as_matched():
    loader = (ROOT / ".venv/lib/python3.11/site-packages/sglang/kernels/jit/utils/compile/loader.py")
    if not loader.exists():
        pytest.skip("SGLang is not installed in .venv")
    assert serve_bench.JIT_REFUSED in loader.read_text()


@pytest.mark.parametrize("log,tried,cpu,expected", [
    (JIT_LOG, [], False, "jit"),
    (JIT_LOG, ["jit"], False, "eager"),  # compiled, then something else broke
    (GRAPH_LOG, [], False, "eager"),
    (GRAPH_LOG, ["eager"], False, None),
    (HOT_LOG, [], False, "hot-eager"),  # the graphs may still work with the update out of them
    (HOT_LOG, ["hot-eager"], False, "eager"),
    (HOT_LOG, ["jit", "hot-eager"], False, "eager"),
    (JIT_LOG + "\n" + HOT_LOG, [], False, "jit"),
    (HOT_LOG, [], True, None),
    (JIT_LOG, ["jit", "eager"], False, None),
    (JIT_LOG, [], True, None),  # the dry run: a failure on CPU is a bug, not something to work around
    ("", [], False, "eager"),
])
def test_next_remedy(log, tried, cpu, expected):
    assert serve_bench.next_remedy(log, tried, cpu) == expected


def _args(tmp_path, **kw):
    return argparse.Namespace(out=tmp_path, tag="", **kw)


class Outcomes:
    """Stands in for serve_and_bench: one outcome per call, in order; records the remedies of each call."""

    def __init__(self, *outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def __call__(self, cache, args, deadline, cpu, remedies, log, progress=None):
        self.calls.append((cache, list(remedies), log.name))
        kind, text = self.outcomes.pop(0)
        log.write_text(text)
        if kind == "start":
            raise serve_bench.launcher.ServerError(f"server exited with 1:\n{text}")
        if kind == "runs":
            return {"cache": cache, "runs": [{"input_len": 8, "concurrency": 1, "error": text}], "remedies": remedies}
        return {"cache": cache, "runs": [{"input_len": 8, "concurrency": 1, "output_throughput": 1.0}],
                "remedies": list(remedies)}


def test_a_refused_jit_kernel_is_compiled_and_later_servers_start_with_it(tmp_path, monkeypatch):
    fake = Outcomes(("start", JIT_LOG), ("ok", "fired up"), ("ok", "fired up"))
    monkeypatch.setattr(serve_bench, "serve_and_bench", fake)
    sticky = []
    deadline = time.perf_counter() + 600
    first = serve_bench.serve_with_remedies("bf16", _args(tmp_path), deadline, False, sticky)
    second = serve_bench.serve_with_remedies("oscar-int2", _args(tmp_path), deadline, False, sticky)
    assert fake.calls == [("bf16", [], "server_bf16.log"), ("bf16", ["jit"], "server_bf16_jit.log"),
                          ("oscar-int2", ["jit"], "server_oscar-int2.log")]
    assert sticky == ["jit"]
    assert first["remedies"] == ["jit"] and len(first["attempts"]) == 1
    assert "forbids compiling" in first["attempts"][0]["error"] and "nvcc" in first["fallback"]
    assert "attempts" not in second
    assert (tmp_path / "server_bf16.log").read_text() == JIT_LOG  # the failed attempt's log is kept


def test_runs_that_all_fail_count_as_a_failure_and_graphs_go_off_last(tmp_path, monkeypatch):
    fake = Outcomes(("runs", "bench_serving exited 1"), ("start", GRAPH_LOG))
    monkeypatch.setattr(serve_bench, "serve_and_bench", fake)
    res = serve_bench.serve_with_remedies("oscar-int2", _args(tmp_path), time.perf_counter() + 600, False, [])
    assert [c[1] for c in fake.calls] == [[], ["eager"]]  # no JIT message: graphs off; then nothing is left
    assert res["error"].endswith(GRAPH_LOG) and res["remedies"] == ["eager"]


def test_a_remedy_that_did_not_help_is_not_kept_for_later_servers(tmp_path, monkeypatch):
    fake = Outcomes(("start", JIT_LOG), ("start", GRAPH_LOG), ("start", GRAPH_LOG))
    monkeypatch.setattr(serve_bench, "serve_and_bench", fake)
    sticky = []
    res = serve_bench.serve_with_remedies("bf16", _args(tmp_path), time.perf_counter() + 600, False, sticky)
    assert [c[1] for c in fake.calls] == [[], ["jit"], ["jit", "eager"]]
    assert sticky == [] and "error" in res and len(res["attempts"]) == 2


def test_no_retry_on_cpu_or_without_time_left(tmp_path, monkeypatch):
    fake = Outcomes(("start", JIT_LOG), ("start", JIT_LOG))
    monkeypatch.setattr(serve_bench, "serve_and_bench", fake)
    serve_bench.serve_with_remedies("bf16", _args(tmp_path), time.perf_counter() + 600, True, [])
    serve_bench.serve_with_remedies("bf16", _args(tmp_path), time.perf_counter() + serve_bench.RETRY_MIN_S - 5,
                                    False, [])
    assert [c[1] for c in fake.calls] == [[], []]


def test_a_success_with_some_runs_failing_is_not_retried(tmp_path, monkeypatch):
    def one_of_two_fails(cache, args, deadline, cpu, remedies, log, progress=None):
        log.write_text(JIT_LOG)
        return {"cache": cache, "remedies": list(remedies),
                "runs": [{"output_throughput": 3.0}, {"error": "bench_serving exited 1"}]}

    monkeypatch.setattr(serve_bench, "serve_and_bench", one_of_two_fails)
    res = serve_bench.serve_with_remedies("bf16", _args(tmp_path), time.perf_counter() + 600, False, [])
    assert "attempts" not in res and res["remedies"] == []


def test_the_report_names_the_remedies(tmp_path):
    results = [{"cache": "bf16", "capacity": 1000, "start_s": 40.0, "remedies": ["eager"],
                "fallback": "--disable-cuda-graph: CUDA graphs off (after: capture failed)",
                "runs": [{"input_len": 8192, "concurrency": 1, "output_throughput": 50.0, "median_ttft_ms": 9.0,
                          "p99_ttft_ms": 10.0, "median_itl_ms": 5.0, "p99_itl_ms": 6.0}]}]
    args = argparse.Namespace(out=tmp_path, tag="", kv_budget_gib=16.0, mem_fraction_static=0.85, model=tmp_path,
                              dummy=True, tp=1, output_len=256)
    serve_bench.write_report(results, args, cpu=True)
    md = (tmp_path / "serve_bench.md").read_text()
    assert "| 5.00 | 6.00 | remedies: eager |" in md and "CUDA graphs off (after: capture failed)" in md
    results[0]["knobs"] = {"OSCAR_SGLANG_EXTEND_KERNEL": "block_rows=128"}
    serve_bench.write_report(results, args, cpu=True)
    md = (tmp_path / "serve_bench.md").read_text()
    assert "| 5.00 | 6.00 | remedies: eager; OSCAR_SGLANG_EXTEND_KERNEL=block_rows=128 |" in md


def _serve_main(tmp_path, monkeypatch, fake_bench, *extra, log_text=""):
    """serve_bench's real main over a fake server (capacity 3 requests of 64 + 8 tokens, its log started with
    ``log_text``) and ``fake_bench`` for bench_serving; input 64, output 8. Returns main's exit code."""
    import contextlib

    @contextlib.contextmanager
    def fake_server(model, log, *flags, **kw):
        Path(log).write_text(log_text)
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(serve_bench.launcher, "local_server", fake_server)
    monkeypatch.setattr(serve_bench.launcher, "capacity", lambda url: 3 * (64 + 8))
    monkeypatch.setattr(serve_bench.launcher, "cuda_visible", lambda: False)
    monkeypatch.setattr(serve_bench, "bench", fake_bench)
    return serve_bench.main(["--model", str(tmp_path), "--rotations", str(tmp_path), "--dataset-path", str(tmp_path),
                             "--out", str(tmp_path), "--input-lens", "64", "--output-len", "8", "--kv-budget-gib", "0",
                             *extra])


def test_the_report_is_rewritten_after_every_run(tmp_path, monkeypatch):
    """A run cut short by the device's limit keeps the report of every run finished before it."""
    seen = []

    def fake_bench(url, args, input_len, conc, prompts, out_file, timeout=None):
        md = tmp_path / "serve_bench.md"
        seen.append(md.read_text() if md.exists() else "")
        return {"wall_s": 1.0, "completed": prompts, "output_throughput": 10.0 * conc, "median_ttft_ms": 5.0,
                "p99_ttft_ms": 6.0, "median_itl_ms": float(len(seen)), "p99_itl_ms": 9.0}

    loop = "oscar_int2 decode loop: fold, 2 warps (fold=1,num_warps=2), timed at startup on a GPU in 9.0 s"
    rc = _serve_main(tmp_path, monkeypatch, fake_bench, log_text=f"The server is fired up\nINFO {loop}\n")
    assert rc == 0 and len(seen) == 4  # bf16 x1, x3, then oscar-int2 x1, x3
    assert "| bf16 | 216 |" in seen[0] and "| bf16 | 64 |" not in seen[0]  # started, no run yet
    assert "| bf16 | 64 | 1 | 10.0 |" in seen[1] and "| bf16 | 64 | 3 |" not in seen[1]
    assert "| bf16 | 64 | 3 | 30.0 |" in seen[2] and "| oscar-int2 | 216 |" in seen[2]
    assert "| oscar-int2 | 64 | 1 | 10.0 | 333 | - | 5 | 6 | 3.00 |" in seen[3]  # decode tok/s: 1 x 1000 / 3 ms
    # the INT2 server's startup timing of its decode loop, from its log, in the report and the JSON
    assert "\nINT2 decode loop: fold, 2 warps (fold=1,num_warps=2), timed at startup" in seen[3]
    int2 = [r for r in json.loads((tmp_path / "serve_bench.json").read_text())["results"] if r["cache"] == "oscar-int2"]
    assert int2[0]["decode_loop"].startswith("fold, 2 warps (fold=1,num_warps=2)")


def test_sigterm_stops_the_server_and_keeps_the_report(tmp_path):
    """A step's ``timeout`` sends SIGTERM: the server (its own session, out of the kill's reach) must still be
    stopped, or it holds the GPU's memory for the kernel benchmark after it; the runs done stay reported."""
    import signal
    import subprocess

    script = tmp_path / "run.py"
    script.write_text(f"""
import contextlib, sys, time
from pathlib import Path
sys.path.insert(0, {str(ROOT / "scripts" / "device")!r})
import serve_bench
out = Path({str(tmp_path)!r})

@contextlib.contextmanager
def server(model, log, *flags, **kw):
    try:
        yield "http://127.0.0.1:1"
    finally:
        (out / "stopped").write_text("yes")

calls = []
def bench(url, args, input_len, conc, prompts, out_file, timeout=None):
    calls.append(conc)
    if len(calls) == 2:
        (out / "second_run").write_text("")
        time.sleep(60)
    return dict(wall_s=1.0, completed=1, output_throughput=7.0, median_ttft_ms=1.0, p99_ttft_ms=1.0,
                median_itl_ms=2.0, p99_itl_ms=3.0)

serve_bench.launcher.local_server = server
serve_bench.launcher.capacity = lambda url: 1000
serve_bench.launcher.startup_line = lambda log, *marker: ""
serve_bench.launcher.cuda_visible = lambda: False
serve_bench.bench = bench
sys.exit(serve_bench.main(["--model", str(out), "--rotations", str(out), "--dataset-path", str(out), "--out",
                           str(out), "--input-lens", "64", "--output-len", "8", "--kv-budget-gib", "0"]))
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while not (tmp_path / "second_run").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, out.decode()[-2000:]
    assert (tmp_path / "stopped").read_text() == "yes"
    assert "| bf16 | 64 | 1 | 7.0 |" in (tmp_path / "serve_bench.md").read_text()


def test_each_server_gets_a_share_and_its_largest_run_all_of_it(tmp_path, monkeypatch):
    """BF16 first may use half of the time limit (a slow baseline cannot starve the INT2 server), the last server
    all that is left; a concurrency-1 run is bounded by --run-timeout, a largest-concurrency run only by its
    server's share. On serve_bench's own clock, which only the fake runs move (10 s each): the shares are
    exact, however slow the machine running the test."""
    timeouts, now = [], [1000.0]
    monkeypatch.setattr(serve_bench, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def fake_bench(url, args, input_len, conc, prompts, out_file, timeout=None):
        timeouts.append((conc, timeout))
        now[0] += 10.0
        return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_itl_ms": 4.0,
                "p99_itl_ms": 5.0}

    rc = _serve_main(tmp_path, monkeypatch, fake_bench, "--time-limit", "100", "--run-timeout", "20")
    assert rc == 0 and [c for c, _ in timeouts] == [1, 3, 1, 3]
    (_, b1), (_, b3), (_, i1), (_, i3) = timeouts
    assert b1 == 20 and i1 == 20  # --run-timeout
    assert b3 == 50 - 10 - 5      # half of 100 s, less its first run, less 5
    assert i3 == 100 - 30 - 5     # the rest after three runs, less 5
    report = json.loads((tmp_path / "serve_bench.json").read_text())
    assert [r["decode_tok_s"] for res in report["results"] for r in res["runs"]] == [250.0, 750.0, 250.0, 750.0]


def test_largest_only_serves_just_the_largest_concurrency_with_all_of_its_share(tmp_path, monkeypatch):
    """A short rerun that lacks only a largest-concurrency run (--largest-only): no concurrency-1 run before it,
    so the wave gets the server's whole share (on serve_bench's own clock, as above)."""
    timeouts, now = [], [1000.0]
    monkeypatch.setattr(serve_bench, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def fake_bench(url, args, input_len, conc, prompts, out_file, timeout=None):
        timeouts.append((input_len, conc, prompts, timeout))
        now[0] += 10.0
        return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_itl_ms": 4.0,
                "p99_itl_ms": 5.0}

    rc = _serve_main(tmp_path, monkeypatch, fake_bench, "--time-limit", "100", "--caches", "oscar-int2",
                     "--largest-only")
    assert rc == 0 and timeouts == [(64, 3, 3, 100 - 5)]
    runs = json.loads((tmp_path / "serve_bench.json").read_text())["results"][0]["runs"]
    assert [(r["input_len"], r["concurrency"]) for r in runs] == [(64, 3)]


def test_remedies_given_at_the_start_reach_every_server_without_a_failed_start(tmp_path, monkeypatch):
    """A rerun of a server whose first run needed remedies (--remedies jit eager): its first start has them."""
    starts = []

    def fake(cache, args, deadline, cpu, remedies=(), log=None, progress=lambda res: None):
        starts.append((cache, list(remedies), log.name))
        return {"cache": cache, "runs": [{"output_throughput": 1.0}]}

    monkeypatch.setattr(serve_bench, "serve_and_bench", fake)
    monkeypatch.setattr(serve_bench, "write_report", lambda *a, **k: (tmp_path / "serve_bench.md").write_text(""))
    rc = serve_bench.main(["--model", str(tmp_path), "--rotations", str(tmp_path), "--dataset-path", str(tmp_path),
                           "--out", str(tmp_path), "--caches", "oscar-int2", "--remedies", "jit", "eager"])
    assert rc == 0 and starts == [("oscar-int2", ["jit", "eager"], "server_oscar-int2.log")]


def test_cache_deadline_is_an_even_share_of_what_is_left():
    assert serve_bench.cache_deadline(10.0, 110.0, 2) == 60.0
    assert serve_bench.cache_deadline(10.0, 110.0, 1) == 110.0
    assert serve_bench.cache_deadline(120.0, 110.0, 2) == 120.0  # nothing left: no time, not negative


# two lines as SGLang 0.5.23's scheduler writes them (from a dry run's server log), one with the iteration tag
DECODE_LINES = (
    "[2026-12-03 01:45:24] Decode batch, #running-req: 4, #token: 1048, token usage: 0.00, cpu graph: False, "
    "gen throughput (token/s): 1.90, #queue-req: 0\n"
    "[2026-12-03 01:45:30 TP0] Decode batch [812], #running-req: 26, #token: 858624, token usage: 0.97, "
    "cuda graph: True, gen throughput (token/s): 2650.41, #queue-req: 0\n")


def test_decode_log_stats_read_the_schedulers_decode_lines():
    stats = serve_bench.decode_log_stats("noise\n" + DECODE_LINES + DECODE_LINES.replace("2650.41", "2100.00"))
    assert stats == {"max_running_req": 26, "server_decode_tok_s": 2650.41}
    assert serve_bench.decode_log_stats("The server is fired up\n") == {}


def test_the_scheduler_still_writes_the_decode_line_as_matched():
    """The pieces DECODE_LINE relies on, in the installed SGLang's format string (its own log_parser wants a comma
    after #queue-req that 0.5.23 no longer writes, so it cannot be the reference)."""
    pytest.importorskip("sglang")
    import importlib.util as iu

    src = Path(iu.find_spec("sglang.srt.managers.scheduler_components.metrics_reporter").origin).read_text()
    for piece in ('f"Decode batch{iter_msg}, #running-req: {num_running_reqs}, ',
                  'f"gen throughput (token/s): {self.last_gen_throughput:.2f}, "',
                  'self.last_gen_throughput = self.num_generated_tokens / gap_latency'):
        assert piece in src, piece


def test_each_run_reports_the_servers_decode_rate_of_its_own_stretch_of_the_log(tmp_path, monkeypatch):
    def fake_bench(url, args, input_len, conc, prompts, out_file, timeout=None):
        cache = out_file.name.split("_")[1]
        with open(tmp_path / f"server_{cache}.log", "a") as f:
            f.write(f"[2026-12-03 01:00:01] Decode batch, #running-req: {conc}, #token: 9, token usage: 0.00, "
                    f"cuda graph: True, gen throughput (token/s): {100.0 * conc + (cache == 'oscar-int2')}, "
                    "#queue-req: 0\n")
        return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_itl_ms": 4.0,
                "p99_itl_ms": 5.0}

    # a warm-up line before any run, faster than any run: must not be counted
    warm_up = ("[2026-12-03 01:00:00] Decode batch, #running-req: 3, #token: 9, token usage: 0.00, "
               "cuda graph: True, gen throughput (token/s): 99999.00, #queue-req: 0\n")
    assert _serve_main(tmp_path, monkeypatch, fake_bench, log_text=warm_up) == 0
    runs = [(res["cache"], r["concurrency"], r["server_decode_tok_s"], r["max_running_req"])
            for res in json.loads((tmp_path / "serve_bench.json").read_text())["results"] for r in res["runs"]]
    assert runs == [("bf16", 1, 100.0, 1), ("bf16", 3, 300.0, 3), ("oscar-int2", 1, 101.0, 1),
                    ("oscar-int2", 3, 301.0, 3)]
    assert "| oscar-int2 | 64 | 3 | 1.0 | 750 | 301 (3) |" in (tmp_path / "serve_bench.md").read_text()


def test_a_run_cut_by_its_timeout_keeps_what_the_server_logged(tmp_path, monkeypatch):
    """The INT2 wave of 32k prompts may outlast its share: the decode rate the server logged until then stays."""
    import subprocess

    def fake_bench(url, args, input_len, conc, prompts, out_file, timeout=None):
        with open(tmp_path / "server_oscar-int2.log", "a") as f:
            f.write(f"[2026-12-03 01:00:01] Decode batch, #running-req: {conc}, #token: 9, token usage: 0.00, "
                    f"cuda graph: True, gen throughput (token/s): {123.0 * conc}, #queue-req: 0\n")
        if conc > 1:
            raise subprocess.TimeoutExpired(["bench_serving"], timeout)
        return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_itl_ms": 4.0,
                "p99_itl_ms": 5.0}

    assert _serve_main(tmp_path, monkeypatch, fake_bench, "--caches", "oscar-int2") == 1
    cut = json.loads((tmp_path / "serve_bench.json").read_text())["results"][0]["runs"][1]
    assert "timed out" in cut["error"] and cut["server_decode_tok_s"] == 369.0 and cut["max_running_req"] == 3
    assert "| oscar-int2 | 64 | 3 | - | - | 369 (3) | - | - | - | - | Command" in (tmp_path / "serve_bench.md").read_text()


def test_the_hot_update_remedy_names_the_backend_method_and_reaches_the_server(tmp_path, monkeypatch):
    """The traceback text matched is the INT2 backend's recording method, and the remedy's variable is in the
    environment the INT2 server starts with (with the first remedy too)."""
    backend = (ROOT / "oscar_sglang/sglang/backend.py").read_text()
    method = backend[backend.index(f"def {serve_bench.HOT_IN_GRAPH}("):]
    assert "begin_pass" in method[:method.index("\n    def ")]
    seen = {}

    class Stop(Exception):
        pass

    def local_server(model, log, *flags, env, **kw):
        seen["env"], seen["flags"] = env, flags
        raise Stop

    monkeypatch.setattr(serve_bench.launcher, "local_server", local_server)
    monkeypatch.setattr(serve_bench, "server_flags", lambda cache, args, cpu: ["--kv-cache-dtype", cache])
    args = _args(tmp_path, kv_budget_gib=0, model="m")
    for remedies, want in ((["hot-eager"], "eager"), (["jit", "hot-eager"], "eager"), (["jit"], None)):
        with pytest.raises(Stop):
            serve_bench.serve_and_bench("oscar-int2", args, time.perf_counter() + 60, False, remedies)
        assert seen["env"].get("OSCAR_SGLANG_GRAPH_HOT_UPDATE") == want
        assert "--disable-cuda-graph" not in seen["flags"]


def test_an_extend_kernel_knob_set_around_the_script_reaches_the_servers_and_their_numbers(tmp_path, monkeypatch):
    """A rerun trying a prefill tile (``OSCAR_SGLANG_EXTEND_KERNEL=... bash scripts/device_check.sh``): the
    variable is in each server's environment, and the results and the report say the numbers are with it."""
    import contextlib
    envs = []

    def fake_bench(url, args, input_len, conc, prompts, out_file, timeout=None):
        return {"wall_s": 1.0, "completed": prompts, "output_throughput": 10.0, "median_ttft_ms": 5.0,
                "p99_ttft_ms": 6.0, "median_itl_ms": 3.0, "p99_itl_ms": 9.0}

    monkeypatch.setenv("OSCAR_SGLANG_EXTEND_KERNEL", "block_rows=128,block_n=64")
    # a first run installs the fake server, capacity and bench; the second wraps the fake server to see its env
    assert _serve_main(tmp_path, monkeypatch, fake_bench, log_text="The server is fired up") == 0
    real_server = serve_bench.launcher.local_server

    @contextlib.contextmanager
    def recording_server(model, log, *flags, env, **kw):
        envs.append(env)
        with real_server(model, log, *flags, env=env, **kw) as url:
            yield url

    monkeypatch.setattr(serve_bench.launcher, "local_server", recording_server)
    assert serve_bench.main(["--model", str(tmp_path), "--rotations", str(tmp_path), "--dataset-path", str(tmp_path),
                             "--out", str(tmp_path), "--input-lens", "64", "--output-len", "8", "--kv-budget-gib",
                             "0"]) == 0
    assert [e["OSCAR_SGLANG_EXTEND_KERNEL"] for e in envs] == ["block_rows=128,block_n=64"] * 2
    results = json.loads((tmp_path / "serve_bench.json").read_text())["results"]
    assert [r["knobs"] for r in results] == [{"OSCAR_SGLANG_EXTEND_KERNEL": "block_rows=128,block_n=64"}] * 2
    assert "| 3.00 | 9.00 | OSCAR_SGLANG_EXTEND_KERNEL=block_rows=128,block_n=64 |" in \
        (tmp_path / "serve_bench.md").read_text()
