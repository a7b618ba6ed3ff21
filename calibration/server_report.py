"""The INT2 server against the BF16 server, end to end over HTTP: logprobs on long prompts, greedy agreement on short ones.

    .venv/bin/python scripts/report_server_logprobs.py --out docs        # writes docs/SERVER_ACCURACY.md, .json
    .venv/bin/python -m oscar_sglang.calibration.server_report --out docs   # the same (this module), .png

Starts real SGLang servers one at a time (``oscar_sglang.sglang.launcher``;
on CPU: SGLang's CPU engine) and talks to them through the native
``/generate`` endpoint with token ids, so token boundaries are exact.

1. **BF16 server.**  For each long prompt (default: 4 prompts of 1200 tokens, one per play
   from the held-out evaluation plays), the greedy
   continuation of ``--continuation`` tokens and its decode logprobs.  Then
   the same teacher-forced procedure the INT2 servers get (below), which gives
   the BF16 reference logprobs, BF16's top-k distribution (for the KL) and the
   noise floor (BF16 teacher-forced against BF16 decode).  Then the short
   factual prompts, greedy.
2. **One INT2 server per method with the default windows** (``--long-windows``,
   sink 64 / recent 256: about 880 of each 1200-token prompt's positions are
   read from INT2): per-token logprobs of BF16's continuation, teacher-forced
   as decoding reads the cache (see below).
3. **One INT2 server per method with small windows** (``--short-windows``,
   sink 4 / recent 16): greedy decoding of the short prompts (31-42 tokens, so
   from the first decode step on positions 4 .. len-16 are read from INT2),
   compared with BF16's first ``--short-tokens`` tokens; with ``--long-small``
   also the long-prompt measurement (almost the whole prompt read from INT2).

Teacher forcing that reads INT2 exactly as decoding does.  The ``oscar_int2``
backend attends *exactly* among the new tokens of an extend (prefill) and
reads only the cached prefix from the pool, so a single request holding
prompt + continuation would measure nothing of INT2.  Two ways around it.

``--block 1`` (token by token, as serving): per prompt, flush the radix
cache; request ``j`` (``j = 0 ..
continuation-1``) is prompt + continuation[:j] with ``max_new_tokens`` 1 and
the logprobs of its output position (``token_ids_logprob`` for BF16's token
and BF16's top-k, ``top_logprobs_num`` for the argmax).  Request 0 is a fresh
prefill, as the first token of any answer is; request ``j >= 1`` reuses the
``len(prompt) + j - 1`` tokens request ``j - 1`` left in the radix cache
(checked on every request through ``meta_info.cached_tokens``) and computes
one new token attending to the pool: the same forward pass as decode step
``j`` of a real answer, hot windows included (positions ``< sink`` and the
last ``recent`` read BF16, the rest INT2).  The one difference: the new
token attends to itself exactly where decoding reads back its BF16 hot copy.
One request per scored token; the INT2 CPU path costs seconds per request.

``--block B`` (default 8, ``B`` tokens per request): per prompt, flush; send
the prompt alone (``max_new_tokens`` 1; the radix cache keeps it, written in
INT2); then for each block ``[j, j + B)`` send prompt + continuation[:j + B]
with ``logprob_start_len = len(prompt) + j - 1``.  SGLang caps the prefix
match at ``logprob_start_len``, so the request reuses exactly
``len(prompt) + j - 1`` cached tokens (checked through ``cached_tokens``) and
recomputes the last cached token plus the block; its input logprobs score the
block.  Each scored token's query reads the whole cached prefix from the pool
as decoding does, with two differences bounded by ``B``: the block's own
earlier tokens are attended exactly (decoding reads them as BF16 hot rows;
they are inside the recent window whenever ``recent > B``), and the hot window
is planned for the end of the block; that costs nothing, because tokens that
leave the recent window keep their BF16 copy until the side pool needs the
entry (docs/SGLANG.md), which a few prompts never force.  Also, continuation token 0 is scored by the
last prompt token's query over the *cached* prompt, as for a request whose
prompt hits the radix cache; a fresh request gets its first token from the
exact prefill (``--block 1`` scores it that way).

On the BF16 server either procedure reproduces the decode logprobs only up to
CPU numerics (extend and decode take different code paths); the BF16
reference is therefore BF16's own teacher-forced logprobs, same procedure as
the INT2 servers, and the gap to its decode logprobs is reported as a noise
floor.

Metrics per method (per scored token, then averaged over all tokens):
``|Δ logprob|`` and ``Δ = logprob_INT2 - logprob_BF16`` of BF16's token (the
BF16 reference is BF16's own teacher-forced logprob, same procedure, so only
the KV cache differs); top-1 agreement (BF16's token is INT2's argmax; logits
are bf16, so exact ties count as agreement); KL(BF16 || INT2) over BF16's
top-k tokens plus one "rest" bucket, a lower bound of the full KL; and the
first position where INT2's top-1 differs from BF16's token, which is where
INT2's own greedy output would first diverge (for ``--block 1``, exactly, ties aside).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from oscar_sglang.sglang import launcher  # starts servers in subprocesses; imports no SGLang

ROOT = Path.cwd()  # rotations/ and docs/ are looked up where the report runs (the repository root for the docs)

SHORT_PROMPTS = [
    "Here are some facts about geography. The longest river in Africa is the Nile. The tallest mountain in the "
    "world is Mount Everest. The largest ocean on Earth is the Pacific Ocean. The capital city of Japan is",
    "Question: What is the chemical symbol for gold, and what is its atomic number? Please answer in one "
    "sentence and explain briefly where the symbol comes from.\nAnswer:",
    "Our solar system has eight planets that orbit the Sun. Mercury is the planet closest to the Sun, and "
    "Neptune is the one farthest away from it. The largest planet in the solar system is",
    "William Shakespeare was an English playwright, poet and actor, widely regarded as the greatest writer in "
    "the English language. He wrote Hamlet, Macbeth and King Lear. He was born in the town of",
    "Water is a chemical compound made of two hydrogen atoms and one oxygen atom. At normal atmospheric "
    "pressure, pure water freezes at zero degrees Celsius and it boils at",
    "The French Revolution began in the summer of 1789, when a crowd in Paris stormed a royal fortress that "
    "was used as a prison. The name of that fortress was the",
    "In mathematics, a prime number is a natural number greater than one that has no positive divisors other "
    "than one and itself. The first five prime numbers are",
    "The human heart has four chambers, two atria and two ventricles, and it pumps blood around the whole "
    "body. The blood vessels that carry blood away from the heart are called",
    "Albert Einstein was a German-born theoretical physicist who developed the theory of relativity. In 1921 "
    "he received the Nobel Prize in Physics for his explanation of the",
    "Python is a popular programming language created by Guido van Rossum and first released in 1991. To print "
    "the text Hello, world on the screen in Python, you write",
]

# Where in each evaluation play the long prompts start (fraction of its characters), cycled over the plays.
PROMPT_OFFSETS = (0.4, 0.7, 0.25, 0.55)
TIE_TOL = 1e-6


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- inputs -------------------------------------------------------------------


def long_prompts(tok, n: int, tokens: int) -> list[dict]:
    """``n`` prompts of ``tokens`` tokens from the evaluation plays, starting at a line boundary."""
    from oscar_sglang import assets, configs

    _, eval_names = configs.text_split()
    texts = assets.read_texts(eval_names)
    out = []
    for i in range(n):
        name = eval_names[i % len(eval_names)]
        frac = PROMPT_OFFSETS[(i // len(eval_names)) % len(PROMPT_OFFSETS)]
        text = texts[name]
        start = text.find("\n", int(len(text) * frac)) + 1
        ids = tok(text[start:start + 12 * tokens], add_special_tokens=False)["input_ids"][:tokens]
        if len(ids) < tokens:
            raise ValueError(f"{name}: not enough text for a {tokens}-token prompt at {frac:.0%}")
        out.append({"text": name, "offset": frac, "char_start": start, "ids": ids})
    return out


def short_prompts(tok) -> list[dict]:
    return [{"prompt": p, "ids": tok(p, add_special_tokens=False)["input_ids"]} for p in SHORT_PROMPTS]


def discover_rotations(model_dir: Path) -> dict[str, Path]:
    """Calibrated artifacts next to the project: ``rotations/<model name>-<method>/``."""
    found = {}
    for d in sorted((ROOT / "rotations").glob(f"{model_dir.name}-*")):
        if (d / "manifest.json").is_file():
            found[d.name[len(model_dir.name) + 1:]] = d
    return found


def build_methods(args, model_dir: Path, work: Path) -> dict[str, Path]:
    import transformers

    from oscar_sglang import artifacts as art

    fp = art.ModelFingerprint.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    methods: dict[str, Path] = {}
    if not args.no_builtin:
        for name, builder in (("identity", art.identity), ("hadamard", art.hadamard)):
            methods[name] = art.save(builder(fp), work / "rotations" / name)
    given = {}
    for entry in args.rotations or []:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--rotations {entry!r}: expected NAME=DIR")
        given[name] = Path(path).expanduser().resolve()
    if not given:
        given = discover_rotations(model_dir)
    if not given and not args.no_calibrate:
        out = work / "rotations" / "oscar-center"
        log(f"no calibrated rotations for {model_dir.name} under rotations/: calibrating oscar-center into {out}")
        subprocess.run([str(Path(sys.executable).with_name("oscar-calibrate")), "--model", str(model_dir),
                        "--method", "oscar-center", "--out", str(out)], check=True)
        given = {"oscar-center": out}
    for name, path in given.items():
        art.load(path, expect=fp)  # fail fast, before any server starts
        methods[name] = path
    return methods


# -- server I/O ---------------------------------------------------------------


def generate(url: str, body: dict):
    return launcher.post(url, "/generate", body, timeout_s=3600)


@contextmanager
def server(model_dir: Path, log_path: Path, extra: list[str], max_total_tokens: int):
    t0 = time.time()
    with launcher.local_server(model_dir, log_path, "--max-total-tokens", str(max_total_tokens),
                               "--chunked-prefill-size", "4096", *extra) as url:
        log(f"  server ready in {time.time() - t0:.0f} s ({log_path.name})")
        yield url


def log_lines(path: Path, start: int, needle: str) -> list[str]:
    text = path.read_text(errors="replace")[start:]
    return [line.split("] ", 1)[-1] for line in text.splitlines() if needle in line]


# -- measurements -------------------------------------------------------------


def _lp(entry) -> float:
    return float(entry[0])


def bf16_continuations(url: str, prompts: list[dict], n: int) -> list[dict]:
    """BF16's greedy continuation of each prompt and its decode logprobs (sequential, batch 1)."""
    out = []
    for i, p in enumerate(prompts):
        launcher.flush_cache(url)
        t0 = time.time()
        r = generate(url, {"input_ids": p["ids"], "return_logprob": True,
                           "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        m = r["meta_info"]
        ids = list(r["output_ids"])
        out.append({"ids": ids, "decode_logprobs": [_lp(e) for e in m["output_token_logprobs"]],
                    "prompt_cached_tokens": m["cached_tokens"]})
        log(f"  BF16 greedy: {len(ids)} tokens in {time.time() - t0:.0f} s")
    return out


def teacher_forced(url: str, prompts: list[dict], conts: list[list[int]], block: int, bf16: bool, top_k: int,
                   ref: list[list[dict]] | None, first_index: int = 0,
                   total: int | None = None) -> tuple[list[list[dict]], list[dict]]:
    """Per continuation token: logprob of BF16's token, with the cached prefix read as decoding reads it.

    ``block == 1`` (steps, exactly as serving): after a flush, request ``j``
    is prompt + continuation[:j] with one new token; request 0 is a fresh
    prefill (the first token of a real answer comes from the exact prefill too),
    request ``j >= 1`` reuses the ``len(prompt) + j - 1`` tokens request
    ``j - 1`` left in the radix cache and computes one token, as one decode
    step does; the logprobs are those of its output position.
    ``block > 1``: after a flush the prompt is sent alone (so it is cached), then
    each block's tokens are scored through input logprobs (see the module docstring).
    BF16 (``bf16=True``) returns its top-``top_k`` per position; INT2 returns the
    KL against ``ref``.  Returns per prompt the per-token rows, and the cache check of every request.
    """
    results, checks = [], []
    total = total or len(prompts)
    for i, (p, cont) in enumerate(zip(prompts, conts), start=first_index):
        n0 = len(p["ids"])
        t0 = time.time()
        launcher.flush_cache(url)
        rows = []
        if block == 1:
            for j in range(len(cont)):
                ids = p["ids"] + cont[:j]
                want = {cont[j]} if bf16 else {cont[j], *ref[i][j]["top_ids"]}
                m = generate(url, {"input_ids": ids, "return_logprob": True, "logprob_start_len": len(ids),
                                   "top_logprobs_num": top_k if bf16 else 1, "token_ids_logprob": sorted(want),
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}})["meta_info"]
                checks.append({"prompt": i, "request": f"step {j}", "cached_tokens": m["cached_tokens"],
                               "expected": 0 if j == 0 else len(ids) - 1})
                rows.append(_row(m["output_top_logprobs"][0], m["output_token_ids_logprobs"][0], cont[j], bf16,
                                 None if bf16 else ref[i][j], f"prompt {i}, step {j}"))
        else:
            r = generate(url, {"input_ids": p["ids"], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            checks.append({"prompt": i, "request": "prompt", "cached_tokens": r["meta_info"]["cached_tokens"],
                           "expected": 0})
            for j in range(0, len(cont), block):
                k = min(block, len(cont) - j)
                start = n0 + j - 1
                want = set(cont[j:j + k]) if bf16 else {t for row in ref[i][j:j + k] for t in row["top_ids"]}
                m = generate(url, {"input_ids": p["ids"] + cont[:j + k], "return_logprob": True,
                                   "logprob_start_len": start, "top_logprobs_num": top_k if bf16 else 1,
                                   "token_ids_logprob": sorted(want | set(cont[j:j + k])),
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}})["meta_info"]
                checks.append({"prompt": i, "request": f"block {j}", "cached_tokens": m["cached_tokens"],
                               "expected": start})
                lps, tops, tids = (m[f"input_{x}"][1:] for x in ("token_logprobs", "top_logprobs", "token_ids_logprobs"))
                if len(lps) != k or [e[1] for e in lps] != cont[j:j + k]:
                    raise RuntimeError(f"prompt {i}, block {j}: unexpected input logprobs "
                                       f"{[e[1] for e in lps]} for tokens {cont[j:j + k]}")
                for t in range(k):
                    rows.append(_row(tops[t], tids[t], cont[j + t], bf16, None if bf16 else ref[i][j + t],
                                     f"prompt {i}, block {j}"))
        results.append(rows)
        bad = [c for c in checks if c["prompt"] == i and c["cached_tokens"] != c["expected"]]
        log(f"  teacher-forced, prompt {i + 1}/{total}: {len(rows)} tokens in {time.time() - t0:.0f} s"
            + (f"; UNEXPECTED cached_tokens {bad}" if bad else "; cached_tokens as expected"))
    return results, checks


def _row(tops, tids, token: int, bf16: bool, ref_row: dict | None, where: str) -> dict:
    """One scored position from SGLang's top-k list and its requested-token-ids list."""
    if not tops or not tids:
        raise RuntimeError(f"{where}: the server returned no top or token-id logprobs")
    by_id = {e[1]: _lp(e) for e in tids}
    row = {"logprob": by_id[token], "top1_logprob": _lp(tops[0]), "top1_id": tops[0][1]}
    if bf16:
        row["top_ids"] = [e[1] for e in tops]
        row["top_logprobs"] = [_lp(e) for e in tops]
    else:
        row["kl_topk"] = kl_coarse(ref_row, by_id)
    return row


def kl_coarse(ref_row: dict, q: dict[int, float]) -> float:
    """KL(BF16 || INT2) over BF16's top-k tokens plus one bucket for the rest (a lower bound of the full KL)."""
    kl, p_sum, q_sum = 0.0, 0.0, 0.0
    for tid, lp in zip(ref_row["top_ids"], ref_row["top_logprobs"]):
        lq = q[tid]
        kl += math.exp(lp) * (lp - lq)
        p_sum += math.exp(lp)
        q_sum += math.exp(lq)
    p_rest, q_rest = max(1.0 - p_sum, 0.0), max(1.0 - q_sum, 1e-12)
    if p_rest > 1e-9:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def greedy_short(url: str, prompts: list[dict], n: int, batched: bool, log_path: Path) -> dict:
    launcher.flush_cache(url)
    start = len(log_path.read_text(errors="replace"))
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    t0 = time.time()
    if batched:
        rs = generate(url, {"input_ids": [p["ids"] for p in prompts], "sampling_params": params})
    else:
        rs = [generate(url, {"input_ids": p["ids"], "sampling_params": params}) for p in prompts]
    log(f"  short prompts: {len(prompts)} x {n} greedy tokens in {time.time() - t0:.0f} s")
    time.sleep(1)
    return {"ids": [list(r["output_ids"]) for r in rs],
            "prefill_batches": log_lines(log_path, start, "Prefill batch")}


# -- summaries ----------------------------------------------------------------


def agree(row: dict) -> bool:
    """BF16's token is (one of) the argmax tokens."""
    return row["logprob"] >= row["top1_logprob"] - TIE_TOL


def summarize_long(rows: list[list[dict]], ref: list[list[dict]], decode: list[list[float]]) -> dict:
    flat = [(r, q, d) for rp, qp, dp in zip(rows, ref, decode) for r, q, d in zip(rp, qp, dp)]
    deltas = [r["logprob"] - q["logprob"] for r, q, _ in flat]
    deltas_dec = [r["logprob"] - d for r, _, d in flat]
    first = []
    for rp in rows:
        miss = [t for t, r in enumerate(rp) if not agree(r)]
        first.append(miss[0] if miss else None)
    out = {
        "tokens": len(flat),
        "mean_abs_delta": mean(abs(x) for x in deltas),
        "mean_delta": mean(deltas),
        "max_abs_delta": max(abs(x) for x in deltas),
        "mean_abs_delta_vs_bf16_decode": mean(abs(x) for x in deltas_dec),
        "top1_agree": sum(agree(r) for r, _, _ in flat),
        "first_divergence": first,
        "per_position_abs_delta": [mean(abs(rows[p][t]["logprob"] - ref[p][t]["logprob"]) for p in range(len(rows)))
                                   for t in range(min(map(len, rows)))],
    }
    if all("kl_topk" in r for r, _, _ in flat):
        out["mean_kl_topk"] = mean(r["kl_topk"] for r, _, _ in flat)
        out["per_position_kl_topk"] = [mean(rows[p][t]["kl_topk"] for p in range(len(rows)))
                                       for t in range(min(map(len, rows)))]
    return out


def summarize_short(ids: list[list[int]], ref: list[list[int]], n: int) -> dict:
    prefix = []
    for a, b in zip(ids, ref):
        k = 0
        while k < n and k < len(a) and k < len(b) and a[k] == b[k]:
            k += 1
        prefix.append(k)
    return {"prompts": len(ids), "all_agree": sum(k == n for k in prefix),
            "same_position_tokens": sum(x == y for a, b in zip(ids, ref) for x, y in zip(a[:n], b[:n])),
            "total_tokens": n * len(ids), "agreed_prefix": prefix, "mean_agreed_prefix": mean(prefix)}


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


# -- report -------------------------------------------------------------------


def summary_lines(data: dict) -> list[str]:
    """Headline bullets: one for the long prompts per window setting, one for the short prompts."""
    meta, s = data["meta"], data["summary"]
    out = []
    by_windows: dict[tuple, list] = {}
    for key, r in s["long"].items():
        if "error" not in r:
            by_windows.setdefault(tuple(r["windows"]), []).append((key.split(" (")[0], r))
    nf = s.get("bf16_noise_floor")
    for (sink, recent), rows in by_windows.items():
        names = " / ".join(name for name, _ in rows)
        out.append(
            f"* Long prompts ({meta['long_prompts']} x {meta['long_tokens']} tokens, sink {sink}, recent {recent}; "
            f"{meta['long_prompts'] * meta['continuation']} scored tokens): mean |Δ logprob| of BF16's greedy "
            f"tokens {names} = " + " / ".join(f"{r['mean_abs_delta']:.3f}" for _, r in rows)
            + (f" (BF16's own noise floor {nf['mean_abs_delta']:.3f})" if nf else "")
            + "; BF16's token is INT2's top-1 at " + " / ".join(
                f"{100 * r['top1_agree'] / r['tokens']:.1f}%" for _, r in rows) + " of the positions; KL "
            + " / ".join(f"{r.get('mean_kl_topk', float('nan')):.3f}" for _, r in rows) + ".")
    shorts = [(k.split(" (")[0], r) for k, r in s["short"].items() if k != "BF16" and "error" not in r]
    if shorts:
        sw = meta["short_windows"]
        out.append(
            f"* Short factual prompts (sink {sw[0]}, recent {sw[1]}): the first {meta['short_tokens']} greedy tokens "
            f"equal BF16's on " + ", ".join(f"{r['all_agree']}/{r['prompts']} ({name})" for name, r in shorts)
            + " prompts; tokens equal at the same position: "
            + ", ".join(f"{r['same_position_tokens']}/{r['total_tokens']} ({name})" for name, r in shorts) + ".")
    return out


def fmt_first(first: list) -> str:
    return ", ".join("none" if f is None else str(f) for f in first)


def method_calibration(methods: dict) -> dict[str, str]:
    """What each method's rotations were calibrated on, from its manifest (``spec: text, text, ...``)."""
    out = {}
    for name, d in methods.items():
        try:
            cal = json.loads((Path(d) / "manifest.json").read_text()).get("calibration", {})
        except (OSError, ValueError):
            cal = {}
        data = cal.get("data") if isinstance(cal.get("data"), dict) else {}
        texts = data.get("texts") or []
        if data.get("spec") or texts:
            out[name] = f"{data.get('spec', '?')} ({', '.join(map(str, texts))})" if texts else str(data["spec"])
        else:
            out[name] = "no calibration text (data-free)" if cal.get("tokens", 0) == 0 else "unrecorded text"
    return out


def _calibration_sentence(meta: dict) -> str:
    per = meta.get("method_calibration")
    if not per:  # reports written before the per-method record
        return f"Rotations calibrated on {', '.join(meta.get('calibration_texts', [])) or 'n/a'}"
    groups: dict[str, list[str]] = {}
    for name, what in per.items():
        groups.setdefault(what, []).append(name)
    return "Rotations calibrated on " + "; ".join(f"{what} ({', '.join(names)})" for what, names in groups.items())


def markdown(data: dict) -> str:
    meta, s = data["meta"], data["summary"]
    lw, sw = meta["long_windows"], meta["short_windows"]
    n_cont, n_prompt = meta["continuation"], meta["long_tokens"]
    int2_read = n_prompt - 1 - lw[0] - lw[1]
    lines = [
        "# INT2 server vs BF16 server: logprobs on long prompts, greedy agreement on short prompts",
        "",
        f"Measured {meta['date']} on {meta['device']}, SGLang {meta['sglang']}, model `{meta['model_name']}` "
        f"({meta['model']}). {_calibration_sentence(meta)}; "
        f"evaluated on held-out plays ({', '.join(meta['evaluation_texts'])}). Run time "
        f"{meta['seconds'] / 60:.1f} min (2 shared CPU cores). Produced by:",
        "",
        "```",
        meta["command"],
        "```",
        "",
        "Raw numbers: [server_accuracy.json](server_accuracy.json)"
        + (", plot: [server_accuracy.png](server_accuracy.png)." if meta.get("plot") else "."),
        "",
        "## Summary",
        "",
        *summary_lines(data),
        "",
        "## Long prompts: logprobs of BF16's greedy continuation",
        "",
        f"{meta['long_prompts']} prompts of {n_prompt} tokens ({'; '.join(meta['long_prompt_sources'])}). "
        f"The BF16 server's greedy continuation ({n_cont} tokens each) is fed to every server "
        + (f"token by token: step 0 is the prompt's prefill, each later step a request that reuses the "
           f"previous one's radix-cached tokens and computes one new token, so each scored token comes from "
           f"the same forward pass as that step of a real decode, reading the cache (BF16 at the sink and "
           f"recent windows, INT2 elsewhere) as decoding does"
           if meta["block"] == 1 else
           f"in teacher-forced blocks of {meta['block']} tokens over the radix-cached prompt and the previous "
           f"blocks, so each scored token's query reads the cached prefix from the pool (BF16 at the sink and "
           f"recent windows, INT2 elsewhere) as a decode step does (the block's own tokens are attended exactly, "
           f"where decoding reads their BF16 hot copies). Token 0 is scored over the "
           f"cached prompt too, as when a request's prompt hits the radix cache; a fresh request gets its "
           f"first token from the exact prefill")
        + f". The method is in the script's docstring. Every request's `cached_tokens` was checked against "
        f"the prefix it had to reuse: {s['cache_checks']}.",
        "",
        "Δ = logprob on the INT2 server − logprob on the BF16 server, same procedure, so only the KV cache "
        "differs. Top-1: BF16's token is INT2's argmax (bf16 logits tie; ties count as agreement). KL: "
        f"KL(BF16‖INT2) over BF16's top-{meta['top_k']} tokens plus a rest bucket (a lower bound of the full "
        "KL). First divergence: the first continuation position where INT2's top-1 differs from BF16's token, "
        "i.e. where INT2's own greedy output would first leave BF16's"
        + (" (per prompt; " if meta["block"] == 1 else " with the prompt served from the cache (per prompt; ")
        + "none = agrees on all "
        f"{n_cont}). INT2 read: how many cached positions of a scored token lie outside its sink and recent "
        "windows (at most that many are read from INT2: a position that left the recent window during the "
        "continuation keeps its BF16 copy until the side pool needs the entry)"
        + (" (step 0, the prefill, reads none)." if meta["block"] == 1 else "."),
        "",
        "| server | INT2 read | tokens | mean \\|Δ logprob\\| | mean Δ | max \\|Δ\\| | top-1 agreement "
        "| KL (top-k + rest) | first divergence per prompt |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    nf = s.get("bf16_noise_floor")
    if nf:
        lines.append(f"| BF16, teacher-forced vs its own decode (noise floor) | – | {nf['tokens']} | "
                     f"{nf['mean_abs_delta']:.4f} | {nf['mean_delta']:+.4f} | {nf['max_abs_delta']:.3f} | "
                     f"{nf['top1_agree']}/{nf['tokens']} | – | {fmt_first(nf['first_divergence'])} |")
    for key, r in s["long"].items():
        if "error" in r:
            lines.append(f"| {key} | | – | server error: {r['error'][:80]} | | | | | |")
            continue
        sink, recent = r["windows"]
        if meta["block"] == 1:
            lo, hi = n_prompt + 1 - sink - recent, n_prompt + n_cont - 1 - sink - recent
        else:
            lo, hi = n_prompt + meta["block"] - sink - recent, n_prompt + n_cont - sink - recent
        lines.append(f"| {key} | {max(lo, 0)}–{max(hi, 0)} | {r['tokens']} | {r['mean_abs_delta']:.4f} | "
                     f"{r['mean_delta']:+.4f} | {r['max_abs_delta']:.3f} | {r['top1_agree']}/{r['tokens']} "
                     f"({100 * r['top1_agree'] / r['tokens']:.1f}%) | {r.get('mean_kl_topk', float('nan')):.4f} | "
                     f"{fmt_first(r['first_divergence'])} |")
    lines += [
        "",
        "The noise-floor row compares BF16's teacher-forced logprobs with the logprobs its own greedy decode "
        "returned for the same tokens"
        + (" (one-token extends vs decode steps" if meta["block"] == 1
           else f" ({meta['block'] + 1}-token extends vs decode steps")
        + ": different code paths and GEMM shapes on CPU, and the difference compounds along the continuation)"
        + ". Every INT2 row is measured against BF16's teacher-forced logprobs; against BF16's decode "
        "logprobs the mean |Δ| is in the JSON (`mean_abs_delta_vs_bf16_decode`).",
        "",
        f"## Short factual prompts: greedy agreement (sink {sw[0]}, recent {sw[1]})",
        "",
        f"{len(data['short_prompts'])} prompts of {min(meta['short_prompt_tokens'])}-"
        f"{max(meta['short_prompt_tokens'])} tokens; each server decodes {meta['short_tokens']} greedy tokens "
        f"({'all prompts in one batch request, the same batch on every server' if meta['short_batched'] else 'one request at a time'}). "
        f"With sink {sw[0]} and recent {sw[1]}, every decode step reads positions {sw[0]} .. len-{sw[1]} of the "
        "prompt from INT2. Agreed prefix: tokens before the first difference from BF16.",
        "",
        f"| server | prompts whose first {meta['short_tokens']} tokens all match BF16 | tokens equal at the same "
        "position | mean agreed prefix | agreed prefix per prompt |",
        "|---|---:|---:|---:|---|",
    ]
    for key, r in s["short"].items():
        key = "BF16 (the reference)" if key == "BF16" else key
        if "error" in r:
            lines.append(f"| {key} | server error: {r['error'][:80]} | | | |")
            continue
        lines.append(f"| {key} | {r['all_agree']}/{r['prompts']} | {r['same_position_tokens']}/{r['total_tokens']} | "
                     f"{r['mean_agreed_prefix']:.1f} | {', '.join(map(str, r['agreed_prefix']))} |")
    if meta["short_batched"]:
        groups = {k: [int(x.split("#new-seq: ")[1].split(",")[0]) for x in v] for k, v in data["short_prefill"].items()}
        same = len({tuple(v) for v in groups.values()}) == 1
        lines += ["", "Prefill grouping of the batch request (from each server's log, `#new-seq` per prefill pass): "
                  + "; ".join(f"{k}: {v}" for k, v in groups.items())
                  + (" (the same on every server, so the decode batches match too)." if same else
                     " (NOT the same on every server: batch-shape noise enters the comparison).")]
    lines += ["", "BF16's answers (the reference):", ""]
    for p, ans in zip(data["short_prompts"], data["short_bf16_text"]):
        lines.append(f"* …{p['prompt'][-48:]!r} → {ans!r}")
    lines += ["", "## Servers", "", "| server | flags | startup line | seconds |", "|---|---|---|---:|"]
    for key, srv in data["servers"].items():
        lines.append(f"| {key} | `{' '.join(srv.get('flags', []))}` | {srv.get('startup_line', '') or '–'} | "
                     f"{srv.get('seconds', 0):.0f} |")
    lines += [
        "",
        "## Caveats",
        "",
        ("* Token by token, the one difference from decoding: the new token attends to its own K/V exactly, "
         "where a decode step reads back its BF16 hot copy (the rotated row rounded to bf16)."
         if meta["block"] == 1 else
         f"* Teacher forcing in blocks of {meta['block']}: the block's own tokens are attended exactly (decoding "
         "reads them as BF16 hot rows, the rotated rows rounded to bf16). `--block 1` removes that (token by "
         "token, as decoding) at more requests."),
        "* CPU numerics are batch-shape dependent (docs/SGLANG.md, Concurrency): the noise-floor row shows the "
        "size of that effect on the logprobs.",
        f"* {meta['long_prompts']} prompts x {n_cont} tokens is a few hundred scored tokens: enough to see "
        "large differences between methods, not to separate close ones; docs/ACCURACY.md has perplexity over "
        "many more tokens through the simulated cache.",
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    nf = s.get("bf16_noise_floor")
    if nf:
        axes[0].plot(nf["per_position_abs_delta"], color="grey", ls="--", label="BF16 noise floor")
    for key, r in s["long"].items():
        if "per_position_abs_delta" in r:
            axes[0].plot(r["per_position_abs_delta"], marker="o", ms=3, label=key)
        if "per_position_kl_topk" in r:
            axes[1].plot(r["per_position_kl_topk"], marker="o", ms=3, label=key)
    axes[0].set_ylabel("mean |Δ logprob| over prompts")
    axes[0].set_ylim(bottom=1e-3)
    axes[1].set_ylabel(f"mean KL(BF16‖INT2), top-{data['meta']['top_k']} + rest")
    for ax in axes:
        ax.set_xlabel("continuation position")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = data["meta"]
    fig.suptitle(f"{m['model_name']}: INT2 server vs BF16 server, {m['long_prompts']} prompts of "
                 f"{m['long_tokens']} tokens, teacher-forced BF16 greedy continuation", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main ---------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or name (default: SmolLM2-135M-Instruct; "
                   "qwen2.5-coder-0.5b: the second development model)")
    p.add_argument("--rotations", action="append", metavar="NAME=DIR",
                   help="a rotations directory to measure (repeatable); default: rotations/<model>-*/ "
                        "(calibrating oscar-center if there is none)")
    p.add_argument("--no-builtin", action="store_true", help="skip the identity and hadamard baselines")
    p.add_argument("--no-calibrate", action="store_true", help="never calibrate when no rotations are found")
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=1200)
    p.add_argument("--continuation", type=int, default=32, help="BF16 greedy tokens scored per long prompt")
    p.add_argument("--block", type=int, default=8, help="teacher-forced tokens per request (1: token by token, as decoding)")
    p.add_argument("--top-k", type=int, default=20, help="BF16 top-k tokens for the KL")
    p.add_argument("--long-windows", default="64,256", help="sink,recent of the long-prompt INT2 servers")
    p.add_argument("--short-windows", default="4,16", help="sink,recent of the short-prompt INT2 servers")
    p.add_argument("--short-tokens", type=int, default=8)
    p.add_argument("--short-sequential", action="store_true",
                   help="send the short prompts one at a time (default: one batch request, the same on every server)")
    p.add_argument("--long-small", action="store_true",
                   help="also score the long prompts with the short windows (one more long pass per method)")
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for SERVER_ACCURACY.md and server_accuracy.*")
    p.add_argument("--work", type=Path, default=None, help="folder for server logs and built artifacts (default: a temp dir)")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="only rewrite SERVER_ACCURACY.md and the plot in --out from an earlier server_accuracy.json")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(args.render.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        data["meta"]["plot"] = plot(data, args.out / "server_accuracy.png")
        (args.out / "SERVER_ACCURACY.md").write_text(markdown(data))
        log(f"rewrote {args.out}/SERVER_ACCURACY.md from {args.render}")
        return 0
    t_start = time.time()

    import sglang
    import torch
    from transformers import AutoTokenizer

    from oscar_sglang import assets, configs
    from oscar_sglang.calibration import model as model_io

    model_dir = model_io.resolve(args.model).resolve()
    work = args.work or Path(tempfile.mkdtemp(prefix="server_accuracy_"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"model {model_dir}; logs and artifacts in {work}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    longs = long_prompts(tok, args.long_prompts, args.long_tokens)
    shorts = short_prompts(tok)
    methods = build_methods(args, model_dir, work)
    log(f"methods: {', '.join(f'{k} ({v})' for k, v in methods.items())}")
    lw = tuple(int(x) for x in args.long_windows.split(","))
    sw = tuple(int(x) for x in args.short_windows.split(","))
    cal_names, eval_names = configs.text_split()

    servers, long_res, short_res = {}, {}, {}

    def run_server(key: str, flags: list[str], body) -> None:
        log(f"{key}: starting ({' '.join(flags) or 'BF16'})")
        log_path = work / f"server_{key.replace(' ', '_').replace(',', '_')}.log"
        t0 = time.time()
        srv = servers[key] = {"flags": flags, "log": str(log_path)}
        try:
            with server(model_dir, log_path, flags, args.max_total_tokens) as url:
                body(url, log_path)
        except (launcher.ServerError, OSError, RuntimeError, KeyError, ValueError) as e:
            srv["error"] = f"{type(e).__name__}: {e}"
            log(f"{key}: FAILED: {srv['error'][-2000:]}")
        srv["seconds"] = round(time.time() - t0, 1)
        lines = log_lines(log_path, 0, "oscar-int2 KV cache:") if log_path.exists() else []
        srv["startup_line"] = lines[0] if lines else ""
        log(f"{key}: done in {srv['seconds']:.0f} s")

    # 1. BF16 reference.
    bf16 = {}

    def bf16_body(url, log_path):
        # Per prompt: the greedy continuation, then the teacher-forced pass (each flushes the cache first).
        bf16["conts"], bf16["tf"], bf16["checks"] = [], [], []
        for i, prompt in enumerate(longs):
            cont = bf16_continuations(url, [prompt], args.continuation)[0]
            rows, checks = teacher_forced(url, [prompt], [cont["ids"]], args.block, True, args.top_k, None,
                                          first_index=i, total=len(longs))
            bf16["conts"].append(cont)
            bf16["tf"] += rows
            bf16["checks"] += checks
        bf16["short"] = greedy_short(url, shorts, args.short_tokens, not args.short_sequential, log_path)

    run_server("BF16", [], bf16_body)
    if "error" in servers["BF16"]:
        raise SystemExit("the BF16 server failed; nothing to compare against")
    conts = [c["ids"] for c in bf16["conts"]]
    decode_lps = [c["decode_logprobs"] for c in bf16["conts"]]
    all_checks = [dict(c, server="BF16") for c in bf16["checks"]]
    noise = summarize_long(bf16["tf"], [[{"logprob": d} for d in dp] for dp in decode_lps], decode_lps)

    # 2./3. INT2 servers.
    for name, path in methods.items():
        for windows, do_long, do_short in ((lw, True, False), (sw, args.long_small, True)):
            if not (do_long or do_short):
                continue
            key = f"{name} (sink {windows[0]}, recent {windows[1]})"
            flags = ["--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(path),
                     "--oscar-sink", str(windows[0]), "--oscar-recent", str(windows[1])]

            def body(url, log_path, key=key, do_long=do_long, do_short=do_short):
                if do_long:
                    rows, checks = teacher_forced(url, longs, conts, args.block, False, args.top_k, bf16["tf"])
                    all_checks.extend(dict(c, server=key) for c in checks)
                    long_res[key] = summarize_long(rows, bf16["tf"], decode_lps)
                    long_res[key]["windows"] = windows
                    long_res[key]["checks_ok"] = all(c["cached_tokens"] == c["expected"] for c in checks)
                    r = long_res[key]
                    log(f"  {key}: mean |Δ| {r['mean_abs_delta']:.4f}, top-1 {r['top1_agree']}/{r['tokens']}, "
                        f"KL {r.get('mean_kl_topk', float('nan')):.4f}, first divergence {r['first_divergence']}")
                if do_short:
                    res = greedy_short(url, shorts, args.short_tokens, not args.short_sequential, log_path)
                    short_res[key] = {**summarize_short(res["ids"], bf16["short"]["ids"], args.short_tokens),
                                      "ids": res["ids"], "prefill_batches": res["prefill_batches"]}
                    r = short_res[key]
                    log(f"  {key}: short prompts all-agree {r['all_agree']}/{r['prompts']}, "
                        f"tokens {r['same_position_tokens']}/{r['total_tokens']}")

            run_server(key, flags, body)
            if "error" in servers[key]:
                if do_long and key not in long_res:
                    long_res[key] = {"error": servers[key]["error"]}
                if do_short and key not in short_res:
                    short_res[key] = {"error": servers[key]["error"]}

    # Report.
    bad = [c for c in all_checks if c["cached_tokens"] != c["expected"]]
    n_checks = len(all_checks)
    cache_summary = (f"all {n_checks} requests as expected" if not bad else
                     f"{len(bad)} of {n_checks} requests differ: " + "; ".join(
                         f"{c['server']} prompt {c['prompt']} {c['request']}: {c['cached_tokens']} "
                         f"(expected {c['expected']})" for c in bad[:6]))
    block_cached = sorted({c["cached_tokens"] for c in all_checks if c["request"] != "prompt"})
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python scripts/report_server_logprobs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.time() - t_start, 1),
        "device": "CPU" if not launcher.cuda_visible() else torch.cuda.get_device_name(),
        "sglang": sglang.__version__,
        "model": str(model_dir), "model_name": model_dir.name,
        "calibration_texts": cal_names, "evaluation_texts": eval_names,
        "method_calibration": method_calibration(methods),
        "methods": {k: str(v) for k, v in methods.items()},
        "long_prompts": len(longs), "long_tokens": args.long_tokens, "continuation": args.continuation,
        "long_prompt_sources": [f"{q['text']} from {q['offset']:.0%}" for q in longs],
        "block": args.block, "top_k": args.top_k, "long_windows": lw, "short_windows": sw,
        "short_tokens": args.short_tokens, "short_batched": not args.short_sequential,
        "short_prompt_tokens": [len(q["ids"]) for q in shorts],
        "prompt_hash": hashlib.sha256(json.dumps([q["ids"] for q in longs]).encode()).hexdigest()[:16],
        "block_request_cached_tokens": block_cached,
        "bf16_short_prefill_batches": bf16["short"]["prefill_batches"],
    }
    data = {
        "meta": meta,
        "summary": {"bf16_noise_floor": noise, "long": long_res,
                    "short": {"BF16": summarize_short(bf16["short"]["ids"], bf16["short"]["ids"], args.short_tokens),
                              **short_res},
                    "cache_checks": cache_summary},
        "servers": servers,
        "long_prompts": [{k: v for k, v in q.items() if k != "ids"} | {"tokens": len(q["ids"])} for q in longs],
        "bf16_continuations": [{"ids": c["ids"], "text": tok.decode(c["ids"]), "decode_logprobs": c["decode_logprobs"]}
                               for c in bf16["conts"]],
        "short_prompts": [{"prompt": q["prompt"], "tokens": len(q["ids"])} for q in shorts],
        "short_bf16_text": [tok.decode(ids) for ids in bf16["short"]["ids"]],
        "short_text": {k: [tok.decode(ids) for ids in r["ids"]] for k, r in short_res.items() if "ids" in r},
        "short_prefill": {"BF16": bf16["short"]["prefill_batches"],
                          **{k: r["prefill_batches"] for k, r in short_res.items() if "prefill_batches" in r}},
        "cache_check_list": all_checks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    meta["plot"] = plot(data, args.out / "server_accuracy.png")
    (args.out / "server_accuracy.json").write_text(json.dumps(data, indent=1) + "\n")
    md = markdown(data)
    (args.out / "SERVER_ACCURACY.md").write_text(md)
    print(md)
    log(f"wrote {args.out}/SERVER_ACCURACY.md, server_accuracy.json"
        + (", server_accuracy.png" if meta["plot"] else "") + f" in {meta['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
