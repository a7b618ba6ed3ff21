"""``oscar-eval``: calibrate every method on one text, evaluate all on another, in one run.

    oscar-eval --out docs/                       # defaults: the embedded model, Shakespeare splits

Statistics are captured once on the calibration text (``--data``); each
method is fitted from them.  Then, on the evaluation text (``--eval-data``),
through the simulated INT2 cache:

* per-layer attention-output error after ``W_O`` (decode reads, isolated per layer);
* teacher-forced perplexity of decoding at each ``--ppl-contexts`` length
  (all tokens, and the *tail*: positions past sink + recent, where INT2 reads begin);
* needle-in-a-haystack pass-key retrieval, greedy generation with prefill
  exact and decode reading the cache (``--niah-lengths`` x ``--niah-depths``).

Writes ``accuracy.json``, ``accuracy_table.md``, ``accuracy_layers.png``,
``accuracy_niah.png`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from oscar_sglang import artifacts as art

from . import data, evaluate, report
from . import model as model_io
from .calibrate import METHODS, CalibrationConfig, collect_statistics, fit
from .optr import OptRConfig

EVAL_METHODS = ("bf16",) + METHODS
DEFAULT_METHODS = "bf16,identity,hadamard,hadamard-clip,hadamard-center,oscar,oscar-center,optr"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oscar-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of {', '.join(EVAL_METHODS)}")
    p.add_argument("--data", default="shakespeare", help="calibration text (as oscar-calibrate)")
    p.add_argument("--eval-data", default="shakespeare-eval", help="evaluation text (never the calibration text)")
    p.add_argument("--tokens", type=int, default=20000, help="calibration tokens")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--sink", type=int, default=art.DEFAULT_SINK)
    p.add_argument("--recent", type=int, default=art.DEFAULT_RECENT)
    p.add_argument("--group", type=int, default=None)
    p.add_argument("--ppl-contexts", type=_ints, default=[1024, 2048])
    p.add_argument("--ppl-seqs", type=int, default=2, help="evaluation sequences per context length")
    p.add_argument("--niah-lengths", type=_ints, default=[512, 1024, 2048])
    p.add_argument("--niah-depths", type=_floats, default=[0.1, 0.5, 0.9])
    p.add_argument("--niah-trials", type=int, default=2)
    p.add_argument("--save-artifacts", type=Path, default=None, help="also write each method's rotations here")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in EVAL_METHODS]
    if bad:
        print(f"oscar-eval: error: unknown method(s) {bad}; choose from {', '.join(EVAL_METHODS)}", file=sys.stderr)
        return 2
    if args.data == args.eval_data:
        print("oscar-eval: error: --data and --eval-data must differ (calibrate and evaluate on different text)",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    progress = not args.quiet
    cal_texts = data.load_texts(args.data)
    eval_texts = data.load_texts(args.eval_data)
    overlap = set(cal_texts) & set(eval_texts)
    if overlap:
        print(f"oscar-eval: error: texts in both calibration and evaluation data: {sorted(overlap)}", file=sys.stderr)
        return 2
    lm, tok, path = model_io.load(args.model)

    cfg = CalibrationConfig(method="optr", sink=args.sink, recent=args.recent, group_size=args.group,
                            seed=args.seed, optr=OptRConfig())
    fitted: dict[str, art.RotationArtifacts] = {}
    timings: dict[str, float] = {}
    calib_methods = [m for m in methods if m != "bf16"]
    collector = None
    cal_seqs = data.sequences_from_texts(tok, cal_texts, args.seq_len, args.tokens)
    summary = {"data": {"spec": args.data, "texts": list(cal_texts)}, "tokens": sum(s.numel() for s in cal_seqs),
               "seed": args.seed}
    if any(m not in ("identity", "hadamard") for m in calib_methods):
        t = time.time()
        collector = collect_statistics(lm, cal_seqs, cfg, progress)
        timings["statistics"] = round(time.time() - t, 1)
    for m in calib_methods:
        t = time.time()
        cfg.method = m
        fitted[m], _ = fit(lm, collector, cfg, dict(summary), progress)
        timings[m] = round(time.time() - t, 1)
        if args.save_artifacts:
            art.save(fitted[m], args.save_artifacts / m)
    del collector

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
            if m == "optr":
                layers = a.calibration.get("layers", [])
                r["optr_kept"] = {"k": sum(sum(x["k_kept"]) for x in layers),
                                  "v": sum(sum(x["v_kept"]) for x in layers),
                                  "heads": sum(len(x["k_kept"]) for x in layers)}
        results[m] = r

    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "oscar-eval " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": str(path), "fingerprint": art.ModelFingerprint.from_config(lm.config).__dict__,
        "calibration": {"spec": args.data, "texts": list(cal_texts), "tokens": summary["tokens"],
                        "seq_len": args.seq_len},
        "evaluation": {"spec": args.eval_data, "texts": list(eval_texts), "niah_haystack": eval_name},
        "sink": args.sink, "recent": args.recent, "group": args.group or lm.config.head_dim,
        "fit_seconds": timings, "total_seconds": round(time.time() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    table = report.accuracy_table(results)
    (args.out / "accuracy_table.md").write_text(table + "\n")
    title = (f"{Path(meta['model']).name}: calibrated on {args.data} ({summary['tokens']} tok), "
             f"evaluated on {eval_name}; sink {args.sink}, recent {args.recent}")
    report.plot_layer_errors(results, args.out / "accuracy_layers.png", title)
    report.plot_niah(results, args.out / "accuracy_niah.png", "pass-key retrieval: " + title)
    print(table)
    print(f"\nwrote {args.out}/accuracy.{{json,_table.md,_layers.png,_niah.png}} in {meta['total_seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
