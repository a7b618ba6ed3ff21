"""Real SGLang servers side by side, BF16 vs oscar-int2: the KV capacity each reports, then bench_serving.

    python scripts/device/serve_bench.py --model M --rotations R --dataset-path P --out OUT

One server per cache, one after the other, with the same flags and the same
fixed KV memory budget (``--kv-budget-gib``, through ``OSCAR_SGLANG_KV_BUDGET_BYTES``;
0 = SGLang's own profile of free memory at ``--mem-fraction-static``):

* ``bf16``: SGLang's default KV cache with its ``triton`` attention backend,
  CUDA graphs on (decode graphs up to ``--cuda-graph-max-bs``, 128);
* ``oscar-int2``: ``--kv-cache-dtype oscar-int2 --oscar-rotations R`` (the
  plugin's backend, decode CUDA graphs up to the same batch where the plugin
  captures them).

Either server that fails on a GPU (does not start, or no run succeeds) is
served again with the next remedy its log calls for, while time is left, and
the report says which (:func:`next_remedy`): a JIT kernel that
``SGLANG_CRASH_ON_JIT_COMPILE`` refused is compiled by the machine's nvcc
(``jit``, kept for the servers after it); a failure in the INT2 graphs'
recorded hot pool update moves that update out of the graph
(``hot-eager``: ``OSCAR_SGLANG_GRAPH_HOT_UPDATE=eager``); otherwise CUDA
graphs are turned off (``eager``: neither server's graphs have run on a GPU
before).

For each, the capacity in tokens from ``/get_server_info``, then
``python -m sglang.bench_serving --backend sglang --dataset-name random`` at
each input length (output ``--output-len`` tokens, ``ignore_eos``) at
concurrency 1 and at the largest concurrency the capacity allows
(``capacity // (input + output)``, capped by ``--max-concurrency-cap``), one
wave of requests each: output tokens/s, TTFT and ITL (median and p99), and
the decode rate ``concurrency x 1000 / median ITL (ms)`` (:func:`decode_rate`),
and beside it the server's own: the best ``gen throughput`` its log printed
during the run with the most requests running (:func:`decode_log_stats`).
Outputs ``OUT/serve_bench.{md,json,png}``, rewritten after every run.  A global ``--time-limit`` skips
the remaining runs (recorded as skipped) so a lent GPU's minutes are not
overrun; each server but the last gets at most an even share of what is left
(:func:`cache_deadline`), so a slow baseline cannot starve the INT2 server, and
a largest-concurrency run may use all of its server's time (``--run-timeout``
bounds the concurrency-1 runs).

Why the decode rate: one wave of N requests of 32k input and 256 output is
mostly prefill, so output tokens / duration is about 256 / (the prefill time
of one request) whatever N is, and cannot show what a bigger batch buys. A
waiting prefill runs before the running decode batch in SGLang's scheduler, so
each request's tokens come one decode step apart once every prefill is done
(the prefill waits land in the tail, p99): the median ITL is the time of a
decode step over the whole batch, and N / that step is the server's decode
throughput.  Without CUDA (the dry run) the same code serves on SGLang's CPU
engine (torch_native attention for BF16, no CUDA graphs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from oscar_sglang.sglang import launcher
from oscar_sglang.sglang.settings import ENV_DECODE_KERNEL, ENV_EXTEND_KERNEL, ENV_GRAPH_HOT_UPDATE, ENV_KV_BUDGET

CACHES = ("bf16", "oscar-int2")
# sglang/kernels/jit/utils/compile/loader.py's message when the crash flag refuses a JIT build
JIT_REFUSED = "SGLANG_CRASH_ON_JIT_COMPILE forbids compiling"
# the oscar_int2 backend's method that records the hot pool's update in a decode graph: in a traceback, that
# recording failed
HOT_IN_GRAPH = "init_forward_metadata_in_graph"
REMEDIES = {
    "jit": "SGLANG_CRASH_ON_JIT_COMPILE=0: nvcc compiles the JIT kernel the first start refused",
    "hot-eager": f"{ENV_GRAPH_HOT_UPDATE}=eager: the INT2 hot pool's update runs before each replay, not in the graph",
    "eager": "--disable-cuda-graph: CUDA graphs off",
}
RETRY_MIN_S = 90  # a retry needs at least this much of the time limit left (an 8B dummy server starts in ~1 min)


def next_remedy(log_text: str, tried, cpu: bool) -> str | None:
    """What to change before serving a cache again after a failure, from its server log; None: nothing left.

    On CPU (the dry run) nothing: there are no CUDA graphs, and a failure there is a bug to fix, not to
    work around.
    """
    if cpu:
        return None
    if JIT_REFUSED in log_text and "jit" not in tried:
        return "jit"
    if HOT_IN_GRAPH in log_text and "hot-eager" not in tried and "eager" not in tried:
        return "hot-eager"
    if "eager" not in tried:
        return "eager"
    return None


def decode_rate(run: dict) -> float | None:
    """Decode tokens/s of a run over all its requests: concurrency / median ITL (see the module's notes)."""
    itl = run.get("median_itl_ms")
    return run["concurrency"] * 1000.0 / itl if itl else None


# the scheduler's line every --decode-log-interval decode steps (40 by default, 10 in server_flags)
# (sglang/srt/managers/scheduler_components/metrics_reporter.py; the pieces matched are checked against it in
# tests/test_serve_bench_remedies.py)
DECODE_LINE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+),.*?gen throughput \(token/s\): ([0-9.]+)")


def decode_log_stats(text: str) -> dict:
    """The server's own decode rate in a stretch of its log: the most requests it decoded at once, and the best
    ``gen throughput`` logged with that many running (an interval with a prefill in it logs less)."""
    lines = [(int(n), float(t)) for n, t in DECODE_LINE.findall(text)]
    if not lines:
        return {}
    most = max(n for n, _ in lines)
    return {"max_running_req": most, "server_decode_tok_s": max(t for n, t in lines if n == most)}


def _log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def _log_since(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def cache_deadline(now: float, deadline: float, caches_left: int) -> float:
    """When the next server's runs must end: an even share of what is left, all of it for the last server."""
    return now + max(0.0, deadline - now) / max(1, caches_left)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="model folder (config-only with --dummy)")
    p.add_argument("--rotations", type=Path, required=True, help="rotations directory for --kv-cache-dtype oscar-int2")
    p.add_argument("--dataset-path", type=Path, required=True, help="ShareGPT-format JSON (the bundle ships one)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dummy", action="store_true", help="--load-format dummy (random weights)")
    p.add_argument("--input-lens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kv-budget-gib", type=float, default=16.0)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--max-concurrency-cap", type=int, default=256)
    p.add_argument("--single-prompts", type=int, default=3,
                   help="requests of the concurrency-1 runs (no warm-up: the median is robust to a slow first)")
    p.add_argument("--remedies", nargs="+", default=[], choices=sorted(REMEDIES),
                   help="start every server with these remedies already (a rerun of a server whose first run "
                        "needed them: no failed start again)")
    p.add_argument("--largest-only", action="store_true",
                   help="only the largest-concurrency run at each input, no concurrency-1 run: a short rerun that "
                        "lacks just that run (goals.py keeps the first run's others)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=128)
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (--tp-size) for every server")
    p.add_argument("--tag", default="", help="suffix of the output names (serve_bench<tag>.*)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for everything; later runs are skipped")
    p.add_argument("--run-timeout", type=float, default=150.0,
                   help="seconds for a concurrency-1 bench_serving run (a largest-concurrency run may take all that is left)")
    return p.parse_args(argv)


def server_flags(cache: str, args, cpu: bool) -> list[str]:
    # --decode-log-interval 10: the scheduler's gen-throughput line every 10 decode steps, not 40, so a run of
    # 256 output tokens logs ~25 of them and some fall wholly inside the full batch's decoding (decode_log_stats)
    flags = ["--mem-fraction-static", str(args.mem_fraction_static), "--sampling-backend", "pytorch",
             "--decode-log-interval", "10",
             "--grammar-backend", "none", "--context-length", str(max(args.input_lens) + args.output_len + 1024)]  # re-tokenized prompts drift
    if args.dummy:
        flags += ["--load-format", "dummy"]
    if args.tp > 1:
        flags += ["--tp-size", str(args.tp)]
    if cache == "oscar-int2":
        flags += ["--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(args.rotations)]
    elif not cpu:
        flags += ["--attention-backend", "triton"]
    if not cpu:
        flags += ["--cuda-graph-backend-prefill", "disabled", "--cuda-graph-max-bs-decode", str(args.cuda_graph_max_bs)]
    return flags


def bench(url: str, args, input_len: int, concurrency: int, prompts: int, out_file: Path,
          timeout: float | None = None) -> dict:
    """One ``sglang.bench_serving`` run; its result record (JSON) plus the wall time."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--dataset-name", "random", "--dataset-path", str(args.dataset_path), "--tokenizer", str(args.model),
           "--random-input-len", str(input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--output-file", str(out_file), "--seed", str(input_len + concurrency),
           # bench_serving's warm-up request is its first prompt, so the measured first request hit the prefix
           # cache (the H200's first run: one of the two concurrency-1 TTFTs was a 1-token prefill)
           "--warmup-requests", "0"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or args.run_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"bench_serving exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    rec = json.loads(out_file.read_text().strip().splitlines()[-1])
    keep = ("completed", "duration", "output_throughput", "total_output_tokens", "median_ttft_ms", "p99_ttft_ms",
            "median_itl_ms", "p99_itl_ms", "mean_itl_ms")
    return {"wall_s": wall, **{k: rec.get(k) for k in keep}}


def serve_and_bench(cache: str, args, deadline: float, cpu: bool, remedies=(), log: Path | None = None,
                    progress=lambda res: None) -> dict:
    """Serve one cache and run its benchmarks; ``progress(res)`` after the start and after every run."""
    env = launcher.server_env(cpu)
    if args.kv_budget_gib > 0:
        env[ENV_KV_BUDGET] = str(int(args.kv_budget_gib * 2**30))
    if "jit" in remedies:
        env["SGLANG_CRASH_ON_JIT_COMPILE"] = "0"
    if "hot-eager" in remedies:
        env[ENV_GRAPH_HOT_UPDATE] = "eager"
    log = log or args.out / f"server_{cache}{args.tag}.log"
    flags = server_flags(cache, args, cpu) + (["--disable-cuda-graph"] if "eager" in remedies else [])
    res = {"cache": cache, "flags": flags, "runs": []}
    if remedies:
        res["remedies"] = list(remedies)
    knobs = {k: env[k] for k in (ENV_EXTEND_KERNEL, ENV_DECODE_KERNEL, ENV_GRAPH_HOT_UPDATE) if env.get(k)}
    if knobs:  # set around the script (a rerun trying a kernel tile) or by a remedy: the numbers are theirs
        res["knobs"] = knobs
    t0 = time.perf_counter()
    with launcher.local_server(args.model, log, *flags, cpu=cpu, env=env,
                               timeout_s=max(30.0, deadline - time.perf_counter())) as url:
        res["start_s"] = time.perf_counter() - t0
        res["capacity"] = launcher.capacity(url)
        res["startup_line"] = launcher.startup_line(log)
        loop = launcher.startup_line(log, launcher.DECODE_LOOP_MARKER)
        if loop:  # the INT2 server timed its decode loop's candidates at startup (CUDA, knob unset)
            res["decode_loop"] = loop
        print(f"[{cache}] ready in {res['start_s']:.0f} s, capacity {res['capacity']} tokens", flush=True)
        progress(res)
        for input_len in args.input_lens:
            per_req = input_len + args.output_len
            most = min(res["capacity"] // per_req, args.max_concurrency_cap)
            for conc in ([most] if args.largest_only else sorted({1, most})):
                run = {"input_len": input_len, "concurrency": conc, "max_by_capacity": res["capacity"] // per_req}
                left = deadline - time.perf_counter()
                if conc < 1:
                    run["skipped"] = f"one request of {per_req} tokens does not fit {res['capacity']} tokens"
                elif left < 20:
                    run["skipped"] = f"time limit ({left:.0f} s left)"
                else:
                    prompts = args.single_prompts if conc == 1 else conc
                    # the largest concurrency is what the server is for: it may take all that is left
                    timeout = min(args.run_timeout, left - 5) if conc == 1 else left - 5
                    offset = _log_size(log)
                    try:
                        run.update(bench(url, args, input_len, conc, prompts,
                                         args.out / f"bench_{cache}{args.tag}_{input_len}_{conc}.jsonl", timeout))
                        run["decode_tok_s"] = decode_rate(run)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        run["error"] = str(e)[-1500:]
                    # also for a run cut by its timeout: what the server decoded until then
                    run.update(decode_log_stats(_log_since(log, offset)))
                print(f"[{cache}] input {input_len} x{conc}: " + (
                    f"{run['output_throughput']:.1f} out tok/s, ITL median {run['median_itl_ms']:.2f} ms, "
                    f"TTFT median {run['median_ttft_ms']:.0f} ms" if "output_throughput" in run
                    else run.get("skipped") or run.get("error", "")[-300:]), flush=True)
                res["runs"].append(run)
                progress(res)
    return res


def _failed(res: dict) -> bool:
    return "error" in res or (bool(res["runs"]) and not any("output_throughput" in r for r in res["runs"])
                              and any("error" in r for r in res["runs"]))


def serve_with_remedies(cache: str, args, deadline: float, cpu: bool, sticky: list[str],
                        progress=lambda res: None) -> dict:
    """Serve and benchmark one cache; after a failure, again with the next remedy (:func:`next_remedy`).

    The result of the last attempt, with ``attempts`` (each failed one's remedies and error) when there
    were several; a ``jit`` remedy that worked is appended to ``sticky``.
    """
    remedies, attempts = list(sticky), []
    while True:
        log = args.out / (f"server_{cache}{args.tag}" + "".join(f"_{r}" for r in remedies[len(sticky):]) + ".log")
        try:
            res = serve_and_bench(cache, args, deadline, cpu, remedies, log, progress)
        except (launcher.ServerError, OSError, RuntimeError) as e:
            print(f"[{cache}] server failed: {str(e)[-2000:]}", flush=True)
            res = {"cache": cache, "error": str(e)[-4000:], "runs": [], "remedies": list(remedies)}
        if not _failed(res):
            break
        remedy = next_remedy(log.read_text(errors="replace") if log.exists() else "", remedies, cpu)
        left = deadline - time.perf_counter()
        if remedy is None or left < RETRY_MIN_S:
            break
        attempts.append({"remedies": list(remedies),
                         "error": res.get("error") or next(r["error"] for r in res["runs"] if "error" in r)})
        print(f"[{cache}] serving again with remedy {remedy!r} ({REMEDIES[remedy]}), {left:.0f} s left", flush=True)
        remedies.append(remedy)
    if attempts:
        res["attempts"] = attempts
        res["fallback"] = "; ".join(REMEDIES[r] for r in remedies) + " (after: " + attempts[-1]["error"][-600:] + ")"
    if "jit" in remedies and "jit" not in sticky and not _failed(res):
        sticky.append("jit")
    return res


def _setup_note(r: dict) -> str:
    """What a server ran with beyond the plain flags: its remedies and environment knobs."""
    return "; ".join((["remedies: " + ", ".join(r["remedies"])] if r.get("remedies") else [])
                     + [f"{k}={v}" for k, v in r.get("knobs", {}).items()])


def write_report(results: list[dict], args, cpu: bool) -> None:
    import torch
    import triton

    device = "CPU (dry run)" if cpu else torch.cuda.get_device_name(0)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    cmd = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    (args.out / f"serve_bench{args.tag}.json").write_text(json.dumps(
        {"date": date, "device": device, "command": cmd, "torch": torch.__version__, "triton": triton.__version__,
         "triton_file": triton.__file__, "results": results}, indent=1))
    budget = f"{args.kv_budget_gib:g} GiB fixed KV budget" if args.kv_budget_gib > 0 else \
        f"SGLang's memory profile at --mem-fraction-static {args.mem_fraction_static}"
    lines = [f"# Real SGLang servers, BF16 vs oscar-int2 ({device}, {date})", "",
             f"Command: `{cmd}`", "",
             f"Triton {triton.__version__} (`{Path(triton.__file__).parent}`), torch {torch.__version__}: the servers"
             " are started with this process's environment, so their kernels, SGLang's and ours, are compiled by it.",
             "",
             f"Model: `{args.model.name}`{' (dummy weights)' if args.dummy else ''}"
             f"{f', --tp-size {args.tp}' if args.tp > 1 else ''}; {budget}; output "
             f"{args.output_len} tokens, ignore_eos; `sglang.bench_serving --dataset-name random` over the "
             f"bundle's Shakespeare prompts.", ""]
    by = {r["cache"]: r for r in results}
    lines += ["| cache | capacity (tokens) | start (s) |", "|---|---|---|"]
    lines += [f"| {r['cache']} | {r.get('capacity', '-')} | {r.get('start_s', float('nan')):.0f} |" for r in results]
    if by.get("bf16", {}).get("capacity") and by.get("oscar-int2", {}).get("capacity"):
        lines += ["", f"Capacity ratio INT2 / BF16: {by['oscar-int2']['capacity'] / by['bf16']['capacity']:.2f}x"]
    if by.get("oscar-int2", {}).get("decode_loop"):
        lines += ["", f"INT2 decode loop: {by['oscar-int2']['decode_loop']}"]
    lines += ["", "Decode tok/s = concurrency x 1000 / median ITL (ms): the rate of a decode step over the whole "
                  "batch (a wave of long prompts is mostly prefill, which out tok/s = output tokens / duration "
                  "counts in).",
              "Server log: the best `gen throughput` SGLang's scheduler logged during the run (every 10 decode steps) "
              "with the most requests running, and how many ran.",
              "", "| cache | input | concurrency | out tok/s | decode tok/s | server log: tok/s (running) | "
                  "TTFT median ms | TTFT p99 ms | ITL median ms | ITL p99 ms | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for run in r.get("runs", []):
            if "output_throughput" in run:
                lines.append(f"| {r['cache']} | {run['input_len']} | {run['concurrency']} | "
                             f"{run['output_throughput']:.1f} | {_num(decode_rate(run), '.0f')} | {_server_rate(run)} | "
                             f"{run['median_ttft_ms']:.0f} | {run['p99_ttft_ms']:.0f} | "
                             f"{run['median_itl_ms']:.2f} | {run['p99_itl_ms']:.2f} | "
                             f"{_setup_note(r)} |")
            else:
                note = (run.get("skipped") or run.get("error", "")).replace("\n", " ").replace("|", "/")[:160]
                lines.append(f"| {r['cache']} | {run['input_len']} | {run['concurrency']} | - | - | {_server_rate(run)} | - | - | "
                             f"- | - | {note} |")
        if r.get("fallback"):
            lines.append(f"| {r['cache']} | - | - | - | - | - | - | - | - | - | {r['fallback'][:200].replace(chr(10), ' ').replace('|', '/')} |")
        if r.get("error"):
            lines.append(f"| {r['cache']} | - | - | - | - | - | - | - | - | - | server: "
                         f"{r['error'][-300:].replace(chr(10), ' ').replace('|', '/')} |")
    (args.out / f"serve_bench{args.tag}.md").write_text("\n".join(lines) + "\n")
    plot(results, args.out / f"serve_bench{args.tag}.png", device)


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _server_rate(run: dict) -> str:
    """The report's server-log cell: tok/s (requests running), or '-'."""
    if "server_decode_tok_s" not in run:
        return "-"
    return f"{run['server_decode_tok_s']:.0f} ({run['max_running_req']})"


def plot(results: list[dict], path: Path, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "output_throughput", "output tokens/s (whole run)"),
                           (axes[1], "decode_tok_s", "decode tokens/s (concurrency / median ITL)"),
                           (axes[2], "median_itl_ms", "median ITL (ms)")):
        labels, xs = [], 0
        for r in results:
            runs = [x for x in r.get("runs", []) if "output_throughput" in x]
            for run in runs:
                value = decode_rate(run) if key == "decode_tok_s" else run.get(key)
                if value is None:
                    continue
                ax.bar(xs, value, color="tab:blue" if r["cache"] == "bf16" else "tab:orange")
                n = run["input_len"]
                labels.append(f"{r['cache']}\n{f'{n // 1024}k' if n >= 1024 else n} x{run['concurrency']}")
                xs += 1
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(title)
    fig.suptitle(f"SGLang server, BF16 vs oscar-int2 ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _terminated(signum, frame):
    """SIGTERM (a step's ``timeout``): unwind, so every server started is stopped (each runs in a session of its
    own, which the step's kill does not reach, and would hold the GPU's memory for the steps after)."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = not launcher.cuda_visible()
    deadline = time.perf_counter() + args.time_limit
    results = []
    sticky: list[str] = list(args.remedies)  # remedies every later server gets too
    for i, cache in enumerate(args.caches):
        # the report is rewritten after every run: a run cut short by the lent machine's limit keeps what it measured
        share = cache_deadline(time.perf_counter(), deadline, len(args.caches) - i)
        results.append(serve_with_remedies(cache, args, share, cpu, sticky,
                                           lambda res: write_report(results + [res], args, cpu)))
    write_report(results, args, cpu)
    print((args.out / f"serve_bench{args.tag}.md").read_text(), flush=True)
    ok = all("error" not in r and all("error" not in x for x in r["runs"]) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
