"""Where the INT2 decode's time goes: its loop variants side by side, with the BF16 split-K decode over the same pages.

The first H200 run (2026-12-04, docs/gpu/run1) measured the INT2 decode at
2-4% of the copy bandwidth, 3-4x slower than the BF16 Triton decode over the
same paged layout, and nearly as slow at head size 64 as at 128: a per-token
cost, not a per-byte one.  A block of the split kernel's loop waits for three
dependent loads in turn (its tokens' slots, their hot entries, then the rows),
so this times the loop's variants (``decode_attention``'s ``prefetch`` and
``hot_skip``, timed in the second run, which chose today's default; since then
``dots="bf16"`` and ``fold``, the folded scales; since 2026-12-05 the grid:
``whole_waves``, splits from the compiled kernel's residency, and
``max_registers``) and tiles in one run, to choose the default from numbers.
On a GPU the report also gives each variant's grid: splits, registers per
thread (spilled), programs resident per multiprocessor and waves:

    python scripts/device/decode_variants.py --out OUT [--budget-s 90]
    ncu ... python scripts/device/decode_variants.py --out OUT --profile   # one case, a few launches each

``--profile``: no timing; the first run's loop, today's default and the folded scales, each launched twice on
batch 32 at 32k
(the servers' largest 32k wave is about that), for Nsight Compute to read the counters of (device_check.sh's
opt-in ``decode_profile`` step).

Each case: 32 query / 8 KV heads, d 128, pages of 16 slots in random order,
an INT2 store written by the write kernel from random rows, sink 64 + recent
256 hot per request.  Every variant's output is checked against the first's
(same math, another loop), the first against the torch reference on the
smallest case.  Timing: ``triton.testing.do_bench`` (median).  On a machine
without CUDA it runs tiny shapes under Triton's interpreter (a smoke run of
the script itself; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SMOKE = not torch.cuda.is_available()
if SMOKE:
    from oscar_sglang.kernels import interpret

    interpret.enable()
import triton  # noqa: E402

from oscar_sglang.kernels import api, layout, scenario  # noqa: E402
from oscar_sglang.kernels.decode import autotune, bf16_baseline, reference  # noqa: E402
from oscar_sglang.kernels.decode import triton_kernel as decode_tk  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import bench_baselines as bl  # noqa: E402

DEVICE = torch.device("cpu" if SMOKE else "cuda")
KV, GQA, D, PAGE = (2, 4, 64, 16) if SMOKE else (8, 4, 128, 16)
SINK, RECENT = (4, 8) if SMOKE else (64, 256)
CASES = [(1, 200), (2, 96)] if SMOKE else [(1, 32768), (32, 32768), (128, 16384)]  # (batch, context)
# (label, decode_attention options): the first is the kernel as it was at the first GPU run (the others are
# checked against it), the second the default since the second run; then the variants not yet timed on the GPU.
# The second run's other rows (hot_skip, prefetch 1 and 2 at block_n 32, prefetch 2 at 64, 8 warps, 1 stage) are
# in docs/gpu/run2/decode_variants.md; dropped here so that the rest fits the step's two minutes, as are (on
# 2026-12-05) block_n 128 (255 registers and 139 KB of shared memory: one program per multiprocessor), bf16 dots
# at block_n 128 (spills) and the folded loop at 1 warp (spills) and at block_n 128.
RUN1 = {"block_n": 32, "prefetch": 0, "hot_skip": False, "hot_weight": 0}
FOLD2 = {"fold": True, "num_warps": 2}
VARIANTS = [
    ("as run 1", RUN1),
    ("prefetch 1 + hot_skip, block_n 64", {"prefetch": 1, "hot_skip": True, "block_n": 64}),
    # the blocks with a hot row in a loop of their own, after the cold ones' (as the folded loop since 2026-12-05):
    # with triton 3.6, the H200's, 200 registers and 1006 instructions per cold block instead of 255 (spilling)
    # and 1797; with 3.8 168 and 1089 instead of 220 and 959
    ("default, hot blocks in their own loop", {"hot_loop": True}),
    ("default, bf16 dots", {"dots": "bf16"}),
    # the default loop compiles to 220-255 registers per thread on sm_90, so a multiprocessor holds 8 warps
    # (kernels/occupancy.py); the default grid is sized for 8 warps per multiprocessor, rounded up, which can
    # leave residency unused (the fold: 12-16) or be a wave and a part: "whole waves" sizes it from the compiled
    # kernel's residency, rounded down
    ("default, whole waves", {"whole_waves": True}),
    # scales folded into the logits and weights, fp16 dots over the codes unpacked by inline PTX, transposed so
    # that the GQA group fills the MMA's 8-wide side, blocks with a hot row in a loop of their own (sm_90 per
    # 64-token block: 763 instructions with triton 3.8, 656 with 3.6, against the default's 959 and 1797; fewer
    # warps issue fewer per token: 2 warps 771 / 774; 128-168 registers, 12-16 warps per multiprocessor against
    # the default's 8: `python -m oscar_sglang.kernels.compile_check --sass fold`)
    ("default, fold", {"fold": True}),
    ("default, fold, 2 warps", FOLD2),
    ("default, fold, 2 warps, whole waves", {**FOLD2, "whole_waves": True}),
    # every variant is given the windows as the server gives them (``hot_windows``: its splits cut by work, a
    # block of the windows weighing 5 cold ones for the fold and 1.5 for the others, kernels/decode/split_cut.py);
    # these two cut them evenly, as every loop did until 2026-12-05 (the second run's rows): at batch 1, 32k, 99
    # splits the fold's longest split holds 14 cold blocks' worth of work evenly cut, 6 by work (counted)
    ("default, even cut", {"hot_weight": 0}),
    ("default, fold, 2 warps, even cut", {**FOLD2, "hot_weight": 0}),
    # the values' codes unpacked before they cross to their dots' transposed layout (ldmatrix.trans of fp16 through
    # shared memory, not byte shuffles): sm_90, per 64-token block and warp, 552 instructions with 3.6 and 545 with
    # 3.8 instead of 612 / 630, but 200 shared-memory wavefronts instead of 88 (docs/KERNELS.md: by the counts
    # bound by shared memory, ~400 cycles a block against the fold's ~315 of issue); a row, so that the GPU says
    ("default, fold, 2 warps, values unpacked first", {**FOLD2, "unpack_first": True}),
    # at most 128 registers: 16 warps per multiprocessor instead of 12 (with 3.6, 36 local loads per block)
    ("default, fold, 2 warps, 128 registers, whole waves", {**FOLD2, "max_registers": 128, "whole_waves": True}),
]
if SMOKE:  # the interpreter ignores registers and waves; the rows still run through the script's plumbing
    VARIANTS = [(n, {**o, "block_n": 16}) for n, o in VARIANTS[:4] + VARIANTS[5:7] + VARIANTS[8:]]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for decode_variants.md/.json")
    p.add_argument("--budget-s", type=float, default=90.0, help="stop starting cases after this many seconds")
    p.add_argument("--rep", type=float, default=25.0, help="do_bench repetition time (ms)")
    p.add_argument("--profile", action="store_true", help="launch two variants twice each on one case, untimed")
    return p.parse_args(argv)


def timed(fn, rep: float) -> float:
    """Milliseconds per call (``bench_baselines.timed_ms``; under the interpreter one call after a warm one)."""
    return bl.timed_ms(fn, SMOKE, rep=rep, cpu_runs=1)


def build_case(batch: int, ctx: int, seed: int):
    """Pages, an INT2 store written by the write kernel (hot rows for sink/recent), BF16 buffers, a query."""
    paged = scenario.paged_layout([ctx] * batch, PAGE, seed, spare_pages=0, device=DEVICE)
    hot_per_req = min(ctx, SINK + RECENT)
    store = layout.empty_store(paged.num_slots, KV, D, None, batch * hot_per_req, DEVICE)
    hot_index = scenario.assign_hot(store, paged, SINK, RECENT)
    rot = scenario.random_rotation(KV, D, seed, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    chunk = 1 << 16
    for lo in range(0, paged.num_slots, chunk):  # every slot once (the padding slot too): random rows
        slots = torch.arange(lo, min(lo + chunk, paged.num_slots), device=DEVICE)
        k = torch.randn(len(slots), KV, D, generator=g, device=DEVICE, dtype=torch.bfloat16) + 1.5
        v = torch.randn(len(slots), KV, D, generator=g, device=DEVICE, dtype=torch.bfloat16)
        api.write_kv(k, v, slots, store, rot, hot_index[slots].long(), backend="triton")
    kb = torch.randn(paged.num_slots, KV, D, generator=g, device=DEVICE, dtype=torch.bfloat16)
    vb = torch.randn(paged.num_slots, KV, D, generator=g, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(batch, KV * GQA, D, generator=g, device=DEVICE, dtype=torch.bfloat16)
    return paged, store, rot, kb, vb, q


def decode(q, store, rot, targs, ctx: int, opts: dict, report: dict | None = None):
    """One INT2 decode of a variant, given the hot rows' windows as a server gives them (``hot_windows``)."""
    return decode_tk.decode_attention(q, store, rot, *targs, max_seq_len=ctx, report=report,
                                      hot_windows=(SINK, RECENT), **opts)


def measure(args) -> dict:
    start = time.time()
    rows, problems = [], []
    for ci, (batch, ctx) in enumerate(CASES):
        if time.time() - start > args.budget_s:
            problems.append(f"batch {batch} context {ctx}: not run, --budget-s {args.budget_s:g} spent")
            continue
        paged, store, rot, kb, vb, q = build_case(batch, ctx, seed=ci)
        targs = (paged.req_to_token, paged.req_pool_indices, paged.seq_lens, D**-0.5)
        row = {"batch": batch, "context": ctx,
               "int2_MB": (store.k_codes.numel() + store.v_codes.numel()) / 1e6,
               "bf16_ms": timed(lambda: bf16_baseline.decode_attention_bf16(q, kb, vb, *targs, max_seq_len=ctx),
                                args.rep)}
        first = None
        for label, opts in VARIANTS:
            def run(opts=opts, report=None):
                return decode(q, store, rot, targs, ctx, opts, report)
            try:
                grid = {}
                out = run(report=grid)
                if first is None:
                    first = out.float()
                    if ci == 0:  # the kernel as it was, against the plain-torch reference, once
                        ref = reference.decode_attention(q, store, rot, *targs).float()
                        row["first_vs_reference"] = ((first - ref).abs().max() / ref.abs().max()).item()
                err = ((out.float() - first).abs().max() / first.abs().max()).item()
                row[label] = {"ms": timed(run, args.rep), "rel_diff_vs_first": err, "grid": grid}
                if err > 2e-2:
                    problems.append(f"batch {batch} context {ctx} {label}: differs from the first by {err:.2e}")
            except Exception as e:  # noqa: BLE001  (a variant that does not compile is a finding, not a crash)
                row[label] = {"ms": None, "note": f"{type(e).__name__}: {str(e)[:160]}"}
            print(f"batch {batch} ctx {ctx} {label}: {row[label]}", flush=True)
        print(f"batch {batch} ctx {ctx} BF16 Triton: {row['bf16_ms']:.3f} ms", flush=True)
        rows.append(row)
        del paged, store, kb, vb
    return {"device": "CPU (interpreter)" if SMOKE else torch.cuda.get_device_name(),
            "triton": triton.__version__, "torch": torch.__version__, "seconds": round(time.time() - start, 1),
            "command": " ".join([sys.executable, *sys.argv]), "rows": rows, "problems": problems}


def knob(opts: dict, grid: dict | None = None) -> str:
    """``OSCAR_SGLANG_DECODE_KERNEL``'s value that serves a variant's loop: its options as the knob's keys, with
    ``whole_waves`` as ``resident=`` the residency the GPU reported for it (a CUDA graph's split count is fixed
    before its capture, so the server takes the number; ``oscar_sglang/sglang/settings.py``), as the server's
    own startup timing serves its choice (``kernels/decode/autotune.py``)."""
    return autotune.knob_value(autotune.served_options(opts, (grid or {}).get("resident")))


def verdict(res: dict) -> str:
    """Which variant was fastest at every case that all ran, as how much faster than the default and the knob
    that serves it; or each case's fastest, where none was at every one."""
    rows = [r for r in res["rows"] if any(r[label].get("ms") for label, _ in VARIANTS)]
    if not rows:
        return "Fastest: nothing was timed."
    ran = [(label, opts) for label, opts in VARIANTS if all(r[label].get("ms") for r in rows)]
    best = [min(ran, key=lambda v: r[v[0]]["ms"]) if ran else None for r in rows]
    default = VARIANTS[1][0]
    if ran and all(b == best[0] for b in best):
        label, opts = best[0]
        if label == default:
            return f"Fastest at every case: the default ({default}); no knob to change."
        gains = [r[default]["ms"] / r[label]["ms"] for r in rows] if all(r[default].get("ms") for r in rows) else []
        grid = next((r[label].get("grid") for r in rows if r[label].get("grid", {}).get("resident")), None)
        return (f"Fastest at every case: {label}"
                + (f", {min(gains):.2f}-{max(gains):.2f}x the default's speed" if gains else "")
                + f"; serve it with OSCAR_SGLANG_DECODE_KERNEL={knob(opts, grid)}")
    return "No variant was fastest at every case: " + "; ".join(
        f"b{r['batch']} {r['context']}: {b[0] if b else '-'}" for r, b in zip(rows, best)) + "."


def markdown(res: dict) -> str:
    labels = [label for label, _ in VARIANTS]
    out = ["# INT2 decode loop variants", "",
           f"Device {res['device']}, triton {res['triton']}, torch {res['torch']}; {res['seconds']} s.",
           f"Command: `{res['command']}`", "",
           f"{KV * GQA} query / {KV} KV heads, d {D}, pages of {PAGE}, sink {SINK} + recent {RECENT} hot. "
           "ms (median); in brackets the BF16 Triton decode's time over this variant's (> 1: INT2 faster).", "",
           "| batch | context | BF16 Triton ms | " + " | ".join(labels) + " |",
           "|---|---|---|" + "---|" * len(labels)]
    for r in res["rows"]:
        cells = []
        for label in labels:
            ms = r[label].get("ms")
            cells.append(f"{ms:.3f} ({r['bf16_ms'] / ms:.2f})" if ms else r[label].get("note", "-"))
        out.append(f"| {r['batch']} | {r['context']} | {r['bf16_ms']:.3f} | " + " | ".join(cells) + " |")
    out += ["", "Agreement: " + "; ".join(f"b{r['batch']} {r['context']}: worst variant vs first "
                                          f"{max((r[x].get('rel_diff_vs_first') or 0) for x in labels):.1e}"
                                          + (f", first vs reference {r['first_vs_reference']:.1e}"
                                             if "first_vs_reference" in r else "") for r in res["rows"])]
    out += ["", ("(Triton's interpreter: its times say nothing of a GPU's) " if "interpreter" in res["device"]
                 else "") + verdict(res)]
    grids = [(r, label) for r in res["rows"] for label in labels if r[label].get("grid", {}).get("registers")]
    if grids:
        out += ["", "Grids: splits per request; the split kernel's registers per thread (spilled), shared KB, "
                    "programs resident per multiprocessor, waves of the grid.", "",
                "| batch | context | variant | splits | registers | shared KB | resident | waves |",
                "|---|---|---|---|---|---|---|---|"]
        for r, label in grids:
            g = r[label]["grid"]
            out.append(f"| {r['batch']} | {r['context']} | {label} | {g['splits']} | {g['registers']} "
                       f"({g['spills']}) | {g['shared'] / 1024:.1f} | {g['resident']} | {g['waves']:.2f} |")
    notes = sorted({r[label]["grid"]["note"] for r in res["rows"] for label in labels
                    if r[label].get("grid", {}).get("note")})
    out += [f"- grid: {n}" for n in notes]
    out += [f"- problem: {p}" for p in res["problems"]]
    return "\n".join(out) + "\n"


# the first run's loop, the default since run 2, the folded scales
PROFILED = ("as run 1", "prefetch 1 + hot_skip, block_n 64", "default, fold", "default, fold, 2 warps")


def profile() -> int:
    """Each of :data:`PROFILED` launched twice (compiled first) on one case; nothing timed here."""
    batch, ctx = CASES[1]
    paged, store, rot, kb, vb, q = build_case(batch, ctx, seed=1)
    targs = (paged.req_to_token, paged.req_pool_indices, paged.seq_lens, D**-0.5)
    outs = []
    for label, opts in VARIANTS:
        if label in PROFILED:
            twice = [decode(q, store, rot, targs, ctx, opts).float() for _ in range(2)]
            outs.append(twice[0])
            print(f"profiled batch {batch} ctx {ctx}: {label} ({opts}); the second launch differs from the first "
                  f"by {(twice[1] - twice[0]).abs().max().item():.1e}", flush=True)
    err = ((outs[-1] - outs[0]).abs().max() / outs[0].abs().max()).item()
    print(f"last vs first variant: max relative difference {err:.1e}", flush=True)
    return 0 if err < 2e-2 else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.profile:
        return profile()
    res = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_variants.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (args.out / "decode_variants.md").write_text(text)
    print(text)
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
