"""Benchmark the INT2 kernels: decode time and achieved bandwidth vs a BF16 baseline, write throughput.

    .venv/bin/python scripts/bench_kernels.py                 # GPU: full grid, writes docs/bench_kernels.*
    .venv/bin/python scripts/bench_kernels.py --cpu-smoke     # CPU: tiny shapes under TRITON_INTERPRET=1

Decode: batch 1..64, context 4k..128k, head_dim 64 and 128, GQA 4:1 and 8:1
(8 KV heads), 64 sink + 256 recent tokens hot per request, pages of 16 slots
in random order.  Baseline: a BF16 split-K Triton decode over the same paged
layout (``kernels/decode/bf16_baseline.py``).  Bandwidth = bytes the kernel
must read (K/V rows, scales, hot rows, slot and hot indices) / time.
Write: tokens per second of the per-layer write kernel.  Before timing, the
Triton outputs are checked against the torch references on a small case.
Without CUDA (or with ``--cpu-smoke``) the same code runs on tiny shapes
through Triton's interpreter, so the script cannot rot; those numbers say
nothing about GPU speed.  Outputs: ``<out>/bench_kernels[_cpu_smoke].{md,json,png}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="output folder (default: docs/)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the Triton interpreter (auto without CUDA)")
    p.add_argument("--max-tokens", type=int, default=64 * 131072, help="skip decode cases with batch*context above this")
    p.add_argument("--kv-heads", type=int, default=8)
    return p.parse_args(argv)


ARGS = parse_args()
import torch  # noqa: E402

SMOKE = ARGS.cpu_smoke or not torch.cuda.is_available()
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402

from oscar_sglang import format as fmt  # noqa: E402
from oscar_sglang.kernels import interpret, layout, scenario  # noqa: E402
from oscar_sglang.kernels.decode import reference as decode_ref  # noqa: E402
from oscar_sglang.kernels.write import reference as write_ref  # noqa: E402

if SMOKE:
    interpret.enable()
from oscar_sglang.kernels.decode import bf16_baseline, triton_kernel as decode_tk  # noqa: E402
from oscar_sglang.kernels.write import triton_kernel as write_tk  # noqa: E402

DEVICE = torch.device("cpu" if SMOKE else "cuda")
SINK, RECENT, PAGE = 64, 256, 16

if SMOKE:
    KV_HEADS = 1
    BATCHES, CONTEXTS = [1, 2], [96, 320]
    SINK, RECENT = 8, 16
    WRITE_TOKENS = [16, 64]
    TUNE_CASES, TUNE_GRID = {(1, 320)}, [(32, 4, 2), (64, 4, 2)]
else:
    KV_HEADS = ARGS.kv_heads
    BATCHES, CONTEXTS = [1, 4, 16, 64], [4096, 16384, 65536, 131072]
    WRITE_TOKENS = [1, 16, 256, 4096, 32768]
    TUNE_CASES = {(1, 131072), (64, 4096), (16, 16384)}
    TUNE_GRID = [(bn, nw, ns) for bn in (32, 64) for nw in (4, 8) for ns in (1, 2, 3)]
DIMS, GQAS = [64, 128], [4, 8]


def timed(fn) -> float:
    """Milliseconds per call: triton's do_bench on the GPU; on the CPU the best of 2 after a warm-up."""
    if not SMOKE:
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn()
    runs = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return min(runs) * 1e3


def random_store(num_slots: int, d: int) -> tuple[layout.LayerStore, torch.Tensor, torch.Tensor]:
    """An INT2 store with random codes/scales (timing does not depend on values) and BF16 baseline buffers."""
    s = layout.empty_store(num_slots, KV_HEADS, d, None, 0, DEVICE)
    for t in (s.k_codes, s.v_codes):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=DEVICE))
    for t in (s.k_scale, s.v_scale):
        t.copy_(torch.rand(t.shape, device=DEVICE) * 0.1)
    for t in (s.k_zero, s.v_zero):
        t.copy_(torch.randn(t.shape, device=DEVICE) * 0.1 - 0.15)
    kb = torch.randn(num_slots, KV_HEADS, d, device=DEVICE, dtype=torch.bfloat16)
    vb = torch.randn(num_slots, KV_HEADS, d, device=DEVICE, dtype=torch.bfloat16)
    return s, kb, vb


def with_hot(store: layout.LayerStore, entries: int) -> layout.LayerStore:
    """The same store with a BF16 side pool of ``entries`` random rows."""
    h, d = store.kv_heads, store.head_dim
    hot = {f: getattr(store, f) for f in store.__dataclass_fields__}
    hot["k_hot"] = torch.randn(entries, h, d, device=DEVICE, dtype=torch.bfloat16)
    hot["v_hot"] = torch.randn(entries, h, d, device=DEVICE, dtype=torch.bfloat16)
    hot["hot_index"] = torch.full_like(store.hot_index, -1)
    return layout.LayerStore(**hot)


def decode_bytes(batch: int, ctx: int, d: int, hot_per_req: int) -> tuple[int, int]:
    """Bytes each kernel must read: (INT2 + hot, BF16)."""
    h = KV_HEADS
    cold = batch * (ctx - hot_per_req) * h * 2 * fmt.bytes_per_row(d)
    hot = batch * hot_per_req * h * 2 * 2 * d
    index = batch * ctx * (4 + 4)  # req_to_token + hot_index
    bf16 = batch * ctx * (h * 2 * 2 * d + 4)
    return cold + hot + index, bf16


def check_correctness() -> dict:
    """Triton vs torch reference on a small case (the first GPU run's sanity check)."""
    d, gqa, lens = 128, 4, [1, 17, 300]
    paged = scenario.paged_layout(lens, PAGE, 0, device=DEVICE)
    rot = scenario.random_rotation(KV_HEADS, d, 0, device=DEVICE)
    slots = torch.cat([paged.slots(b) for b in range(len(lens))])
    k, v = scenario.random_kv(len(slots), KV_HEADS, d, 0, DEVICE)
    ref = layout.empty_store(paged.num_slots, KV_HEADS, d, None, len(slots), DEVICE)
    hot_loc = scenario.assign_hot(ref, paged, SINK // 8, RECENT // 8)[slots]
    out = ref.clone()
    write_ref.write_kv(k, v, slots, ref, rot, hot_loc)
    write_tk.write_kv(k, v, slots, out, rot, hot_loc)
    mism = max((fmt.unpack(getattr(ref, c)) != fmt.unpack(getattr(out, c))).float().mean().item()
               for c in ("k_codes", "v_codes"))
    q = torch.randn(len(lens), KV_HEADS * gqa, d, device=DEVICE)
    args = (q, ref, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
    err = (decode_tk.decode_attention(*args, d**-0.5) - decode_ref.decode_attention(*args, d**-0.5)).abs().max()
    return {"write_code_mismatch_fraction": mism, "decode_max_abs_err": err.item()}


def bench_decode() -> tuple[list[dict], list[dict]]:
    """Decode rows, and for a few cases (d=128, first GQA) a sweep of block_n / num_warps / num_stages."""
    rows, tuning = [], []
    for d in DIMS:
        fits = [(b, c) for b in BATCHES for c in CONTEXTS if b * c <= ARGS.max_tokens]
        most = max(b * c for b, c in fits)
        try:  # room for every case's pages (each request's last page may be partial)
            store, kb, vb = random_store(most + (max(BATCHES) + 1) * PAGE, d)
        except torch.OutOfMemoryError:
            print(f"d={d}: out of memory for {most} tokens; lower --max-tokens", file=sys.stderr)
            continue
        for batch, ctx in fits:
            paged = scenario.paged_layout([ctx] * batch, PAGE, batch + ctx, spare_pages=0, device=DEVICE)
            hot_per_req = min(ctx, SINK + RECENT)
            st = with_hot(store, batch * hot_per_req)
            scenario.assign_hot(st, paged, SINK, RECENT)
            for gqa in GQAS:
                q = torch.randn(batch, KV_HEADS * gqa, d, device=DEVICE, dtype=torch.bfloat16)
                rot = scenario.random_rotation(KV_HEADS, d, 0, device=DEVICE)
                args = (paged.req_to_token, paged.req_pool_indices, paged.seq_lens, d**-0.5)
                t_int2 = timed(lambda: decode_tk.decode_attention(q, st, rot, *args, max_seq_len=ctx))
                t_bf16 = timed(lambda: bf16_baseline.decode_attention_bf16(q, kb, vb, *args, max_seq_len=ctx))
                b_int2, b_bf16 = decode_bytes(batch, ctx, d, hot_per_req)
                row = {"d": d, "gqa": gqa, "batch": batch, "context": ctx,
                       "splits": decode_tk.choose_splits(batch, KV_HEADS, DEVICE, ctx),
                       "int2_ms": t_int2, "bf16_ms": t_bf16, "speedup": t_bf16 / t_int2,
                       "int2_GBps": b_int2 / t_int2 / 1e6, "bf16_GBps": b_bf16 / t_bf16 / 1e6,
                       "int2_MB": b_int2 / 1e6, "bf16_MB": b_bf16 / 1e6}
                rows.append(row)
                print(f"decode d={d} gqa={gqa} batch={batch} ctx={ctx}: int2 {t_int2:.3f} ms, "
                      f"bf16 {t_bf16:.3f} ms, x{row['speedup']:.2f}", flush=True)
                if d == DIMS[-1] and gqa == GQAS[0] and (batch, ctx) in TUNE_CASES:
                    for bn, nw, ns in TUNE_GRID:
                        opts = {"block_n": bn, "num_warps": nw, "num_stages": ns}
                        t = timed(lambda: decode_tk.decode_attention(q, st, rot, *args, max_seq_len=ctx, **opts))
                        tb = timed(lambda: bf16_baseline.decode_attention_bf16(q, kb, vb, *args, max_seq_len=ctx,
                                                                               **opts))
                        tuning.append({"d": d, "gqa": gqa, "batch": batch, "context": ctx, **opts,
                                       "int2_ms": t, "bf16_ms": tb})
        del store, kb, vb
    return rows, tuning


def bench_write() -> list[dict]:
    rows = []
    for d in DIMS:
        rot = scenario.random_rotation(KV_HEADS, d, 0, device=DEVICE)
        for n in WRITE_TOKENS:
            store = layout.empty_store(n + 1, KV_HEADS, d, None, n, DEVICE)
            k, v = scenario.random_kv(n, KV_HEADS, d, 0, DEVICE)
            slots = torch.randperm(n, device=DEVICE) + 1
            hot_loc = torch.arange(n, device=DEVICE)
            t = timed(lambda: write_tk.write_kv(k, v, slots, store, rot, hot_loc))
            moved = n * KV_HEADS * (2 * 2 * d + 2 * fmt.bytes_per_row(d) + 2 * 2 * d)  # read bf16, write int2 + hot
            rows.append({"d": d, "tokens": n, "ms": t, "tokens_per_s": n / t * 1e3, "GBps": moved / t / 1e6})
            print(f"write d={d} n={n}: {t:.3f} ms", flush=True)
    return rows


def markdown(meta: dict, check: dict, decode: list[dict], tuning: list[dict], write: list[dict]) -> str:
    lines = [f"# Kernel benchmark ({meta['mode']})", "",
             f"{meta['date']}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['kv_heads']} KV heads, sink {meta['sink']} + recent {meta['recent']} hot per request, "
             f"pages of {PAGE}. Command: `{meta['command']}`.", ""]
    if SMOKE:
        lines += ["**Interpreter numbers (TRITON_INTERPRET=1 on CPU): they only show that the benchmark runs; "
                  "they say nothing about GPU speed.**", ""]
    lines += [f"Correctness check (Triton vs torch reference): write code mismatch fraction "
              f"{check['write_code_mismatch_fraction']:.2e}, decode max abs error {check['decode_max_abs_err']:.2e}.",
              "", "## Decode attention", "",
              "| d | GQA | batch | context | splits | INT2 ms | BF16 ms | speedup | INT2 GB/s | BF16 GB/s | INT2 MB read | BF16 MB read |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['d']} | {r['gqa']}:1 | {r['batch']} | {r['context']} | {r['splits']} | {r['int2_ms']:.3f} | "
                     f"{r['bf16_ms']:.3f} | {r['speedup']:.2f} | {r['int2_GBps']:.3g} | {r['bf16_GBps']:.3g} | "
                     f"{r['int2_MB']:.3g} | {r['bf16_MB']:.3g} |")
    lines += ["", "## Decode tile sweep (defaults: block_n 32, num_warps 4, num_stages 2)", "",
              "| d | GQA | batch | context | block_n | num_warps | num_stages | INT2 ms | BF16 ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in tuning:
        lines.append(f"| {r['d']} | {r['gqa']}:1 | {r['batch']} | {r['context']} | {r['block_n']} | {r['num_warps']} | "
                     f"{r['num_stages']} | {r['int2_ms']:.3f} | {r['bf16_ms']:.3f} |")
    lines += ["", "## Write kernel (one layer, K and V, every token also hot)", "",
              "| d | tokens | ms | tokens/s | GB/s moved |", "|---|---|---|---|---|"]
    for r in write:
        lines.append(f"| {r['d']} | {r['tokens']} | {r['ms']:.3f} | {r['tokens_per_s']:.3g} | {r['GBps']:.3g} |")
    return "\n".join(lines) + "\n"


def plot(decode: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(DIMS) * len(GQAS), figsize=(4.2 * len(DIMS) * len(GQAS), 7.5), squeeze=False)
    for col, (d, gqa) in enumerate((d, g) for d in DIMS for g in GQAS):
        for batch in BATCHES:
            rs = [r for r in decode if r["d"] == d and r["gqa"] == gqa and r["batch"] == batch]
            if not rs:
                continue
            x = [r["context"] for r in rs]
            line, = axes[0, col].plot(x, [r["int2_ms"] for r in rs], marker="o", label=f"batch {batch} INT2")
            axes[0, col].plot(x, [r["bf16_ms"] for r in rs], ls="--", marker="x", color=line.get_color(),
                              label=f"batch {batch} BF16")
            axes[1, col].plot(x, [r["int2_GBps"] for r in rs], marker="o", color=line.get_color())
            axes[1, col].plot(x, [r["bf16_GBps"] for r in rs], ls="--", marker="x", color=line.get_color())
        axes[0, col].set_title(f"d={d}, GQA {gqa}:1")
        for row in (0, 1):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].grid(alpha=0.3)
        axes[0, col].set_yscale("log")
        axes[1, col].set_xlabel("context (tokens)")
    axes[0, 0].set_ylabel("decode time (ms)")
    axes[1, 0].set_ylabel("achieved bandwidth (GB/s)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("INT2 (solid) vs BF16 (dashed) decode" + (" - INTERPRETER, not GPU speed" if SMOKE else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    start = time.time()
    meta = {"mode": "CPU smoke, Triton interpreter" if SMOKE else "GPU",
            "date": datetime.date.today().isoformat(),
            "device": "CPU (interpreter)" if SMOKE else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "kv_heads": KV_HEADS,
            "sink": SINK, "recent": RECENT, "command": " ".join(["scripts/bench_kernels.py", *sys.argv[1:]])}
    check = check_correctness()
    print("check:", check, flush=True)
    decode, tuning = bench_decode()
    write = bench_write()
    meta["seconds"] = round(time.time() - start, 1)
    ARGS.out.mkdir(parents=True, exist_ok=True)
    stem = ARGS.out / ("bench_kernels_cpu_smoke" if SMOKE else "bench_kernels")
    stem.with_suffix(".md").write_text(markdown(meta, check, decode, tuning, write))
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "check": check, "decode": decode,
                                                     "tuning": tuning, "write": write}, indent=1))
    plot(decode, stem.with_suffix(".png"))
    print(f"wrote {stem}.md/.json/.png in {meta['seconds']} s")


if __name__ == "__main__":
    main()
