"""The GPU-proof issue's four goals, judged from one device run's reports: measured value, goal, met or not.

    python scripts/device/goals.py RESULTS_DIR      # reads bench_kernels.json and serve_bench.json there
    python scripts/device/goals.py FIRST RERUN      # a rerun's reports over the first run's

With several folders the later ones win: the last bench_kernels.json, and each server run (cache, input,
concurrency) from the last folder that measured it (a rerun with SERVE_CACHES=oscar-int2 is judged against the
first run's BF16, and one that served only INT2's largest 32k run keeps the first run's INT2 batch-1 ITL; the
table then says which folder each cache's runs came from, since those are two runs, not one).

1. INT2 decode kernel >= 75 % of the measured copy bandwidth at context >= 32k;
2. INT2 decode >= 4x faster than the best BF16 baseline of the same run at batch 1, context >= 32k;
3. end-to-end decode throughput at each cache's largest concurrency >= 5x BF16's at 32k input: the real
   server's decode rate, concurrency / median ITL (``serve_bench.decode_rate``; one wave of 32k prompts is
   mostly prefill, so output tokens / duration, shown beside it, says little about decoding); the server's own
   logged decode rate is shown beside it when the report has it (``serve_bench.decode_log_stats``);
4. batch-1 ITL (median) no worse than BF16's.

Under the table, lines that are not goals but name the rerun's remedies: the INT2 decode tile the
benchmark's sweep found fastest (``OSCAR_SGLANG_DECODE_KERNEL=...``), the prefill section with its fastest
extend tile (``OSCAR_SGLANG_EXTEND_KERNEL=...``), and, when INT2's 32k wave is missing, whether a rerun of that
wave alone fits the time a rerun has, with its command.

Goals 1-2 are judged on the Llama-3-8B head shape (head_dim 128) when the benchmark measured it, every
case listed; a goal with no measured case says so instead of passing.  ``scripts/device_check.sh``
appends the table to its summary.txt; the same command turns fetched results into docs/GPU.md's table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

LONG = 32768
COPY_FRAC_GOAL = 0.75
BATCH1_SPEEDUP_GOAL = 4.0
THROUGHPUT_GOAL = 5.0


def _verdict(ok: list[bool]) -> str:
    if not ok:
        return "not measured"
    return "met" if all(ok) else ("not met" if not any(ok) else f"met in {sum(ok)} of {len(ok)}")


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _long_rows(kernels: dict, long: int) -> list[dict]:
    rows = [r for r in kernels.get("decode", []) if r["context"] >= long]
    d128 = [r for r in rows if r["d"] == 128]
    return d128 or rows


def kernel_goals(kernels: dict | None, long: int = LONG) -> list[dict]:
    """Goals 1 and 2 from bench_kernels.json (``long``: the context from which they count)."""
    if kernels is None:
        return [{"goal": g, "measured": "no bench_kernels.json", "verdict": "not measured"} for g in (
            f"INT2 decode >= {COPY_FRAC_GOAL:.0%} of copy bandwidth at context >= {_tokens(long)}",
            f"INT2 decode >= {BATCH1_SPEEDUP_GOAL:g}x the best BF16 at batch 1, context >= {_tokens(long)}")]
    rows = _long_rows(kernels, long)
    frac = [(r, r["int2_copy_frac"]) for r in rows if r.get("int2_copy_frac") is not None]
    batch1 = [r for r in rows if r["batch"] == 1]
    return [
        {"goal": f"INT2 decode >= {COPY_FRAC_GOAL:.0%} of copy bandwidth at context >= {_tokens(long)}",
         "measured": "; ".join(f"d{r['d']} b{r['batch']} {_tokens(r['context'])}: {f:.0%}" for r, f in frac)
         or f"no case at context >= {_tokens(long)}",
         "verdict": _verdict([f >= COPY_FRAC_GOAL for _, f in frac])},
        {"goal": f"INT2 decode >= {BATCH1_SPEEDUP_GOAL:g}x the best BF16 at batch 1, context >= {_tokens(long)}",
         "measured": ("; ".join(f"d{r['d']} {_tokens(r['context'])}: {r['speedup']:.2f}x vs {r['best_bf16']}"
                                for r in batch1) or f"no batch-1 case at context >= {_tokens(long)}")
         + _graph_speedups(batch1),
         "verdict": _verdict([r["speedup"] >= BATCH1_SPEEDUP_GOAL for r in batch1])},
    ]


def _graph_speedups(rows: list[dict]) -> str:
    """The same cases' speedups in CUDA graphs, where the benchmark recorded them (not the verdict's: it judges
    every case alike, eager; a server decodes in graphs, without the host's launches)."""
    timed = [(r, r["graph"]["speedup"]) for r in rows if (r.get("graph") or {}).get("speedup") is not None]
    return ("; in CUDA graphs: " + "; ".join(f"d{r['d']} {_tokens(r['context'])}: {x:.2f}x" for r, x in timed)
            if timed else "")


def _server(serve: dict | None, cache: str) -> dict | None:
    """A serve_bench report's result of one cache, or None."""
    return next((res for res in (serve or {}).get("results", []) if res["cache"] == cache), None)


def _all_runs(serve: dict, cache: str) -> list[dict]:
    return (_server(serve, cache) or {}).get("runs", [])


def _runs(serve: dict, cache: str) -> list[dict]:
    return [r for r in _all_runs(serve, cache) if r.get("output_throughput") is not None]


def _decode(run: dict) -> float | None:
    """Decode tokens/s: concurrency / median ITL (what ``serve_bench.decode_rate`` records)."""
    itl = run.get("median_itl_ms")
    return run["concurrency"] * 1000.0 / itl if itl else None


def server_goals(serve: dict | None, long: int = LONG) -> list[dict]:
    """Goals 3 and 4 from serve_bench.json (``long``: the input length goal 3 is judged at)."""
    goal3 = (f"decode tok/s (concurrency / median ITL) at each cache's largest concurrency >= {THROUGHPUT_GOAL:g}x "
             f"BF16's at {_tokens(long)} input")
    goal4 = "batch-1 median ITL no worse than BF16's"
    if serve is None:
        return [{"goal": g, "measured": "no serve_bench.json", "verdict": "not measured"} for g in (goal3, goal4)]
    bf16, int2 = _runs(serve, "bf16"), _runs(serve, "oscar-int2")

    def largest(runs, input_len):
        at = [r for r in runs if r["input_len"] == input_len and r["concurrency"] > 1]
        return max(at, key=lambda r: r["concurrency"]) if at else None

    b, i = largest(bf16, long), largest(int2, long)
    if b and i and _decode(b) and _decode(i):
        ratio = _decode(i) / _decode(b)
        server = ""
        if i.get("server_decode_tok_s") and b.get("server_decode_tok_s"):
            server = (f"server log: INT2 {i['server_decode_tok_s']:.0f} tok/s with {i['max_running_req']} running vs "
                      f"BF16 {b['server_decode_tok_s']:.0f} with {b['max_running_req']}, "
                      f"{i['server_decode_tok_s'] / b['server_decode_tok_s']:.2f}x; ")
        m3 = (f"INT2 x{i['concurrency']} {_decode(i):.0f} tok/s vs BF16 x{b['concurrency']} {_decode(b):.0f} tok/s: "
              f"{ratio:.2f}x ({server}output tok/s over the whole run: {i['output_throughput']:.0f} vs "
              f"{b['output_throughput']:.0f})")
        v3 = _verdict([ratio >= THROUGHPUT_GOAL])
    else:
        m3, v3 = f"a largest-concurrency run at {_tokens(long)} input is missing for " + " and ".join(
            n for n, x in (("BF16", b), ("INT2", i)) if x is None), "not measured"
        for name, cache in (("BF16", "bf16"), ("INT2", "oscar-int2")):
            cut = [r for r in _all_runs(serve, cache) if r["input_len"] == long and r["concurrency"] > 1
                   and "output_throughput" not in r and r.get("server_decode_tok_s")]
            if cut:
                m3 += (f"; {name}'s was cut, its server logged {cut[-1]['server_decode_tok_s']:.0f} tok/s with "
                       f"{cut[-1]['max_running_req']} running")
    pairs = []
    for r in int2:
        if r["concurrency"] == 1:
            base = [x for x in bf16 if x["concurrency"] == 1 and x["input_len"] == r["input_len"]]
            if base:
                pairs.append((r["input_len"], r["median_itl_ms"], base[0]["median_itl_ms"]))
    m4 = "; ".join(f"{_tokens(n)}: INT2 {a:.2f} ms vs BF16 {c:.2f} ms" for n, a, c in sorted(pairs)) \
        or "no batch-1 run of both caches at the same input"
    return [{"goal": goal3, "measured": m3, "verdict": v3},
            {"goal": goal4, "measured": m4, "verdict": _verdict([a <= c for _, a, c in pairs])}]


def merge_serve(reports: list[tuple[str, dict | None]]) -> tuple[dict | None, dict[str, list]]:
    """One serve_bench report from several (name, report), later ones first: each run of a cache (its input
    and concurrency) from the last report that measured it; a later run that was not measured (skipped, cut,
    failed) hides only what was not measured either. So a rerun that serves just what the first run lacked
    (``--largest-only --input-lens 32768``) is judged with the first run's other runs of the same cache.

    Returns the merged report and, per cache, where its runs came from: ``[(name, [(input, concurrency),
    ...]), ...]`` in the order of the reports (a cache without runs: its last report, no runs)."""
    servers: dict[str, dict] = {}   # cache -> the last report's result of it
    last: dict[str, str] = {}
    runs: dict[str, dict[tuple, tuple[dict, str]]] = {}
    for name, rep in reports:
        for res in (rep or {}).get("results", []):
            cache = res["cache"]
            servers[cache], last[cache] = res, name
            mine = runs.setdefault(cache, {})
            for run in res.get("runs", []):
                key = (run["input_len"], run["concurrency"])
                if key not in mine or "output_throughput" in run or "output_throughput" not in mine[key][0]:
                    mine[key] = (run, name)
    if not servers:
        return None, {}
    names = [name for name, _ in reports]
    merged, source = [], {}
    for cache, res in servers.items():
        merged.append(dict(res, runs=[run for run, _ in runs[cache].values()]))
        by_name: dict[str, list] = {}
        for key, (_, name) in runs[cache].items():
            by_name.setdefault(name, []).append(key)
        source[cache] = sorted(by_name.items(), key=lambda kv: names.index(kv[0])) or [(last[cache], [])]
    return {"results": merged}, source


def source_line(source: dict[str, list]) -> str:
    """Which report each cache's server numbers came from, when that is more than one report, or ''."""
    if len({name for parts in source.values() for name, _ in parts}) < 2:
        return ""

    def part(name, keys, alone):
        if alone:
            return name
        return f"{name} (" + ", ".join(f"{_tokens(n)} x{c}" for n, c in keys) + ")"

    return "server results from: " + "; ".join(
        f"{cache}: " + ", ".join(part(name, keys, len(parts) == 1) for name, keys in parts)
        for cache, parts in sorted(source.items())) + "\n"


# A servers rerun on the warm machine (docs/GPU.md, "After the first run"): DEVICE_LIMIT_S=160 less what comes before
# the servers step (env, the reused install, models: 14 s in the dry run of 2026-12-04) less the script's 30 s margin.
RERUN_LIMIT_S = 160
RERUN_SERVE_S = RERUN_LIMIT_S - 15 - 30
EXTEND_KNOB = "OSCAR_SGLANG_EXTEND_KERNEL"


def int2_knobs(serve: dict | None) -> dict[str, str]:
    """The kernel knobs the INT2 server ran with (the prefill probe's choice among them), with the extend knob
    always set (``sdpa``: the server's default on a GPU since 2026-12-05), so a servers rerun given them skips
    the prefill probe."""
    res = _server(serve, "oscar-int2") or {}
    knobs = dict(res.get("knobs", {}))
    knobs.setdefault(EXTEND_KNOB, "sdpa")
    return knobs


def int2_remedies(serve: dict | None) -> str:
    """serve_bench's ``--remedies`` for a rerun of the INT2 server, from what its first run needed ('' if
    nothing); the hot update's travels as its knob (:func:`int2_knobs`)."""
    res = _server(serve, "oscar-int2") or {}
    remedies = [r for r in res.get("remedies", []) if r != "hot-eager"]
    return f" --remedies {' '.join(remedies)}" if remedies else ""


def servers_rerun_command(knobs: dict[str, str], serve_args: str) -> str:
    env = " ".join(f"{k}={v}" for k, v in sorted(knobs.items()))
    return (f"DEVICE_LIMIT_S={RERUN_LIMIT_S} {env} SERVE_ARGS=\"{serve_args}\" ONLY=servers SERVE_CACHES=oscar-int2 "
            "bash scripts/device_check.sh")


def wave_rerun(serve: dict | None, long: int = LONG) -> dict | None:
    """When INT2's largest-concurrency wave at ``long`` input is missing: ``text`` (what is missing, and whether a
    servers rerun of that wave alone fits what a rerun leaves, ``RERUN_SERVE_S``, estimated from the first run's
    own numbers: its INT2 server's start, one concurrency-1 TTFT at ``long`` per request of the wave, 256 outputs
    at its ITL), ``fits`` and ``command`` (None when nothing sizes it); None when the wave was measured, INT2
    never started, or was not served at ``long``."""
    res = _server(serve, "oscar-int2")
    if res is None or res.get("start_s") is None:
        return None
    runs = [r for r in res.get("runs", []) if r["input_len"] == long]
    if not runs:   # not served at that input (the dry run's short prompts)
        return None
    if any(r["concurrency"] > 1 and r.get("output_throughput") is not None for r in runs):
        return None
    wave = next((r for r in runs if r["concurrency"] > 1), None)
    n = wave["concurrency"] if wave else res.get("capacity", 0) // (long + 256)
    single = next((r for r in runs if r["concurrency"] == 1 and r.get("median_ttft_ms")), None)
    if n < 2 or single is None:
        return {"fits": False, "command": None,
                "text": f"INT2's {_tokens(long)} wave is missing, and no concurrency-1 run at {_tokens(long)} "
                        "to size a rerun by"}
    # the remedies the first run's server needed go with the rerun, so it starts once
    need = res["start_s"] + n * single["median_ttft_ms"] / 1000 + 256 * single["median_itl_ms"] / 1000
    fits = need <= RERUN_SERVE_S
    serve_args = f"--input-lens {long} --largest-only --cuda-graph-max-bs {n}" + int2_remedies(serve)
    with_remedies = f" (with remedies {', '.join(res['remedies'])})" if res.get("remedies") else ""
    return {"fits": fits,
            "command": servers_rerun_command(int2_knobs(serve), serve_args),
            "text": f"INT2's {_tokens(long)} wave (x{n}) is missing; its server started in {res['start_s']:.0f} s"
                    f"{with_remedies}, one {_tokens(long)} prompt's TTFT was "
                    f"{single['median_ttft_ms'] / 1000:.1f} s, so the wave alone needs ~{need:.0f} s, which "
                    f"{'fits' if fits else 'does not fit'} the ~{RERUN_SERVE_S} s a servers rerun has"}


def rerun_line(serve: dict | None, long: int = LONG) -> str:
    """Not a goal: :func:`wave_rerun` in a line, with its command, or ''."""
    w = wave_rerun(serve, long)
    if w is None:
        return ""
    if w["command"] is None:
        return f"rerun (not a goal): {w['text']}\n"
    return f"rerun (not a goal): {w['text']}: {w['command']}\n"


def markdown(goals: list[dict]) -> str:
    lines = ["| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['measured']} | {g['verdict']} |" for g in goals]
    return "\n".join(lines) + "\n"


def prefill_line(kernels: dict | None) -> str:
    """Not a goal, but what decides the INT2 server's TTFT and whether its 32k wave fits the servers step (and
    the rerun with ``OSCAR_SGLANG_EXTEND_KERNEL``): the benchmark's prefill section in one line, or ''."""
    ext = (kernels or {}).get("extend") or {}
    row = ext.get("prompt_row")
    if not row:
        return ""

    def ms(key):
        return "n/a" if row.get(key) is None else f"{row[key]:.1f} ms"

    ratio = row.get("int2_vs_best_bf16")
    line = (f"prefill (not a goal): a {ext['prompt']}-token prompt in chunks of {ext['chunk']}, one layer: INT2 "
            f"{ms('int2_bf16_ms')} (fp32 dots {ms('int2_tf32_ms')}, via SDPA {ms('int2_sdpa_ms')}), SGLang Triton "
            f"BF16 {ms('sglang_ms')}, SDPA {ms('sdpa_ms')}; INT2 / best BF16 "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'}")
    last = (ext.get("rows") or [{}])[-1].get("int2_bf16_ms")
    swept = [t for t in ext.get("sweep", []) if t.get("int2_bf16_ms") is not None]
    if swept and last:
        best = min(swept, key=lambda t: t["int2_bf16_ms"])
        tile = ",".join(f"{k}={best[k]}" for k in ("block_rows", "block_n", "num_warps", "num_stages"))
        line += (f"; fastest swept tile on the last chunk: {best['int2_bf16_ms']:.2f} ms vs the default's "
                 f"{last:.2f} ms (OSCAR_SGLANG_EXTEND_KERNEL={tile})")
    kernel, via_sdpa = row.get("int2_bf16_ms"), row.get("int2_sdpa_ms")
    if kernel and via_sdpa and via_sdpa < kernel:
        line += (f"; INT2 via SDPA {kernel / via_sdpa:.2f}x the kernel's speed over the prompt "
                 "(OSCAR_SGLANG_EXTEND_KERNEL=sdpa)")
    return line + "\n"


# kernels/decode/triton_kernel.decode_attention's tile defaults (the first row of bench_kernels' TUNE_GRID);
# repeated here because this script runs on a bare python3.
DECODE_TILE = {"block_n": 64, "num_warps": 4, "num_stages": 2}
# the default of the reports written before bench_kernels.py recorded it (meta "decode_default_tile"): the first
# H200 run's, 2026-12-04
DECODE_TILE_BEFORE_RECORDED = {"block_n": 32, "num_warps": 4, "num_stages": 2}


def fastest_decode_tile(kernels: dict | None) -> dict | None:
    """The INT2 decode tile that was fastest over the benchmark's swept cases against the default's: ``knob``
    (``OSCAR_SGLANG_DECODE_KERNEL``'s value), ``speedup`` (over the default), ``default`` (whether it is the
    default), ``swept`` (how many tiles competed), ``cases`` (text); None without a sweep.

    Only tiles measured in every swept case that has a default row compete; the best has the smallest
    geometric mean of its time over the default's time."""
    rows = [r for r in (kernels or {}).get("tuning", []) if r.get("int2_ms")]
    tile_default = (kernels or {}).get("meta", {}).get("decode_default_tile", DECODE_TILE_BEFORE_RECORDED)

    def case(r):
        return r["d"], r["batch"], r["context"]

    def tile(r):
        return tuple(r[k] for k in DECODE_TILE)

    default = {case(r): r["int2_ms"] for r in rows if tile(r) == tuple(tile_default[k] for k in DECODE_TILE)}
    ratios: dict[tuple, dict] = {}
    for r in rows:
        if case(r) in default:
            ratios.setdefault(tile(r), {})[case(r)] = r["int2_ms"] / default[case(r)]
    complete = {t: v for t, v in ratios.items() if len(v) == len(default)}
    if not complete:
        return None
    best = min(complete, key=lambda t: statistics.geometric_mean(complete[t].values()))
    times = {case(r): r["int2_ms"] for r in rows if tile(r) == best}
    return {"knob": ",".join(f"{k}={v}" for k, v in zip(DECODE_TILE, best)),
            "speedup": 1 / statistics.geometric_mean(complete[best].values()),
            "default": best == tuple(tile_default[k] for k in DECODE_TILE), "swept": len(complete),
            "cases": "; ".join(f"d {d} batch {b} {_tokens(c)}: {times[(d, b, c)]:.3f} vs {default[(d, b, c)]:.3f} ms"
                               for d, b, c in sorted(default))}


def decode_tile_line(kernels: dict | None) -> str:
    """Not a goal, but a remedy for the ITL and decode-rate goals (the rerun with ``OSCAR_SGLANG_DECODE_KERNEL``):
    :func:`fastest_decode_tile` in a line, or ''."""
    best = fastest_decode_tile(kernels)
    if best is None:
        return ""
    if best["default"]:
        return f"decode tiles (not a goal): the default ({best['knob']}) was the fastest of {best['swept']} swept\n"
    return (f"decode tiles (not a goal): fastest swept tile {best['speedup']:.2f}x the default's speed "
            f"({best['cases']}) (OSCAR_SGLANG_DECODE_KERNEL={best['knob']})\n")


def decode_loop_line(serve: dict | None, kernels: dict | None) -> str:
    """Not a goal, but what decided the INT2 decode's numbers: the loop the INT2 server's startup timing chose
    (``kernels/decode/autotune.py``, its log line as serve_bench copied it) and the kernel benchmark's picks per
    head size, or ''."""
    parts = []
    loop = (_server(serve, "oscar-int2") or {}).get("decode_loop")
    if loop:
        parts.append(f"the INT2 server's startup timing: {loop}")
    served = ((kernels or {}).get("meta") or {}).get("served_decode") or {}
    if served:
        parts.append("the kernel benchmark's: " + "; ".join(
            f"d={d} " + ", ".join(f"b{b} x {n} {k}" for (b, n), k in zip(c["cases"], c["knobs"]))
            for d, c in sorted(served.items(), key=lambda item: -int(item[0]))))
    return f"decode loop (not a goal): {' | '.join(parts)}\n" if parts else ""


def read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def goal_table(runs: list[tuple[str, Path]]) -> str:
    """The goal table over runs (name, folder), later runs winning, then which run each cache's numbers came
    from when that is more than one."""
    kernels = next((k for k in (read_report(d / "bench_kernels.json") for _, d in reversed(runs)) if k), None)
    serve, source = merge_serve([(name, read_report(d / "serve_bench.json")) for name, d in runs])
    table = markdown(kernel_goals(kernels) + server_goals(serve))
    extra = decode_loop_line(serve, kernels) + decode_tile_line(kernels) + prefill_line(kernels) + rerun_line(serve)
    if extra:
        table += "\n" + extra
    origin = source_line(source)
    if origin:
        table += "\n" + origin
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+",
                   help="folder(s) with bench_kernels.json and serve_bench.json; later folders win")
    a = p.parse_args(argv)
    print(goal_table([(str(d), d) for d in a.results]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
