"""Turn the files a device run brought back into docs: one page of results, the reports beside it.

    python3 scripts/device/record.py FILES_AT                  # the first run's folder (the device tool's files_at)
    python3 scripts/device/record.py FIRST_AT RERUN_AT         # a rerun's too (later folders win, as in goals.py)

Writes ``docs/gpu_results.md`` (``--out``): the date, the device, the exact command of each run, every step's
exit code and time, the goal table (``goals.py`` over the folders), the server and kernel reports, the
calibration's cost, and the log tail of every step that failed and of every server log with a traceback, read
from ``device_check.tar.gz``; and copies each run's reports (``.md``, ``.json``, ``.png``) to
``docs/gpu/DATE/runN/``.  A page of another date already there is kept as ``docs/gpu_results_DATE.md`` (its run
folders are left as they are): a later session's record never overwrites an earlier one's; recording the same
date again (after a rerun) replaces that date's page and folders.
Runs with a bare ``python3`` (the device run's files need no package), so it imports nothing of the project but
``goals.py`` beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goals  # noqa: E402  (beside this file; needs no package)

FIRST_COMMAND = ('run command="bash scripts/device_check.sh" carry=["out/device_bundle", "out/triton_bundle"] '
                 'timeout_s=600')
REPORTS = ("serve_bench", "bench_kernels", "bench_kernels_cpu_smoke", "decode_variants")
FAILED_LOG_LINES = 30

_STEP = re.compile(r"^== (?P<name>[\w-]+) \(limit (?P<limit>\d+) s, at (?P<at>\d+) s\): ")
_SKIP = re.compile(r"^== (?P<name>[\w-]+): skipped \((?P<why>.*)\)$")
_RC = re.compile(r"^   rc=(?P<rc>\d+)(?P<timed> \(TIMED OUT\))? in (?P<secs>\d+) s")
_DONE = re.compile(r"^== done in (?P<secs>\d+) s, rc=(?P<rc>\d+)")
_NOTE = re.compile(r"^== (?P<text>.*)$")


@dataclass
class Step:
    name: str
    limit: int | None = None
    at: int | None = None
    rc: int | None = None          # None: started, no exit line (the run was cut while it ran)
    timed_out: bool = False
    seconds: int | None = None
    skipped: str | None = None
    tail: list[str] = field(default_factory=list)


@dataclass
class Summary:
    steps: list[Step]
    notes: list[str]               # other "== ..." lines: SGLang not installed, calibration skipped for time, ...
    done: tuple[int, int] | None   # (seconds, rc) of the script's last line; None: cut before it


def parse_summary(text: str) -> Summary:
    """The steps of one ``device_check.sh`` summary.txt, in order."""
    steps: list[Step] = []
    notes: list[str] = []
    done = None
    current: Step | None = None
    for line in text.splitlines():
        if m := _STEP.match(line):
            current = Step(m["name"], int(m["limit"]), int(m["at"]))
            steps.append(current)
        elif m := _SKIP.match(line):
            steps.append(Step(m["name"], skipped=m["why"]))
            current = None
        elif m := _DONE.match(line):
            done = (int(m["secs"]), int(m["rc"]))
            current = None
        elif current is not None and (m := _RC.match(line)):
            current.rc, current.timed_out, current.seconds = int(m["rc"]), bool(m["timed"]), int(m["secs"])
        elif current is not None and line.startswith("   | "):
            current.tail.append(line[5:])
        elif line.startswith("== goals"):
            current = None
        elif m := _NOTE.match(line):
            notes.append(m["text"])
            current = None
    return Summary(steps, notes, done)


def device_line(env_log: str | None, summary: Summary) -> str:
    """What the env step printed about the machine, in one line: the GPU line(s) of nvidia-smi, then Python,
    torch, CUDA, triton and transformers.  From the full env.log where the tarball has it, else its tail."""
    env = next((s for s in summary.steps if s.name == "env"), None)
    lines = env_log.splitlines() if env_log is not None else (env.tail if env else [])
    lines = [ln.strip() for ln in lines if ln.strip()]
    if not lines:
        return "unknown (no env step)"
    gpus = [ln for ln in lines if ln.startswith("NVIDIA")] or ["no GPU (nvidia-smi: " + lines[0] + ")"]
    return "; ".join(gpus) + f"; python, torch, CUDA, triton, transformers: {lines[-1]}"


def compiler_line(summary: Summary) -> str:
    """Which Triton compiled the run's kernels: the carried one (a user's) for the steps after the triton step,
    the servers excepted where torch's compiler failed with it, or the machine's (the device line's)."""
    bundled = next((m[1] for n in summary.notes
                    if (m := re.match(r"the steps below import triton (\S+) from the bundle", n))), None)
    triton = next((s for s in summary.steps if s.name == "triton"), None)
    if bundled is None:
        why = "" if triton is None else f"; the carried Triton's step: {_status(triton)}, see its log"
        return f"the machine's Triton (the device line's) for every step{why}"
    servers = next((n for n in summary.notes if n.startswith("the servers run on the machine's triton")), None)
    return (f"Triton {bundled}, carried (the one a user's SGLang installs), for every step after the triton step"
            + (f"; **the servers on the machine's Triton** ({servers})" if servers else ", the servers included"))


def _status(step: Step) -> str:
    if step.skipped is not None:
        return f"skipped ({step.skipped})"
    if step.rc is None:
        return "**cut while running** (no exit line)"
    if step.timed_out:
        return f"**timed out** (rc {step.rc})"
    return "ok" if step.rc == 0 else f"**failed** (rc {step.rc})"


def steps_table(summary: Summary) -> str:
    lines = ["| step | result | time (s) | limit (s) | started at (s) |", "|---|---|---|---|---|"]
    for s in summary.steps:
        lines.append(f"| {s.name} | {_status(s)} | {'' if s.seconds is None else s.seconds} | "
                     f"{'' if s.limit is None else s.limit} | {'' if s.at is None else s.at} |")
    end = ("the script's last line: done in {} s, rc={}".format(*summary.done) if summary.done
           else "no closing line: the device tool stopped the script before its end")
    return "\n".join(lines) + f"\n\n{end}.\n"


def read_logs(folder: Path) -> dict[str, str]:
    """Every file of ``results/`` in the run's device_check.tar.gz, by name, as text ({}: no readable tarball)."""
    try:
        with tarfile.open(folder / "device_check.tar.gz") as tar:
            files = {}
            for member in tar.getmembers():
                if member.isfile() and member.name.startswith("results/"):
                    files[member.name[len("results/"):]] = tar.extractfile(member).read().decode(errors="replace")
            return files
    except (OSError, tarfile.TarError):
        return {}


def _tail(name: str, lines: list[str], origin: str = "") -> str:
    lines = lines[-FAILED_LOG_LINES:]
    return (f"last {len(lines)} line{'' if len(lines) == 1 else 's'} of {name}{origin}:\n\n```\n"
            + "\n".join(lines) + "\n```\n")


def failed_logs(logs: dict[str, str], summary: Summary) -> str:
    """The last lines of the full log of every step that did not end with rc 0, and of every SGLang server log
    that holds a traceback (a server can fail while its step, which retries it, ends well)."""
    parts = []
    for s in summary.steps:
        if s.skipped is not None or s.rc == 0:
            continue
        log = logs.get(f"{s.name}.log")
        lines = log.splitlines() if log is not None else s.tail
        parts.append(f"`{s.name}` ({_status(s)}), " + _tail(f"{s.name}.log", lines,
                                                             "" if log is not None else " (from summary.txt)"))
    for name, text in sorted(logs.items()):
        if name.startswith("server_") and name.endswith(".log") and "Traceback (most recent call last)" in text:
            parts.append("A server's traceback, " + _tail(name, text.splitlines()))
    return "\n".join(parts)


def calibration_line(logs: dict[str, str]) -> str | None:
    text = logs.get("calibrate_bench.json")
    try:
        c = json.loads(text) if text else None
    except ValueError:
        return None
    if not c:
        return None
    gpu = "" if c.get("peak_gpu_mb") is None else f", peak GPU memory {c['peak_gpu_mb']} MB"
    stages = "".join(f", {name} {c[key]} s ({c[key + '_per_layer']} s per layer)" for name, key in
                     (("fit", "fit_s"), ("policy", "policy_s")) if c.get(key) is not None
                     and c.get(key + "_per_layer") is not None)  # since 2026-12-06
    layers = f", {c['layers']} layers" if c.get("layers") else ""
    bits = f" with the {c['bits']:g}-bit policy" if c.get("bits") is not None else ""
    threads = f" (the fit on {c['threads']} CPU threads)" if c.get("threads") else ""
    return (f"{c['model']} ({c['parameters'] / 1e9:.2f} B parameters{layers}, random weights, {c['dtype']}) on "
            f"{c['device_name']}: {c['method']}{bits} over {c['tokens']} tokens{threads}, capture {c['capture_s']} s"
            f"{stages}, whole pipeline {c['total_s']} s{gpu}, peak RSS {c['peak_rss_mb']} MB (`{c['command']}`)")


def probe_line(logs: dict[str, str]) -> str | None:
    """What the prefill probe (``prefill_probe.py``, before the servers) measured and chose, or None."""
    try:
        p = json.loads(logs.get("prefill_probe.json") or "null")
    except ValueError:
        return None
    if not p:
        return None

    def ms(key):
        return "n/a" if p.get(key) is None else f"{p[key]:.2f} ms"

    return (f"one layer, {p['chunk']} new tokens over {p['prefix']} cached ({p['kv_heads']} KV heads, d {p['d']}) "
            f"on {p['device']}: Triton extend kernel {ms('kernel_ms')}, sdpa path {ms('sdpa_ms')}"
            f"{' (KV heads ' + p['sdpa_kv_heads'] + ')' if p.get('sdpa_kv_heads') else ''}, max relative "
            f"difference {'n/a' if p.get('rel_err') is None else format(p['rel_err'], '.1e')}; the INT2 server's "
            f"prefill: **{p['choice']}** ({p['why']})")


def demote(markdown: str) -> str:
    """A report as a section of a run's part of the page: its headings two levels down."""
    return "\n".join("##" + ln if ln.startswith("#") else ln for ln in markdown.splitlines()) + "\n"


PAGE_DATE = re.compile(r"# GPU results \((\d{4}-\d{2}-\d{2})\)")


def keep_earlier_page(out: Path, date: str) -> Path | None:
    """Move ``out/gpu_results.md`` to ``out/gpu_results_<its date>.md`` if it records another date than ``date``;
    returns where it went (None: no page, or one of the same date, which the new record replaces)."""
    page = out / "gpu_results.md"
    if not page.is_file():
        return None
    m = PAGE_DATE.match(page.read_text())
    if m and m.group(1) == date:
        return None
    kept = out / f"gpu_results_{m.group(1) if m else 'undated'}.md"
    if kept.exists():
        raise SystemExit(f"{page} records {m.group(1) if m else 'no date'}, and {kept} exists already: move one "
                         "of them by hand first")
    page.rename(kept)
    return kept


def record(folders: list[Path], out: Path, commands: list[str], date: str) -> Path:
    """Write ``out/gpu_results.md`` and ``out/gpu/DATE/runN/`` from the runs' folders, an earlier date's page kept
    beside it (:func:`keep_earlier_page`); returns the page's path."""
    for folder in folders:
        if not (folder / "summary.txt").is_file():
            raise SystemExit(f"{folder}: no summary.txt (is this the device tool's files_at folder?)")
    keep_earlier_page(out, date)
    earlier = sorted(out.glob("gpu_results_*.md"), reverse=True)
    summaries = [parse_summary((f / "summary.txt").read_text()) for f in folders]
    logs = [read_logs(f) for f in folders]
    names = [f"run{i + 1}" for i in range(len(folders))]
    page = [f"# GPU results ({date})", "",
            f"Device: {device_line(logs[0].get('env.log'), summaries[0])}.", "",
            *[f"Compiler{f' ({n})' if len(folders) > 1 else ''}: {compiler_line(sm)}."
              for n, sm in zip(names, summaries)], "",
            "Written by `python3 scripts/device/record.py " + " ".join(str(f) for f in folders) + "` from the "
            f"files the device tool brought back; each run's reports are copied to `docs/gpu/{date}/runN/`. "
            "What the steps do and how the goals are judged: [GPU.md](GPU.md)."
            + (" Earlier records: " + ", ".join(f"[{e.name}]({e.name})" for e in earlier) + "." if earlier else ""),
            ""]
    page += ["## Goals", "", goals.goal_table(list(zip(names, folders))).rstrip(), ""]
    for i, (folder, summary, log, name) in enumerate(zip(folders, summaries, logs, names)):
        command = commands[i] if i < len(commands) else ("device tool: " + FIRST_COMMAND if i == 0 else "(not given)")
        dest = out / "gpu" / date / name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        page += [f"## {name}: `{command}`", "", steps_table(summary)]
        if summary.notes:
            page += ["Notes from the script: " + "; ".join(summary.notes) + ".", ""]
        if failed := failed_logs(log, summary):
            page += ["### What failed", "", failed]
        for report in REPORTS:
            md = folder / f"{report}.md"
            for ext in ("md", "json", "png"):
                if (folder / f"{report}.{ext}").is_file():
                    shutil.copy2(folder / f"{report}.{ext}", dest / f"{report}.{ext}")
            if md.is_file():
                page += [demote(md.read_text())]
                if (folder / f"{report}.png").is_file():
                    page += [f"![{report}](gpu/{date}/{name}/{report}.png)", ""]
        if probe := probe_line(log):
            page += ["### Prefill probe (before the servers)", "", probe, ""]
        if cal := calibration_line(log):
            page += ["### Calibration cost", "", cal, ""]
    path = out / "gpu_results.md"
    path.write_text("\n".join(page).rstrip() + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", type=Path, nargs="+", help="the device tool's files_at of each run, first run first")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "docs",
                   help="docs folder to write gpu_results.md and gpu/ into (default: this checkout's docs/)")
    p.add_argument("--command", action="append", default=[],
                   help="the exact command of each run, in order (default for the first: the documented one)")
    p.add_argument("--date", default=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"))
    a = p.parse_args(argv)
    print(record(a.folders, a.out, a.command, a.date))
    return 0


if __name__ == "__main__":
    sys.exit(main())
