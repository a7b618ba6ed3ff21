"""``oscar-eval``: calibrate every method on one text, evaluate all on another, in one run.

    oscar-eval --out docs/                       # defaults: the embedded model, mix calibration, Shakespeare evaluation
    oscar-eval --cross-domain --out docs/        # calibrate on each domain and the mix, evaluate on every domain

Statistics are captured once on the calibration text (``--data``); each
method is fitted from them.  Then, on the evaluation text (``--eval-data``),
through the simulated INT2 cache:

* per-layer attention-output error after ``W_O`` (decode reads, isolated per layer);
* teacher-forced perplexity of decoding at each ``--ppl-contexts`` length
  (all tokens, and the *tail*: positions past sink + recent, where INT2 reads begin);
* needle-in-a-haystack pass-key retrieval, greedy generation with prefill
  exact and decode reading the cache (``--niah-lengths`` x ``--niah-depths``).

``--policy-bits 2.75,3`` adds, for each budget ``B``, the precision policy
(``oscar-calibrate --bits B``) on top of ``--policy-base`` (default optr) as a
method named ``BASE@B``: per layer and K/V the row formats chosen on the
calibration text, evaluated like every other method.

Writes ``accuracy.json``, ``accuracy_table.md``, ``accuracy_layers.png``,
``accuracy_niah.png`` into ``--out`` and prints the table.

``--cross-domain`` instead fits the calibrated methods on each of
``--cross-cal`` (default ``shakespeare,code,mix``) and measures every method's
teacher-forced tail perplexity on the evaluation part of every domain
(``--cross-eval``, default all of them) at each BF16 window setting
(``--windows``, default ``64:256,4:32``); it writes
``accuracy_cross_domain.{json,md}`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from oscar_sglang import artifacts as art

from . import capture, data, diagnostics, evaluate, report
from . import model as model_io
from .cli_args import check_out_dir, count, counts
from .calibrate import (METHODS, CalibrationConfig, apply_policy, check_budget, check_model, collect_statistics, fit,
                        policy_costs, policy_inputs)
from .optr import OptRConfig

KEY_SCALED = "+ks"  # method suffix: the same method with per-channel key scaling (key_scale.py)
SCALABLE = tuple(m for m in METHODS if m not in ("identity", "hadamard"))
EVAL_METHODS = ("bf16",) + METHODS + tuple(m + KEY_SCALED for m in SCALABLE)
DEFAULT_METHODS = "bf16,identity,hadamard,hadamard-clip,hadamard-center,oscar,oscar-center,optr"
CROSS_METHODS = "bf16,identity,hadamard,hadamard-center,oscar-center,optr"
CROSS_CAL = "shakespeare,code,mix"
UNCALIBRATED = ("bf16", "identity", "hadamard")  # nothing is fitted: evaluated once, not per calibration text


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


SYMMETRIC = "sym"  # --policy-bits suffix: the policy may also choose symmetric rows (oscar-calibrate --symmetric-rows)


def _budgets(s: str) -> list[tuple[float, bool]]:
    """``2.5,2.5sym,3`` -> ``[(2.5, False), (2.5, True), (3.0, False)]``."""
    out = []
    for x in s.split(","):
        if x:
            sym = x.endswith(SYMMETRIC)
            try:
                bits = float(x.removesuffix(SYMMETRIC))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected bits per element, e.g. 2.75 or 2.75{SYMMETRIC}, "
                                                 f"got {x!r}") from None
            if not 0 < bits <= 16:
                raise argparse.ArgumentTypeError(f"bits per element must lie in (0, 16], got {bits:g}")
            out.append((bits, sym))
    return out


def _budget_name(base: str, bits: float, sym: bool) -> str:
    return f"{base}@{bits:g}" + (SYMMETRIC if sym else "")


def _named_dirs(s: str) -> dict[str, Path]:
    out = {}
    for item in s.split(","):
        if item:
            name, sep, d = item.partition("=")
            if not sep or not name or not d:
                raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {item!r}")
            out[name] = Path(d)
    return out


def _windows(s: str) -> list[tuple[int, int]]:
    out = []
    for w in s.split(","):
        if w:
            sink, sep, recent = w.partition(":")
            if not sep:
                raise argparse.ArgumentTypeError(f"expected SINK:RECENT, got {w!r}")
            out.append((count(0)(sink), count(0)(recent)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oscar-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model folder, GGUF file, model hub id OWNER/NAME, or a name: "
                   "default (SmolLM2-135M), qwen2.5-coder-0.5b")
    p.add_argument("--methods", default=None, help=f"comma list of {', '.join(EVAL_METHODS)} "
                   f"(default {DEFAULT_METHODS}; with --cross-domain {CROSS_METHODS})")
    p.add_argument("--data", default="mix", help="calibration text, as oscar-calibrate (default mix: an equal-token "
                   f"mix of the calibration parts of all domains; one of {', '.join(data.data_specs())}, "
                   "a .txt file or folder, ...)")
    p.add_argument("--eval-data", default="shakespeare-eval", help="evaluation text (never the calibration text)")
    p.add_argument("--tokens", type=count(1), default=20000, help="calibration tokens")
    p.add_argument("--seq-len", type=count(1), default=1024)
    p.add_argument("--sink", type=count(0), default=art.DEFAULT_SINK)
    p.add_argument("--recent", type=count(0), default=art.DEFAULT_RECENT)
    p.add_argument("--group", type=count(1), default=None)
    p.add_argument("--ppl-contexts", type=counts(1), default=[1024, 2048])
    p.add_argument("--ppl-seqs", type=count(1), default=2, help="evaluation sequences per context length (and domain)")
    p.add_argument("--niah-lengths", type=counts(1), default=[512, 1024, 2048])
    p.add_argument("--niah-depths", type=_floats, default=[0.1, 0.5, 0.9])
    p.add_argument("--niah-trials", type=count(1), default=2)
    p.add_argument("--cross-domain", action="store_true",
                   help="calibrate on each --cross-cal text, evaluate tail perplexity on each --cross-eval text")
    p.add_argument("--cross-cal", default=CROSS_CAL, help=f"calibration texts for --cross-domain ({CROSS_CAL})")
    p.add_argument("--cross-eval", default=None,
                   help="evaluation texts for --cross-domain (default: DOMAIN-eval of every domain)")
    p.add_argument("--windows", type=_windows, default=[(art.DEFAULT_SINK, art.DEFAULT_RECENT), (4, 32)],
                   help="BF16 window settings SINK:RECENT,... for --cross-domain (default 64:256,4:32)")
    p.add_argument("--policy-bits", type=_budgets, default=[],
                   help="precision-policy budgets (average bits per element) to evaluate, e.g. 2.75,3; a budget "
                        f"ending in '{SYMMETRIC}' (2.5{SYMMETRIC}) also offers symmetric rows (oscar-calibrate "
                        "--symmetric-rows)")
    p.add_argument("--policy-base", default="optr", choices=METHODS[1:] + tuple(m + KEY_SCALED for m in SCALABLE),
                   help="calibrated method the policy starts from (default optr)")
    p.add_argument("--policy-seq-len", type=count(1), default=None,
                   help="tokens per sequence the policy measures its options on (oscar-calibrate --policy-seq-len; "
                        "default --seq-len)")
    p.add_argument("--policy-copy-len", type=count(1), default=None,
                   help="the policy also measures on a copy task of sequences of this length (oscar-calibrate "
                        "--policy-copy-len)")
    p.add_argument("--artifacts", type=_named_dirs, default={},
                   help="NAME=DIR,...: also evaluate these saved rotations directories (e.g. from --save-artifacts) "
                        "as methods NAME, served at --sink/--recent, without calibrating them again")
    p.add_argument("--save-artifacts", type=Path, default=None, help="also write each method's rotations here")
    p.add_argument("--no-diagnostics", action="store_true",
                   help="skip diagnostics.{md,json,png} (per layer and KV head: what makes keys/values hard, "
                        "the INT2 error after each calibrated method)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=count(1), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default="auto", choices=("auto", *model_io.DTYPES),
                   help="model dtype (default auto: bfloat16 on a GPU or a CPU with native bf16, else float32)")
    p.add_argument("--quiet", action="store_true")
    return p


def _policy_stats(args, lm, tok, texts, stats, cfg, progress):
    """The statistics the policy measures on (the calibration's, or ``--policy-seq-len`` sequences of ``texts``),
    plus the ``--policy-copy-len`` copy task; and the fixed query positions per kept sample (or None)."""
    if not args.policy_bits:
        return stats, None
    seqs = {n: None if length is None else data.sequences_from_texts(tok, texts, length, length * cfg.keep_sequences)
            for n, length in (("policy", args.policy_seq_len), ("copy", args.policy_copy_len))}
    return policy_inputs(lm, stats, cfg, seqs["policy"], seqs["copy"], progress)


def _policy_budgets(args, lm, pstats, fitted, cfg, progress, fixed):
    """Yield ``(name, artifact, seconds)`` for each ``--policy-bits`` budget applied to ``fitted[--policy-base]``
    (looked up only when there is a budget: without one the base need not have been fitted).
    Budgets with the same symmetric-rows flag share one measurement of the options' costs; ``cfg`` is left as it
    was found (no budget, stored zeros)."""
    costs = {}
    try:
        for b, sym in args.policy_bits:
            t = time.time()
            cfg.bits, cfg.symmetric_rows = b, sym
            base = fitted[args.policy_base]
            if sym not in costs:
                costs[sym] = policy_costs(lm, pstats, base, cfg, progress, fixed)
            a = apply_policy(lm, pstats, base, cfg, progress, fixed, costs[sym])
            yield _budget_name(args.policy_base, b, sym), a, round(time.time() - t, 1)
    finally:
        cfg.bits, cfg.symmetric_rows = None, False


def _error(msg: str) -> int:
    print(f"oscar-eval: error: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in (args.methods or (CROSS_METHODS if args.cross_domain else DEFAULT_METHODS)).split(",") if m]
    bad = [m for m in methods if m not in EVAL_METHODS]
    if bad:
        return _error(f"unknown method(s) {bad}; choose from {', '.join(EVAL_METHODS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        check_out_dir(args.out)
        if args.save_artifacts is not None:
            check_out_dir(args.save_artifacts, "--save-artifacts")
        if args.cross_domain:
            return cross_domain(args, methods, argv)
        return single(args, methods, argv)
    except (OSError, ValueError) as e:
        return _error(str(e))


def _load_model(args):
    device = model_io.resolve_device("auto")
    dtype = model_io.resolve_dtype(args.dtype, device)
    lm, tok, path = model_io.load(args.model, dtype=dtype, device=device)
    return lm, tok, path, str(dtype).removeprefix("torch.")


def _check_budgets(args, lm) -> None:
    """Refuse a ``--policy-bits`` budget below the cheapest format for ``lm`` before anything is measured."""
    for bits, sym in args.policy_bits:
        check_budget(lm, CalibrationConfig(group_size=args.group, bits=bits, symmetric_rows=sym))


def _configure(cfg: CalibrationConfig, method: str) -> None:
    """``optr+ks`` fits ``optr`` with key channel scaling; other names fit as they are."""
    cfg.method = method.removesuffix(KEY_SCALED)
    cfg.key_scaling = method.endswith(KEY_SCALED)


def _command(argv) -> str:
    return "oscar-eval " + " ".join(argv if argv is not None else sys.argv[1:])


def single(args, methods, argv) -> int:
    if args.data == args.eval_data:
        return _error("--data and --eval-data must differ (calibrate and evaluate on different text)")
    t0 = time.time()
    progress = not args.quiet
    cal_texts = data.load_texts(args.data)
    eval_texts = data.load_texts(args.eval_data)
    overlap = set(cal_texts) & set(eval_texts)
    if overlap:
        return _error(f"texts in both calibration and evaluation data: {sorted(overlap)}")
    lm, tok, path, dtype = _load_model(args)
    check_model(lm)
    _check_budgets(args, lm)

    cfg = CalibrationConfig(method="optr", sink=args.sink, recent=args.recent, group_size=args.group,
                            seed=args.seed, optr=OptRConfig())
    fitted: dict[str, art.RotationArtifacts] = {}
    timings: dict[str, float] = {}
    calib_methods = [m for m in methods if m != "bf16"]
    if args.policy_bits and args.policy_base not in calib_methods:
        calib_methods.append(args.policy_base)
    stats = None
    cal_seqs = data.sequences_from_texts(tok, cal_texts, args.seq_len, args.tokens)
    summary = {"data": {"spec": args.data, "texts": list(cal_texts)}, "tokens": sum(s.numel() for s in cal_seqs),
               "seed": args.seed}
    if args.policy_bits or any(m not in ("identity", "hadamard") for m in calib_methods):
        t = time.time()
        stats = collect_statistics(lm, cal_seqs, cfg, progress)
        timings["statistics"] = round(time.time() - t, 1)
    for m in calib_methods:
        t = time.time()
        _configure(cfg, m)
        fitted[m], _ = fit(lm, stats, cfg, dict(summary), progress)
        timings[m] = round(time.time() - t, 1)
        if args.save_artifacts:
            art.save(fitted[m], args.save_artifacts / m)
    fp = art.ModelFingerprint.from_config(lm.config)
    for name, d in args.artifacts.items():
        loaded = art.load(d, expect=fp)
        fitted[name] = dataclasses.replace(loaded, sink=args.sink, recent=args.recent)
        methods.append(name)
    pstats, fixed = _policy_stats(args, lm, tok, cal_texts, stats, cfg, progress)
    for name, a, seconds in _policy_budgets(args, lm, pstats, fitted, cfg, progress, fixed):
        fitted[name], timings[name] = a, seconds
        methods.append(name)
        if args.save_artifacts:
            art.save(fitted[name], args.save_artifacts / name)
    del stats, pstats

    eval_name = next(iter(eval_texts))
    ppl_seqs = {c: data.sequences_from_texts(tok, eval_texts, c, c * args.ppl_seqs) for c in args.ppl_contexts}
    err_seqs = data.sequences_from_texts(tok, eval_texts, args.seq_len, args.seq_len)
    haystack = eval_texts[eval_name]
    results: dict[str, dict] = {}
    for m in tqdm(methods, desc="evaluate", unit="method", disable=not progress):
        a = fitted.get(m)
        t = time.time()
        r = {"ppl": {str(c): evaluate.perplexity(lm, s, a) if a is not None else
                     evaluate.perplexity(lm, s, None, tail_from=args.sink + args.recent)
                     for c, s in ppl_seqs.items()}}
        r["layer_errors"] = evaluate.layer_errors(lm, err_seqs, a) if a is not None else None
        r["niah"] = evaluate.niah(lm, tok, haystack, a, args.niah_lengths, args.niah_depths,
                                  trials=args.niah_trials, seed=args.seed)
        r["seconds"] = round(time.time() - t, 1)
        if a is not None:
            r["clips"] = {"k_mean": float(torch.stack([l.k_clip for l in a.layers]).mean()),
                          "v_mean": float(torch.stack([l.v_clip for l in a.layers]).mean())}
            r.update(_decisions(a))
            r["bits_per_element"] = round(a.bits_per_element, 4)
            r["formats"] = a.policy_summary()
        results[m] = r
        _checkpoint(args.out, "accuracy.partial.json", results)

    meta = {
        "date": datetime.date.today().isoformat(),
        "command": _command(argv),
        "model": str(path), "dtype": dtype, "fingerprint": fp.__dict__,
        "calibration": {"spec": args.data, "texts": list(cal_texts), "tokens": summary["tokens"],
                        "seq_len": args.seq_len},
        "evaluation": {"spec": args.eval_data, "texts": list(eval_texts), "niah_haystack": eval_name},
        "sink": args.sink, "recent": args.recent, "group": args.group or fp.head_dim,
        "fit_seconds": timings, "total_seconds": round(time.time() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (args.out / "accuracy.partial.json").unlink(missing_ok=True)
    table = report.accuracy_table(results)
    (args.out / "accuracy_table.md").write_text(table + "\n\n" + report.MARGIN_LEGEND + "\n")
    title = (f"{Path(meta['model']).name}: calibrated on {args.data} ({summary['tokens']} tok), "
             f"evaluated on {eval_name}; sink {args.sink}, recent {args.recent}")
    report.plot_layer_errors(results, args.out / "accuracy_layers.png", title)
    report.plot_niah(results, args.out / "accuracy_niah.png", "pass-key retrieval: " + title)
    print(table)
    written = "accuracy.{json,_table.md,_layers.png,_niah.png}"
    if report.plot_margins(results, args.out / "accuracy_margins.png", "pass-key margins: " + title):
        written += ", accuracy_margins.png"
    if not args.no_diagnostics and fitted:
        # per (layer, KV head) of the evaluation text: shape statistics and each method's INT2 round-trip error
        rows = diagnostics.diagnose(capture.capture_kv(lm, err_seqs), fitted)
        diagnostics.write_report(rows, args.out, f"{Path(meta['model']).name}: {err_seqs[0].numel()} tokens of "
                                 f"{eval_name}, each method calibrated on {args.data}", meta["command"], meta["date"],
                                 {"model": meta["model"], "calibration": meta["calibration"],
                                  "evaluation": meta["evaluation"]})
        written += ", diagnostics.{md,json,png}"
    print(f"\nwrote {args.out}/{written} in {round(time.time() - t0, 1)} s")
    return 0


def _checkpoint(out: Path, name: str, results) -> None:
    """Results so far, rewritten after every method: a long run that fails late loses nothing measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({"partial": True, "results": results}, indent=1) + "\n")


def _decisions(a: art.RotationArtifacts) -> dict:
    """Counts of the held-out decisions recorded in an artifact's calibration report."""
    layers = a.calibration.get("layers", [])
    out = {}
    if layers and "k_kept" in layers[0]:
        out["optr_kept"] = {"k": sum(sum(x["k_kept"]) for x in layers), "v": sum(sum(x["v_kept"]) for x in layers),
                            "heads": sum(len(x["k_kept"]) for x in layers)}
    kept = {key: sum(sum(x[key]) for x in layers) for key in ("k_oscar", "v_oscar", "k_clip_kept", "v_clip_kept",
                                                              "k_scale_kept")
            if layers and key in layers[0]}
    if kept:
        out["heldout_kept"] = {**kept, "heads": sum(len(x["k_clip"]) for x in layers)}
    measured_on = a.calibration.get("policy", {}).get("measured_on")
    if measured_on:
        out["policy_measured_on"] = measured_on
    return out


# --- cross-domain ----------------------------------------------------------------------------------

def cross_domain(args, methods, argv) -> int:
    """Calibrate on each ``--cross-cal`` text, evaluate tail perplexity on each ``--cross-eval`` text and window."""
    t0 = time.time()
    progress = not args.quiet
    cal_specs = [x for x in args.cross_cal.split(",") if x]
    eval_specs = [x for x in (args.cross_eval or ",".join(f"{d}-eval" for d in data.domain_names())).split(",") if x]
    if not cal_specs or not eval_specs or not args.windows:
        return _error("--cross-domain needs at least one --cross-cal text, one --cross-eval text and one window")
    cal_texts = {c: data.load_texts(c) for c in cal_specs}
    eval_texts = {e: data.load_texts(e) for e in eval_specs}
    for c, ct in cal_texts.items():
        for e, et in eval_texts.items():
            overlap = set(ct) & set(et)
            if overlap:
                return _error(f"texts in both calibration data {c} and evaluation data {e}: {sorted(overlap)}")
    ctx = args.ppl_contexts[0]
    for sink, recent in args.windows:
        if sink + recent >= ctx:
            return _error(f"window {sink}:{recent} covers the whole {ctx}-token context: nothing would read INT2")
    lm, tok, path, dtype = _load_model(args)
    check_model(lm)
    _check_budgets(args, lm)
    xfp = art.ModelFingerprint.from_config(lm.config)
    eval_seqs = {e: data.sequences_from_texts(tok, t, ctx, ctx * args.ppl_seqs) for e, t in eval_texts.items()}

    def measure(a):
        out = {}
        for e, seqs in eval_seqs.items():
            for sink, recent in args.windows:
                r = evaluate.perplexity(lm, seqs, a, sink=sink if a is not None else None,
                                        recent=recent if a is not None else None, tail_from=sink + recent)
                out.setdefault(e, {})[f"{sink}:{recent}"] = r
        return out

    results: list[dict] = []
    for m in tqdm([m for m in methods if m in UNCALIBRATED], desc="evaluate references", disable=not progress):
        a = None if m == "bf16" else art.BUILDERS[m](art.ModelFingerprint.from_config(lm.config))
        t = time.time()
        results.append({"method": m, "calibration": None, "ppl": measure(a), "seconds": round(time.time() - t, 1),
                        "bits_per_element": 16.0 if a is None else round(a.bits_per_element, 4)})
        _checkpoint(args.out, "accuracy_cross_domain.partial.json", results)
    calibrations = {}
    calibrated = [m for m in methods if m not in UNCALIBRATED]
    if args.policy_bits and args.policy_base not in calibrated:
        calibrated.append(args.policy_base)  # fitted for the policy; evaluated too, as the policy's base
    for c in cal_specs:
        cfg = CalibrationConfig(method="optr", sink=args.sink, recent=args.recent, group_size=args.group,
                                seed=args.seed, optr=OptRConfig())
        seqs = data.sequences_from_texts(tok, cal_texts[c], args.seq_len, args.tokens)
        t = time.time()
        stats = collect_statistics(lm, seqs, cfg, progress) if calibrated else None
        calibrations[c] = {"texts": list(cal_texts[c]), "tokens": int(sum(s.numel() for s in seqs)),
                           "sequences_per_domain": {g: seqs.groups.count(g) for g in dict.fromkeys(seqs.groups)},
                           "heldout_groups": stats.names if stats else [],
                           "statistics_seconds": round(time.time() - t, 1)}
        summary = {"data": {"spec": c, "texts": list(cal_texts[c])}, "tokens": calibrations[c]["tokens"],
                   "seed": args.seed}
        fitted = {}
        for m in calibrated:
            t = time.time()
            _configure(cfg, m)
            fitted[m], _ = fit(lm, stats, cfg, dict(summary), progress)
            fit_s = round(time.time() - t, 1)
            results.append(_cross_result(args, c, m, fitted[m], fit_s, measure))
            _checkpoint(args.out, "accuracy_cross_domain.partial.json", results)
        pstats, fixed = _policy_stats(args, lm, tok, cal_texts[c], stats, cfg, progress)
        for name, a, seconds in _policy_budgets(args, lm, pstats, fitted, cfg, progress, fixed):
            results.append(_cross_result(args, c, name, a, seconds, measure))
            _checkpoint(args.out, "accuracy_cross_domain.partial.json", results)
        del stats, pstats, fitted

    meta = {
        "date": datetime.date.today().isoformat(),
        "command": _command(argv),
        "model": str(path), "dtype": dtype, "fingerprint": xfp.__dict__,
        "calibration": calibrations, "calibration_seq_len": args.seq_len,
        "calibration_sink_recent": [args.sink, args.recent],
        "evaluation": {e: {"texts": list(t), "sequences": len(eval_seqs[e]), "context": ctx,
                           "provenance": getattr(t, "provenance", {})} for e, t in eval_texts.items()},
        "windows": [f"{s}:{r}" for s, r in args.windows],
        "metric": "teacher-forced perplexity over the tail: predicted positions >= sink + recent (INT2 reads begin)",
        "group": args.group or xfp.head_dim,
        "total_seconds": round(time.time() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy_cross_domain.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (args.out / "accuracy_cross_domain.partial.json").unlink(missing_ok=True)
    table = cross_domain_table(results, eval_specs, meta["windows"])
    (args.out / "accuracy_cross_domain.md").write_text(_cross_domain_doc(meta, table))
    print(table)
    print(f"\nwrote {args.out}/accuracy_cross_domain.{{json,md}} in {meta['total_seconds']} s")
    return 0


def _cross_result(args, cal: str, name: str, a: art.RotationArtifacts, fit_s: float, measure) -> dict:
    if args.save_artifacts:
        art.save(a, args.save_artifacts / f"{cal.replace(':', '_')}-{name}")
    t = time.time()
    return {"method": name, "calibration": cal, "ppl": measure(a), "fit_seconds": fit_s,
            "seconds": round(time.time() - t, 1), "bits_per_element": round(a.bits_per_element, 4),
            "formats": a.policy_summary(), **_decisions(a)}


def cross_domain_table(results: list[dict], eval_specs: list[str], windows: list[str]) -> str:
    """Tail perplexity per method and calibration text (rows) and evaluation text (columns), one table per window;
    in brackets the change against the exact cache (``bf16``), then a comparison with ``hadamard-center``."""
    ref = next((r for r in results if r["method"] == "bf16"), None)
    blocks = []
    for w in windows:
        sink, recent = w.split(":")
        lines = [f"**sink {sink} / recent {recent}** (tail: positions >= {int(sink) + int(recent)})", "",
                 "| method | bits/elt | calibrated on | " + " | ".join(eval_specs) + " |",
                 "|---|---:|---|" + "---:|" * len(eval_specs)]
        for r in results:
            cells = []
            for e in eval_specs:
                v = r["ppl"][e][w]["ppl_tail"]
                if ref is None or r is ref:
                    cells.append(f"{v:.2f}")
                else:
                    cells.append(f"{v:.2f} ({100 * (v / ref['ppl'][e][w]['ppl_tail'] - 1):+.1f} %)")
            bits = f"{r['bits_per_element']:.2f}" if "bits_per_element" in r else "–"
            lines.append(f"| {r['method']} | {bits} | {r['calibration'] or '–'} | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    verdict = ["", "Against `hadamard-center` calibrated on the same text (tail perplexity, every evaluation "
               "text and window; `≤` means at least as good):", ""]
    for r in results:
        if r["method"] in ("oscar-center", "optr") and r["calibration"]:
            base = next((b for b in results if b["method"] == "hadamard-center" and
                         b["calibration"] == r["calibration"]), None)
            if base is None:
                continue
            worse = [f"{e} {w} ({r['ppl'][e][w]['ppl_tail']:.2f} vs {base['ppl'][e][w]['ppl_tail']:.2f})"
                     for e in eval_specs for w in windows
                     if r["ppl"][e][w]["ppl_tail"] > base["ppl"][e][w]["ppl_tail"]]
            n = len(eval_specs) * len(windows)
            verdict.append(f"- {r['method']} (calibrated on {r['calibration']}): ≤ on {n - len(worse)} of {n}"
                           + (f"; worse on {', '.join(worse)}" if worse else ""))
    return "\n\n".join(blocks) + "\n" + "\n".join(verdict)


def _cross_domain_doc(meta: dict, table: str) -> str:
    cal = "\n".join(f"- `{c}`: {v['tokens']} tokens ({', '.join(f'{g} {n}' for g, n in v['sequences_per_domain'].items())}"
                    f" sequences of {meta['calibration_seq_len']}); texts: {', '.join(v['texts'])}"
                    for c, v in meta["calibration"].items())
    ev = "\n".join(f"- `{e}`: {v['sequences']} sequences of {v['context']} tokens; texts: {', '.join(v['texts'])}"
                   for e, v in meta["evaluation"].items())
    return (f"# Cross-domain accuracy ({meta['date']})\n\n"
            f"```\n{meta['command']}\n```\n\n"
            f"Model: {Path(meta['model']).name} in {meta['dtype']}; {meta['total_seconds']:.0f} s in all. "
            f"Metric: {meta['metric']}. Calibration assumes sink {meta['calibration_sink_recent'][0]} / recent "
            f"{meta['calibration_sink_recent'][1]}; the evaluation windows are those of each table.\n\n"
            f"Calibration texts:\n\n{cal}\n\nEvaluation texts (never calibrated on):\n\n{ev}\n\n{table}\n")


if __name__ == "__main__":
    raise SystemExit(main())
