"""Benchmark the INT2 decode kernel against the strongest BF16 decode baselines available, and the write kernel.

    python scripts/bench_kernels.py --out OUT               # GPU: full grid, <= ~2.5 min on an H200
    python scripts/bench_kernels.py --cpu-smoke --out OUT   # CPU: tiny shapes under TRITON_INTERPRET=1, ~1 min

Decode problem (the same for every row's kernels): one bf16 query token per
request, 8 KV heads, GQA 4:1 (32 query heads), head_dim 128 (Llama-3-8B) and
64, batch {1, 8, 32, 128} x context {4k, 16k, 32k, 64k, 128k}; cases whose BF16
K+V cache exceeds ``--max-gib`` (default 40 GiB), and the largest whose buffers
(the paged stores, the dense copies: ~2.3x that cache) with ``--memory-headroom-gib``
do not fit the device's free memory (an H100's 80 GB hold fewer than an H200's
141), are skipped and listed.  The
INT2 store keeps 64 sink + 256 recent tokens per request hot (BF16), pages of
16 slots in random order.

Measured in the same run:

* copy bandwidth: ``dst.copy_(src)`` of a ``--copy-gib`` buffer; bytes read +
  written / time is the physical ceiling every decode row is compared to
  ("% copy" = (bytes the kernel must read / time) / (copy bytes read+written / time));
* INT2: ``kernels/decode/triton_kernel.py`` (bytes: codes, scales/zeros, hot
  rows, slot and hot indices), and the same kernel over a store with INT4 keys
  (one group per row) and INT2 values ("INT4-K"; only the keys' codes differ),
  both with the loop a server serves on this device: what its startup timing
  (``kernels/decode/autotune.py``) chooses per head size, run here first
  (``meta.served_decode``; the default loop's time beside it where that is another);
* BF16 baselines (bytes: K and V, plus their page/slot tables):
  ``triton_bf16`` our split-K Triton decode over the same paged layout
  (``kernels/decode/bf16_baseline.py``); ``sdpa`` torch
  ``scaled_dot_product_attention`` over a dense contiguous ``[batch, kv_heads,
  ctx, d]`` cache, flash backend forced (then efficient, then cuDNN), both
  ``enable_gqa=True`` and the GQA heads packed as query rows of their KV
  head timed (the same result; the faster is kept, each in the JSON);
  ``flashinfer`` ``BatchDecodeWithPagedKVCacheWrapper`` (NHD, pages of 16, the
  same paged buffers as ``triton_bf16``, tensor cores on by default as SGLang
  does at GQA >= 4) when ``flashinfer`` imports, its JIT build bounded by
  ``--flashinfer-timeout`` per head_dim in a child process;
  best BF16 = the fastest that ran; speedup = best BF16 time / INT2 time.
  Every baseline's output is checked against ``triton_bf16`` on every case.
* a tile sweep (block_n x num_warps x num_stages) of the two Triton decodes on
  two cases, and the write kernel's throughput (INT2, and INT4 keys + INT2 values);
* at the goals' shapes (batch 1 and 32, context 32k) the decodes again in CUDA graphs, and at batch 1 what
  each eager decode is made of: every kernel's device time and launches per call by torch's profiler
  (``bench_baselines.launch_times``: the INT2 split kernel, its merge and query rotation against SDPA's
  kernels; their sum against the eager time: how long the GPU waited for the host);
* the hot side pool's update per decode step, recorded in a CUDA graph and eager,
  and its re-pin kernel against the torch re-pin (``bench_hot_update.py``);
* prefill attention per layer: a 32k prompt in SGLang's 8k chunks, the INT2 extend kernel (bf16 and
  fp32 dots, a tile sweep) against SGLang's own Triton extend and SDPA flash (``bench_extend.py``).

Timing: ``triton.testing.do_bench`` (median, ``--warmup``/``--rep`` ms, L2
flushed between calls), eager launches (no CUDA graphs), so the smallest cases
include launch overhead.  Without CUDA (or with ``--cpu-smoke``) the same code
runs tiny shapes through Triton's interpreter, SDPA with the math backend, the
copy on the CPU, FlashInfer "not available", and checks every Triton output
and the FlashInfer page table against fp32 torch references; those numbers say
nothing about GPU speed.  Outputs: ``<out>/bench_kernels[_cpu_smoke].{md,json,png}``;
the exit code is 1 when a correctness check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START = time.time()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="output folder (default: docs/)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the Triton interpreter (auto without CUDA)")
    p.add_argument("--max-gib", type=float, default=40.0,
                   help="skip decode cases whose BF16 K+V cache exceeds this (GiB); peak GPU memory is about "
                        "2.3x it (paged + dense copy + INT2 store + INT4 keys)")
    p.add_argument("--device-gib", type=float, default=None,
                   help="free GPU memory to plan the decode cases' buffers for (default: what the device reports)")
    p.add_argument("--memory-headroom-gib", type=float, default=3.0,
                   help="memory left free beside the decode cases' shared buffers (each case's own buffers, "
                        "timing, graphs); the largest cases are skipped until it fits")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gqa", type=int, default=4, help="query heads per KV head")
    p.add_argument("--copy-gib", type=float, default=2.0, help="buffer size of the copy-bandwidth measurement")
    p.add_argument("--warmup", type=float, default=10.0, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=float, default=40.0, help="do_bench repetition time (ms)")
    p.add_argument("--no-tune", action="store_true", help="skip the tile sweep")
    p.add_argument("--no-flashinfer", action="store_true", help="do not try FlashInfer")
    p.add_argument("--flashinfer-timeout", type=float, default=90.0,
                   help="seconds allowed for FlashInfer's JIT build + check per head_dim (child process)")
    p.add_argument("--flashinfer-tensor-cores", choices=("on", "off"), default="on",
                   help="use_tensor_cores of the FlashInfer wrapper (SGLang: on at GQA >= 4)")
    p.add_argument("--flashinfer-on-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: a stand-in module
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="start no new decode case after this many seconds since launch (listed as skipped)")
    p.add_argument("--extend-budget-s", type=float, default=20.0,
                   help="the prefill section starts no tile-sweep variant after this many seconds of its own")
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
from oscar_sglang.kernels.decode import autotune, bf16_baseline, triton_kernel as decode_tk  # noqa: E402
from oscar_sglang.kernels.write import triton_kernel as write_tk  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_baselines as bl  # noqa: E402
import bench_extend  # noqa: E402
import bench_hot_update  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

DEVICE = torch.device("cpu" if SMOKE else "cuda")
SINK, RECENT, PAGE = 64, 256, bl.PAGE
GQA = ARGS.gqa
DIMS = [128, 64]
BASELINES = ("triton_bf16", "sdpa", "flashinfer")
LABEL = {"int2": "INT2", "int4k": "INT4-K", "triton_bf16": "Triton BF16", "sdpa": "SDPA", "flashinfer": "FlashInfer"}
# the second quantized variant: keys INT4 (one group per row), values INT2 as in the INT2 rows
INT4_KEYS = fmt.RowFormat(4)
TOL_BASELINE = 2e-2  # max |o - o_triton_bf16| / max |o_triton_bf16| (bf16 outputs)

if SMOKE:
    KV_HEADS = 2
    BATCHES, CONTEXTS = [1, 2], [96, 320]
    SINK, RECENT = 8, 16
    WRITE_TOKENS = [16, 64]
    COPY_BYTES = 64 << 20
    TUNE_CASES, TUNE_GRID = {(1, 320)}, [(64, 4, 2), (32, 4, 2)]
else:
    KV_HEADS = ARGS.kv_heads
    BATCHES, CONTEXTS = [1, 8, 32, 128], [4096, 16384, 32768, 65536, 131072]
    WRITE_TOKENS = [1, 16, 256, 4096, 32768]
    COPY_BYTES = int(ARGS.copy_gib * 2**30)
    # the servers' 32k decode: batch 1 (the ITL goal) and about the INT2 server's largest 32k concurrency (~26 of
    # 32k + 256 tokens in its 16 GiB budget: the decode-rate goal), where OSCAR_SGLANG_DECODE_KERNEL is used
    TUNE_CASES = {(1, 32768), (32, 32768)}
    TUNE_GRID = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 8, 2), (64, 4, 3)]  # first = the default
GRAPH_CASES = TUNE_CASES  # the goals' shapes, timed again in CUDA graphs (CUDA only)
# the INT2 decode as a server runs it: the loop its startup timing chooses (kernels/decode/autotune.py), per head
# size; its cases (smaller under the interpreter) and a shorter budget than a server's (the benchmark's own time)
SERVED_CASES = ((1, 96), (2, 48)) if SMOKE else None
SERVED_BUDGET_S = 20.0
SERVED: dict[int, dict] = {}   # d -> {"cases", "knobs" (per case), "summary"} (meta["served_decode"])


def timed(fn) -> float:
    """Milliseconds per call: triton's do_bench (median) on the GPU; under the interpreter one call (its
    numbers say nothing about speed; the smoke run only proves that every path runs, and a call is ~0.1-1 s)."""
    return bl.timed_ms(fn, SMOKE, ARGS.warmup, ARGS.rep, cpu_runs=1, cpu_warmup=False)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def random_rows(num_slots: int, d: int, form: fmt.RowFormat, device=None) -> tuple[torch.Tensor, ...]:
    """Random ``codes, scale, zero`` of one side in ``form`` (timing does not depend on values)."""
    device = device or DEVICE
    codes, scale, zero = layout.row_tensors(num_slots, KV_HEADS, d, form, device)
    codes.copy_(torch.randint(0, 256, codes.shape, dtype=torch.uint8, device=device))
    scale.copy_(torch.rand(scale.shape, device=device) * 0.3 / fmt.max_code(form.bits))
    zero.copy_(torch.randn(zero.shape, device=device) * 0.1 - 0.15)
    return codes, scale, zero


def random_store(num_slots: int, d: int, device=None) -> tuple[layout.LayerStore, torch.Tensor, torch.Tensor, tuple]:
    """An INT2 store with random codes/scales, BF16 baseline buffers, and INT4 keys for the INT4-K variant."""
    device = device or DEVICE
    s = layout.empty_store(num_slots, KV_HEADS, d, None, 0, device)
    for codes, scale, zero in ((s.k_codes, s.k_scale, s.k_zero), (s.v_codes, s.v_scale, s.v_zero)):
        for t, new in zip((codes, scale, zero), random_rows(num_slots, d, fmt.RowFormat(2), device)):
            t.copy_(new)
    kb = torch.randn(num_slots, KV_HEADS, d, device=device, dtype=torch.bfloat16)
    vb = torch.randn(num_slots, KV_HEADS, d, device=device, dtype=torch.bfloat16)
    return s, kb, vb, random_rows(num_slots, d, INT4_KEYS, device)


def decode_buffers(fits: list[tuple[int, int]], d: int, device=None) -> tuple:
    """What :func:`bench_decode` allocates for the cases ``fits`` at head size ``d``, shared by all of them: the
    paged stores (:func:`random_store`: every case's pages) and the dense BF16 copies SDPA reads (the largest
    case's).  ``device="meta"``: the same tensors without memory, to count their bytes."""
    device = device or DEVICE
    most = max(b * c for b, c in fits)
    num_slots = (-(-most // PAGE) + max(BATCHES) + 1) * PAGE  # every case's pages (last pages may be partial)
    dense_elems = max(b * KV_HEADS * c * d for b, c in fits)
    store, kb, vb, k4 = random_store(num_slots, d, device)
    flat_k = torch.empty(dense_elems, dtype=torch.bfloat16, device=device)
    flat_v = torch.empty(dense_elems, dtype=torch.bfloat16, device=device)
    return store, kb, vb, k4, flat_k, flat_v


def buffer_bytes(buffers) -> int:
    """Bytes of :func:`decode_buffers`' tensors."""
    store, kb, vb, k4, flat_k, flat_v = buffers
    tensors = [getattr(store, f.name) for f in dataclasses.fields(store)] + [kb, vb, *k4, flat_k, flat_v]
    return sum(t.numel() * t.element_size() for t in tensors)


def cases_in_memory(d: int, fits: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[dict]]:
    """``fits`` less the largest cases whose buffers (:func:`decode_buffers`) and ``--memory-headroom-gib`` do not
    fit the device's free memory (``--device-gib`` instead where given; the interpreter keeps every case
    otherwise), and those as skipped rows."""
    free = int(ARGS.device_gib * 2**30) if ARGS.device_gib else bl.free_device_bytes(DEVICE)
    if free is None or not fits:
        return fits, []
    kept, left_out = bl.fit_to_memory(fits, lambda cs: buffer_bytes(decode_buffers(cs, d, "meta")), free,
                                      int(ARGS.memory_headroom_gib * 2**30))
    return kept, [{"d": d, "batch": b, "context": c,
                   "reason": f"buffers {need / 2**30:.1f} GiB + headroom {ARGS.memory_headroom_gib:g} GiB > "
                             f"{free / 2**30:.1f} GiB free"} for (b, c), need in left_out]


def with_keys(store: layout.LayerStore, keys: tuple) -> layout.LayerStore:
    """The same store (values, hot rows, hot_index shared) with other key rows ``(codes, scale, zero)``."""
    fields = {f: getattr(store, f) for f in store.__dataclass_fields__}
    fields.update(k_codes=keys[0], k_scale=keys[1], k_zero=keys[2])
    return layout.LayerStore(**fields)


def with_hot(store: layout.LayerStore, entries: int) -> layout.LayerStore:
    """The same store with a BF16 side pool of ``entries`` random rows."""
    h, d = store.kv_heads, store.head_dim
    hot = {f: getattr(store, f) for f in store.__dataclass_fields__}
    hot["k_hot"] = torch.randn(entries, h, d, device=DEVICE, dtype=torch.bfloat16)
    hot["v_hot"] = torch.randn(entries, h, d, device=DEVICE, dtype=torch.bfloat16)
    hot["hot_index"] = torch.full_like(store.hot_index, -1)
    return layout.LayerStore(**hot)


def kv_bytes(batch: int, ctx: int, d: int) -> int:
    """BF16 K and V of every token: what any BF16 decode must read."""
    return batch * ctx * KV_HEADS * 2 * 2 * d


def read_bytes(batch: int, ctx: int, d: int, hot_per_req: int) -> dict[str, int]:
    """Bytes each kernel must read (the query and output are negligible and not counted)."""
    h = KV_HEADS
    cold_rows = batch * (ctx - hot_per_req) * h
    cold = cold_rows * 2 * fmt.bytes_per_row(d)
    cold4 = cold_rows * (INT4_KEYS.bytes_per_row(d) + fmt.bytes_per_row(d))
    hot = batch * hot_per_req * h * 2 * 2 * d
    kv = kv_bytes(batch, ctx, d)
    return {"int2": cold + hot + batch * ctx * (4 + 4),  # + req_to_token + hot_index
            "int4k": cold4 + hot + batch * ctx * (4 + 4),
            "triton_bf16": kv + batch * ctx * 4,  # + req_to_token
            "sdpa": kv,
            "flashinfer": kv + batch * -(-ctx // PAGE) * 4}  # + page indices


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_correctness() -> dict:
    """Triton vs torch reference on a small case (the first GPU run's sanity check), INT2 and INT4-K stores."""
    d, lens = 128, [1, 17, 300]
    paged = scenario.paged_layout(lens, PAGE, 0, device=DEVICE)
    rot = scenario.random_rotation(KV_HEADS, d, 0, device=DEVICE)
    slots = torch.cat([paged.slots(b) for b in range(len(lens))])
    k, v = scenario.random_kv(len(slots), KV_HEADS, d, 0, DEVICE)
    q = torch.randn(len(lens), KV_HEADS * GQA, d, device=DEVICE)
    mism, err = {}, {}
    for name, kf in (("int2", None), ("int4k", INT4_KEYS)):
        ref = layout.empty_store(paged.num_slots, KV_HEADS, d, None, len(slots), DEVICE, k_format=kf)
        hot_loc = scenario.assign_hot(ref, paged, SINK // 8, RECENT // 8)[slots]
        out = ref.clone()
        write_ref.write_kv(k, v, slots, ref, rot, hot_loc)
        write_tk.write_kv(k, v, slots, out, rot, hot_loc)
        mism[name] = max((fmt.unpack(getattr(ref, c), f.bits) != fmt.unpack(getattr(out, c), f.bits))
                         .float().mean().item()
                         for c, f in (("k_codes", ref.k_format), ("v_codes", ref.v_format)))
        args = (q, ref, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens)
        err[name] = (decode_tk.decode_attention(*args, d**-0.5)
                     - decode_ref.decode_attention(*args, d**-0.5)).abs().max().item()
    return {"write_code_mismatch_fraction": max(mism.values()), "decode_max_abs_err": max(err.values()),
            "per_format": {n: {"write_code_mismatch_fraction": mism[n], "decode_max_abs_err": err[n]} for n in mism}}


def cases(d: int) -> tuple[list[tuple[int, int]], list[dict]]:
    fits, skipped = [], []
    for b in BATCHES:
        for c in CONTEXTS:
            gib = kv_bytes(b, c, d) / 2**30
            if gib > ARGS.max_gib:
                skipped.append({"d": d, "batch": b, "context": c,
                                "reason": f"BF16 K+V {gib:.1f} GiB > --max-gib {ARGS.max_gib:g}"})
            else:
                fits.append((b, c))
    return fits, skipped


def bench_decode(copy_GBps: float, sdpa: bl.Sdpa, fi: bl.FlashInferDecode, problems: list[str],
                 rows: list[dict], skipped: list[dict], tuning: list[dict]) -> None:
    """Appends decode rows, skipped cases, and a tile sweep of the two Triton decodes on TUNE_CASES (d = 128).

    Per head_dim: every case with INT2, Triton BF16 and SDPA first, then FlashInfer on every case
    (so its JIT build, started at launch in a child process, has that long to finish).
    """
    for d in DIMS:
        fits, skip = cases(d)
        skipped += skip
        fits, skip = cases_in_memory(d, fits)
        skipped += skip
        buffers = None
        while fits and buffers is None:
            try:
                buffers = decode_buffers(fits, d)
            except torch.OutOfMemoryError:  # more than counted was taken: the largest cases out, the rest run
                most = max(b * c for b, c in fits)
                msg = f"d={d}: out of memory for the buffers of {most} tokens; those cases left out"
                print(msg, file=sys.stderr)
                problems.append(msg)
                skipped += [{"d": d, "batch": b, "context": c, "reason": "out of memory"}
                            for b, c in fits if b * c == most]
                fits = [(b, c) for b, c in fits if b * c != most]
            if buffers is None and DEVICE.type == "cuda":
                torch.cuda.empty_cache()
        if not fits:
            continue
        store, kb, vb, k4, flat_k, flat_v = buffers
        del buffers
        scale = d**-0.5
        rot = scenario.random_rotation(KV_HEADS, d, 0, device=DEVICE)
        served = served_loop(d, store, rot, problems)
        done = []  # (row, kept inputs for the FlashInfer pass)
        for batch, ctx in fits:
            if time.time() - START > ARGS.budget_s:
                skipped.append({"d": d, "batch": batch, "context": ctx,
                                "reason": f"time budget --budget-s {ARGS.budget_s:g} s spent"})
                continue
            try:  # one failing case (e.g. out of memory) is listed, the others still run
                done.append(decode_case(d, batch, ctx, scale, store, k4, kb, vb, flat_k, flat_v, rot, sdpa,
                                        fi, problems, served))
            except Exception as e:  # noqa: BLE001
                reason = f"failed: {type(e).__name__}: {str(e)[:300]}"
                skipped.append({"d": d, "batch": batch, "context": ctx, "reason": reason})
                problems.append(f"d={d} batch={batch} ctx={ctx}: {reason}")
                print(traceback.format_exc(), file=sys.stderr)
                if DEVICE.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if d == DIMS[0] and (batch, ctx) in TUNE_CASES and not ARGS.no_tune:
                tuning += tile_sweep(d, batch, ctx, scale, store, kb, vb, rot)
        del flat_k, flat_v
        flashinfer_pass(d, scale, kb, vb, done, fi, problems)
        for row, _ in done:
            finish_row(row, copy_GBps)
            rows.append(row)
        del store, k4, kb, vb, done
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def served_loop(d: int, store: layout.LayerStore, rot, problems: list[str]):
    """The decode loop a server would serve on this device for head size ``d`` (its startup timing,
    ``autotune.choose``, over stores of this benchmark's formats and heads: a ``Choice``, whose
    ``options_for(batch)`` each case runs with), recorded in :data:`SERVED`; None (the defaults) if that timing
    fails (a problem of the report, not of the benchmark)."""
    try:
        choice = autotune.choose(store, rot, KV_HEADS * GQA, cases=SERVED_CASES, budget_s=SERVED_BUDGET_S,
                                 windows=(SINK, RECENT))
    except Exception as e:  # noqa: BLE001
        problems.append(f"d={d}: the startup timing of the decode loop failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    SERVED[d] = {"cases": [list(c) for c in choice.cases],
                 "knobs": [autotune.knob_value(opts) or "default" for _, opts in choice.picks],
                 "summary": choice.summary()}
    print(f"d={d}: {choice.summary()}", flush=True)
    return choice


def _case_inputs(d, batch, ctx, store):
    paged = scenario.paged_layout([ctx] * batch, PAGE, batch + ctx, spare_pages=0, device=DEVICE)
    hot_per_req = min(ctx, SINK + RECENT)
    st = with_hot(store, batch * hot_per_req)
    scenario.assign_hot(st, paged, SINK, RECENT)
    q = torch.randn(batch, KV_HEADS * GQA, d, device=DEVICE, dtype=torch.bfloat16)
    return paged, hot_per_req, st, q


def decode_case(d, batch, ctx, scale, store, k4, kb, vb, flat_k, flat_v, rot, sdpa, fi,
                problems, served=None) -> tuple[dict, dict]:
    """INT2, INT4-K, Triton BF16 and SDPA on one case: the row, and what the FlashInfer pass needs.  The INT2
    and INT4-K decodes run with the options a server's startup timing chose for this batch (``served``, the
    ``Choice`` of :func:`served_loop`); where those are not the defaults the default loop is timed too
    (``int2_default_ms``)."""
    served = served.options_for(batch) if served is not None else {}
    paged, hot_per_req, st, q = _case_inputs(d, batch, ctx, store)
    targs = (paged.req_to_token, paged.req_pool_indices, paged.seq_lens, scale)
    row = {"d": d, "gqa": GQA, "q_heads": KV_HEADS * GQA, "kv_heads": KV_HEADS, "batch": batch, "context": ctx,
           "bf16_kv_GiB": kv_bytes(batch, ctx, d) / 2**30, "hot_per_request": hot_per_req}
    where = f"d={d} batch={batch} ctx={ctx}"

    row["int2_loop"] = autotune.knob_value(served) or "default"
    cut = {"hot_windows": (SINK, RECENT)}  # the hot rows' windows, as a server passes them: splits cut by work
    grid: dict = {}  # the served loop's split count and where it rotates the queries, as the launch chose them
    decode_tk.decode_attention(q, st, rot, *targs, max_seq_len=ctx, report=grid, **served, **cut)
    row["splits"] = grid["splits"]
    in_kernel = grid["rotate_q_in_kernel"]

    def int2(other_q_rot=False):  # the served loop; with other_q_rot, the queries rotated where it does not
        return decode_tk.decode_attention(q, st, rot, *targs, max_seq_len=ctx, **served, **cut,
                                          **({"rotate_q_in_kernel": not in_kernel} if other_q_rot else {}))

    row["int2_ms"] = timed(int2)
    if served:
        row["int2_default_ms"] = timed(lambda: decode_tk.decode_attention(q, st, rot, *targs, max_seq_len=ctx,
                                                                          **cut))
    # where the queries are rotated: the automatic choice (timed above) against the other one
    row["q_rot"] = "kernel" if in_kernel else "launch"
    row["int2_other_q_rot_ms"] = timed(lambda: int2(other_q_rot=True))
    st4 = with_keys(st, k4)  # the same tokens, hot rows and values; INT4 keys
    row["int4k_ms"] = timed(lambda: decode_tk.decode_attention(q, st4, rot, *targs, max_seq_len=ctx, **served,
                                                               **cut))

    def tbf16():
        return bf16_baseline.decode_attention_bf16(q, kb, vb, *targs, max_seq_len=ctx)

    ref = tbf16()
    row["triton_bf16_ms"] = timed(tbf16)

    lens = [ctx] * batch
    rows_r2t = paged.req_to_token[paged.req_pool_indices]  # [batch, max_context] token -> slot
    k_d = v_d = None
    try:  # SDPA over a dense contiguous copy of the same K/V
        k_d, v_d = bl.dense_cache(kb, vb, rows_r2t, lens, flat_k, flat_v)
        backend, runs = sdpa.prepare(q, k_d, v_d, scale)
        forms = {}
        with sdpa_kernel(backend):
            for label, fn, out in runs:  # every form that runs (enable_gqa, packed): the fastest is kept
                forms[label] = {"ms": timed(fn), "rel_err": rel_err(out, ref)}
        label = min(forms, key=lambda f: forms[f]["ms"])
        row.update(sdpa_backend=label, sdpa_ms=forms[label]["ms"], sdpa_forms=forms,
                   sdpa_rel_err=max(f["rel_err"] for f in forms.values()))
    except Exception as e:  # noqa: BLE001 - recorded per row
        row["sdpa_ms"], row["sdpa_note"] = None, f"failed: {type(e).__name__}: {str(e)[:300]}"
        problems.append(f"{where}: sdpa {row['sdpa_note']}")

    table = bl.page_table(rows_r2t, lens, PAGE) if (fi.status == "ok" or SMOKE) else None
    if SMOKE:  # fp32 torch references: the Triton BF16 output, both SDPA forms, the FlashInfer page table
        k_d, v_d = bl.dense_cache(kb, vb, rows_r2t, lens, flat_k, flat_v)
        exact = bl.attention_ref(q, k_d, v_d, scale)
        row["smoke_triton_bf16_vs_fp32"] = rel_err(ref, exact)
        for form, run in bl.SDPA_FORMS.items():
            row[f"smoke_sdpa_{form}_vs_fp32"] = rel_err(run(q, k_d, v_d, scale), exact)
        kp, vp = kb.view(-1, PAGE, KV_HEADS, d), vb.view(-1, PAGE, KV_HEADS, d)
        row["smoke_page_table_vs_fp32"] = rel_err(bl.paged_decode_torch(q, kp, vp, *table, scale), exact)
        for key in [k for k in row if k.startswith("smoke_")]:
            if not row[key] < TOL_BASELINE:
                problems.append(f"{where}: {key} = {row[key]:.2e} > {TOL_BASELINE}")
    if DEVICE.type == "cuda" and (batch, ctx) in GRAPH_CASES:
        fns = {"int2": int2, "int2_other_q_rot": lambda: int2(other_q_rot=True), "triton_bf16": tbf16}
        if row.get("sdpa_ms") is not None:
            fns["sdpa"] = bl.in_backend(backend, next(fn for form, fn, _ in runs if form == row["sdpa_backend"]))
        row["graph"] = bl.graph_times(fns, timed)
        if batch == 1:  # goal 2's shape: which kernels the eager decodes are made of, and their device time
            row["launches"] = bl.launch_times({n: fns[n] for n in ("int2", "triton_bf16", "sdpa") if n in fns})
    err = row.get("sdpa_rel_err")
    if err is not None and not err < TOL_BASELINE:
        problems.append(f"{where}: sdpa differs from triton_bf16 by {err:.2e} (relative) > {TOL_BASELINE}")
    print(f"decode {where}: int2 {row['int2_ms']:.3f} ms, int4k {row['int4k_ms']:.3f} ms, "
          f"triton_bf16 {row['triton_bf16_ms']:.3f} ms, "
          f"sdpa {row['sdpa_ms'] if row['sdpa_ms'] is None else round(row['sdpa_ms'], 3)} ms "
          f"[{row.get('sdpa_backend', '-')}]", flush=True)
    return row, {"q": q, "ref": ref, "table": table}


def flashinfer_pass(d, scale, kb, vb, done, fi, problems) -> None:
    """FlashInfer on every case of this head_dim, over the Triton BF16 baseline's paged buffers."""
    if not done:
        return
    reason = fi.setup(d, DEVICE)
    print(f"flashinfer d={d}: " + (f"ready (warm-up child done within {fi.warmup_s.get(d)} s of its start, "
                                    f"in-process load {fi.load_s.get(d)} s)"
                                   if reason is None else reason), flush=True)
    for row, keep in done:
        where = f"d={d} batch={row['batch']} ctx={row['context']}"
        if reason is not None:
            row["flashinfer_ms"], row["flashinfer_note"] = None, reason
            continue
        if time.time() - START > ARGS.budget_s:
            row["flashinfer_ms"], row["flashinfer_note"] = None, f"time budget --budget-s {ARGS.budget_s:g} s spent"
            continue
        try:
            fn = fi.prepare(d, keep["q"], kb, vb, *keep["table"], scale)
            row["flashinfer_rel_err"] = rel_err(fn(), keep["ref"])
            row["flashinfer_ms"] = timed(fn)
            print(f"flashinfer {where}: {row['flashinfer_ms']:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded per row
            row["flashinfer_ms"], row["flashinfer_note"] = None, f"failed: {type(e).__name__}: {str(e)[:300]}"
            problems.append(f"{where}: flashinfer {row['flashinfer_note']}")
            continue
        if not row["flashinfer_rel_err"] < TOL_BASELINE:
            problems.append(f"{where}: flashinfer differs from triton_bf16 by {row['flashinfer_rel_err']:.2e} "
                            f"(relative) > {TOL_BASELINE}")


def finish_row(row: dict, copy_GBps: float) -> None:
    """Best BF16 baseline, speedups, bytes, bandwidth and its fraction of the copy bandwidth."""
    nbytes = read_bytes(row["batch"], row["context"], row["d"], row["hot_per_request"])
    times = {n: row.get(f"{n}_ms") for n in BASELINES}
    ran = {n: t for n, t in times.items() if t is not None}
    best = min(ran, key=ran.get)
    row.update(best_bf16=best, best_bf16_ms=ran[best], speedup=ran[best] / row["int2_ms"],
               speedup_vs_triton_bf16=row["triton_bf16_ms"] / row["int2_ms"],
               speedup_int4k=ran[best] / row["int4k_ms"])
    for name, t in [("int2", row["int2_ms"]), ("int4k", row["int4k_ms"]), *times.items()]:
        row[f"{name}_MB"] = nbytes[name] / 1e6
        row[f"{name}_GBps"] = nbytes[name] / t / 1e6 if t else None
        row[f"{name}_copy_frac"] = row[f"{name}_GBps"] / copy_GBps if t else None
    print(f"decode d={row['d']} batch={row['batch']} ctx={row['context']}: INT2 {row['int2_ms']:.3f} ms "
          f"({row['int2_copy_frac']:.1%} of copy), INT4-K {row['int4k_ms']:.3f} ms "
          f"({row['int4k_copy_frac']:.1%}), best BF16 {best} {ran[best]:.3f} ms "
          f"({row[f'{best}_copy_frac']:.1%}), speedup x{row['speedup']:.2f}", flush=True)


def tile_sweep(d, batch, ctx, scale, store, kb, vb, rot) -> list[dict]:
    paged, _, st, q = _case_inputs(d, batch, ctx, store)
    targs = (paged.req_to_token, paged.req_pool_indices, paged.seq_lens, scale)
    out = []
    for bn, nw, ns in TUNE_GRID:
        opts = {"block_n": bn, "num_warps": nw, "num_stages": ns}
        r = {"d": d, "gqa": GQA, "batch": batch, "context": ctx, **opts}
        for name, fn in (("int2", lambda: decode_tk.decode_attention(q, st, rot, *targs, max_seq_len=ctx, **opts)),
                         ("triton_bf16", lambda: bf16_baseline.decode_attention_bf16(q, kb, vb, *targs,
                                                                                     max_seq_len=ctx, **opts))):
            try:  # a tile that does not compile or launch (e.g. shared memory) is noted, not fatal
                r[f"{name}_ms"] = timed(fn)
            except Exception as e:  # noqa: BLE001
                r[f"{name}_ms"], r[f"{name}_note"] = None, f"{type(e).__name__}: {str(e)[:200]}"
        out.append(r)
        print(f"tile d={d} batch={batch} ctx={ctx} {opts}: int2 {r['int2_ms']} ms, "
              f"triton bf16 {r['triton_bf16_ms']} ms", flush=True)
    return out


def bench_write() -> list[dict]:
    """Every head size and format at every token count with the default tile (``kc`` 32), then INT2 at d 128 and
    the two largest counts with ``kc`` 16 as well: the tile that does not spill on sm_89 (Triton 3.8) and with
    Triton 3.9, but holds fewer warps on sm_90 with 3.8 (docs/KERNELS.md, "Triton 3.9"); timed beside the
    default so a GPU run decides between them."""
    cases = [(d, name, kf, n, 32) for d in DIMS for name, kf in (("int2", None), ("int4k", INT4_KEYS))
             for n in WRITE_TOKENS]
    cases += [(128, "int2", None, n, 16) for n in WRITE_TOKENS[-2:] if 128 in DIMS]
    rots = {d: scenario.random_rotation(KV_HEADS, d, 0, device=DEVICE) for d in DIMS}
    rows = []
    for d, name, kf, n, kc in cases:
        rot = rots[d]
        store = layout.empty_store(n + 1, KV_HEADS, d, None, n, DEVICE, k_format=kf)
        k, v = scenario.random_kv(n, KV_HEADS, d, 0, DEVICE)
        slots = torch.randperm(n, device=DEVICE) + 1
        hot_loc = torch.arange(n, device=DEVICE)
        t = timed(lambda: write_tk.write_kv(k, v, slots, store, rot, hot_loc, kc=kc))
        rows_out = store.k_format.bytes_per_row(d) + store.v_format.bytes_per_row(d)
        moved = n * KV_HEADS * (2 * 2 * d + rows_out + 2 * 2 * d)  # read bf16, write rows + hot
        rows.append({"d": d, "formats": name, "tokens": n, "kc": kc, "ms": t, "tokens_per_s": n / t * 1e3,
                     "GBps": moved / t / 1e6})
        print(f"write d={d} {name} n={n} kc={kc}: {t:.3f} ms", flush=True)
    return rows


def _ms(r: dict, name: str) -> str:
    t = r.get(f"{name}_ms")
    if t is None:
        return "n/a"
    return f"**{t:.3f}**" if r.get("best_bf16") == name else f"{t:.3f}"


def _pct(r: dict, name: str) -> str:
    f = r.get(f"{name}_copy_frac")
    return "n/a" if f is None else f"{100 * f:.3g}%"


def markdown(meta: dict, check: dict, copy: dict, decode: list[dict], skipped: list[dict], tuning: list[dict],
             write: list[dict], problems: list[str]) -> str:
    lines = [f"# Kernel benchmark ({meta['mode']})", "",
             f"- Date {meta['date']}; device {meta['device']}; torch {meta['torch']} (CUDA {meta['cuda']}), "
             f"triton {meta['triton']}, flashinfer {meta['flashinfer']}; Python {meta['python']}.",
             f"- Command: `{meta['command']}` ({meta['seconds']} s).",
             f"- Decode: {meta['q_heads']} query heads / {meta['kv_heads']} KV heads (GQA {meta['gqa']}:1), bf16 "
             f"query, one token per request; INT2 store with sink {meta['sink']} + recent {meta['recent']} hot "
             f"per request, pages of {PAGE} slots in random order. Timing: {meta['timing']}.",
             f"- **Copy bandwidth (measured in this run, the ceiling)**: `dst.copy_(src)` of "
             f"{copy['buffer_bytes'] / 2**30:.3g} GiB on {copy['device']}: {copy['ms']:.3f} ms = "
             f"**{copy['GBps_read_plus_write']:.0f} GB/s counting bytes read + written** "
             f"({copy['GBps_read_only']:.0f} GB/s of reads alone).",
             "- BF16 baselines: Triton BF16 = our split-K decode over the same paged layout; SDPA = torch "
             "scaled_dot_product_attention over a dense contiguous [batch, kv_heads, ctx, d] cache, the first of "
             "flash / efficient / cuDNN that runs, every form that runs timed and the fastest shown (`enable_gqa` = "
             "enable_gqa=True, `packed` = the GQA heads passed as query rows of their KV head); "
             "FlashInfer = BatchDecodeWithPagedKVCacheWrapper (NHD, page 16, tensor cores "
             f"{ARGS.flashinfer_tensor_cores}) over the Triton BF16 baseline's own paged buffers: "
             f"{meta['flashinfer_status']}.",
             f"- SDPA backends that refused: {'; '.join(meta['sdpa_refused']) or 'none'}.",
             f"- Correctness (INT2 and INT4-K stores, the worse of the two): write code mismatch fraction "
             f"{check['write_code_mismatch_fraction']:.2e}, decode max abs error vs torch reference "
             f"{check['decode_max_abs_err']:.2e}; baseline outputs vs Triton BF16, "
             f"max relative difference over all cases: " + ", ".join(
                 f"{LABEL[n]} {max(es):.1e}" for n in ("sdpa", "flashinfer")
                 if (es := [r[f'{n}_rel_err'] for r in decode if r.get(f'{n}_rel_err') is not None])) + ".", ""]
    if SMOKE:
        lines += ["**CPU smoke: Triton interpreter, SDPA math backend, copy on the CPU. These numbers only show that "
                  "the benchmark runs and that the outputs agree with fp32 references; they say nothing about GPU "
                  "speed.**", ""]
    if problems:
        lines += ["**Problems:**", ""] + [f"- {p}" for p in problems] + [""]
    served = meta.get("served_decode") or {}
    lines += ["## Decode time (ms; bold = fastest BF16)", "",
              "speedup = fastest BF16 / INT2; INT4-K = the same kernel with INT4 keys (one group per row) and "
              "INT2 values, its speedup likewise.", ""]
    if served:  # the INT2 columns are the loop a server's startup timing chose on this device
        lines += ["INT2 and INT4-K: the decode loop as a server serves it on this device, chosen by its startup "
                  "timing (`kernels/decode/autotune.py`) per head size: "
                  + "; ".join(f"d={d}: " + ", ".join(f"b{b} x {n} `{k}`" for (b, n), k in zip(c["cases"], c["knobs"]))
                              + f" ({c['summary']})" for d, c in sorted(served.items()))
                  + " (a batch runs with the pick of the case nearest its size)"
                  + ". The default loop's time where that is another: "
                  + (", ".join(f"d{r['d']} b{r['batch']} {r['context']}: {r['int2_default_ms']:.3f}"
                               for r in decode if r.get("int2_default_ms") is not None) or "none") + ".", ""]
    lines += ["| d | batch | context | BF16 K+V GiB | splits | INT2 | INT4-K | Triton BF16 | SDPA | SDPA backend "
              "| FlashInfer | speedup | INT4-K speedup | vs Triton BF16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['d']} | {r['batch']} | {r['context']} | {r['bf16_kv_GiB']:.3g} | {r['splits']} | "
                     f"{r['int2_ms']:.3f} | {r['int4k_ms']:.3f} | {_ms(r, 'triton_bf16')} | {_ms(r, 'sdpa')} | "
                     f"{r.get('sdpa_backend', 'n/a')} | {_ms(r, 'flashinfer')} | {r['speedup']:.2f} | "
                     f"{r['speedup_int4k']:.2f} | {r['speedup_vs_triton_bf16']:.2f} |")
    lines += ["", "## Decode bandwidth as a fraction of the measured copy bandwidth", "",
              "% copy = (bytes the kernel must read / its time) / (copy bytes read + written / copy time), "
              f"copy = {copy['GBps_read_plus_write']:.0f} GB/s. Bytes: INT2 = codes + scales/zeros + hot BF16 rows + "
              "req_to_token + hot_index (INT4-K likewise, with INT4 key codes); BF16 = K + V (+ slot table for "
              "Triton BF16, + page indices for FlashInfer).",
              "", "| d | batch | context | INT2 MB | INT4-K MB | BF16 MB | INT2 GB/s | INT2 % copy | INT4-K % copy | "
              "Triton BF16 % copy | SDPA % copy | FlashInfer % copy |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['d']} | {r['batch']} | {r['context']} | {r['int2_MB']:.4g} | {r['int4k_MB']:.4g} | "
                     f"{r['sdpa_MB']:.4g} | {r['int2_GBps']:.4g} | {_pct(r, 'int2')} | {_pct(r, 'int4k')} | "
                     f"{_pct(r, 'triton_bf16')} | {_pct(r, 'sdpa')} | "
                     f"{_pct(r, 'flashinfer')} |")
    lines += bl.graph_lines(decode)
    lines += bl.launch_lines(decode)
    lines += ["", "## Where the queries are rotated (INT2 decode)", "",
              "The automatic choice rotates them inside the split kernel (2 launches per layer) when its grid is "
              f"at most {decode_tk.ROTATE_IN_KERNEL_WAVES} programs per multiprocessor, else before it by a "
              "launch of its own (3 launches, fewer registers; until 2026-12-05 in torch, 6); the INT2 columns "
              "above are the automatic choice. other / chosen > 1: the choice was the faster one.", "",
              "| d | batch | context | splits | chosen | INT2 ms, chosen | INT2 ms, other | other / chosen |",
              "|---|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['d']} | {r['batch']} | {r['context']} | {r['splits']} | {r['q_rot']} | "
                     f"{r['int2_ms']:.3f} | {r['int2_other_q_rot_ms']:.3f} | "
                     f"{r['int2_other_q_rot_ms'] / r['int2_ms']:.2f} |")
    if skipped:
        lines += ["", "## Skipped decode cases", "", "| d | batch | context | reason |", "|---|---|---|---|"]
        lines += [f"| {s['d']} | {s['batch']} | {s['context']} | {s['reason']} |" for s in skipped]
    if tuning:
        bn, nw, ns = TUNE_GRID[0]
        lines += ["", f"## Decode tile sweep (default: block_n {bn}, num_warps {nw}, num_stages {ns})", "",
                  "| d | batch | context | block_n | num_warps | num_stages | INT2 ms | Triton BF16 ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in tuning:
            lines.append(f"| {r['d']} | {r['batch']} | {r['context']} | {r['block_n']} | {r['num_warps']} | "
                         f"{r['num_stages']} | {_ms(r, 'int2')} | {_ms(r, 'triton_bf16')} |")
    lines += ["", "## Write kernel (one layer, K and V, every token also hot)", "",
              "| d | formats | tokens | KC (channels a dot step) | ms | tokens/s | GB/s moved |",
              "|---|---|---|---|---|---|---|"]
    for r in write:
        lines.append(f"| {r['d']} | {LABEL[r['formats']]} | {r['tokens']} | {r['kc']} | {r['ms']:.3f} | "
                     f"{r['tokens_per_s']:.3g} | {r['GBps']:.3g} |")
    return "\n".join(lines) + "\n"


STYLE = {"int2": ("-", "o"), "int4k": ("-", "d"), "triton_bf16": ("--", "x"), "sdpa": (":", "^"),
         "flashinfer": ("-.", "s")}


def plot(decode: list[dict], path: Path) -> None:
    """Per batch (rows) and head_dim: time vs context, and % of copy bandwidth vs context, every kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = [d for d in DIMS if any(r["d"] == d for r in decode)] or DIMS
    fig, axes = plt.subplots(len(BATCHES), 2 * len(dims), figsize=(4.3 * 2 * len(dims), 3.0 * len(BATCHES)),
                             squeeze=False)
    for i, batch in enumerate(BATCHES):
        for j, d in enumerate(dims):
            rs = [r for r in decode if r["d"] == d and r["batch"] == batch]
            ax_t, ax_f = axes[i, 2 * j], axes[i, 2 * j + 1]
            for name, (ls, mk) in STYLE.items():
                pts = [(r["context"], r[f"{name}_ms"], r[f"{name}_copy_frac"]) for r in rs
                       if r.get(f"{name}_ms") is not None]
                if not pts:
                    continue
                x, t, f = zip(*pts)
                ax_t.plot(x, t, ls=ls, marker=mk, label=LABEL[name])
                ax_f.plot(x, [100 * v for v in f], ls=ls, marker=mk, label=LABEL[name])
            ax_t.set_title(f"d={d}, batch {batch}: time (ms)", fontsize=9)
            ax_f.set_title(f"d={d}, batch {batch}: % of copy bandwidth", fontsize=9)
            ax_t.set_yscale("log")
            ax_f.set_ylim(bottom=0)
            for ax in (ax_t, ax_f):
                ax.set_xscale("log", base=2)
                ax.grid(alpha=0.3)
                if i == len(BATCHES) - 1:
                    ax.set_xlabel("context (tokens)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"INT2 and INT4-K vs BF16 decode, GQA {GQA}:1, {KV_HEADS} KV heads"
                 + (" - INTERPRETER, not GPU speed" if SMOKE else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    problems: list[str] = []
    meta = {"mode": "CPU smoke, Triton interpreter" if SMOKE else "GPU",
            "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "device": "CPU (interpreter)" if SMOKE else torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(), "kv_heads": KV_HEADS, "gqa": GQA, "q_heads": KV_HEADS * GQA,
            "sink": SINK, "recent": RECENT, "page": PAGE, "max_gib": ARGS.max_gib,
            "command": shlex.join([sys.executable, *sys.argv]),
            "decode_default_tile": dict(zip(("block_n", "num_warps", "num_stages"), TUNE_GRID[0])),
            "timing": ("wall clock, one call" if SMOKE else
                       f"triton.testing.do_bench, median, warmup {ARGS.warmup:g} ms, rep {ARGS.rep:g} ms, "
                       "L2 flushed between calls, eager launches (no CUDA graphs)")}
    fi = bl.FlashInferDecode(DEVICE.type == "cuda" or ARGS.flashinfer_on_cpu, KV_HEADS, GQA,
                             ARGS.flashinfer_tensor_cores == "on", ARGS.flashinfer_timeout,
                             disabled=ARGS.no_flashinfer, child_device=DEVICE.type)
    fi.start(DIMS)  # JIT builds in child processes while everything else runs
    check = check_correctness()
    print("check:", check, flush=True)
    decode_tol = 1e-3 if SMOKE else 5e-2  # TF32 dots on the GPU
    if not (check["write_code_mismatch_fraction"] < 1e-3 and check["decode_max_abs_err"] < decode_tol):
        problems.append(f"Triton vs torch reference check failed: {check}")
    t0 = time.time()
    copy = bl.copy_bandwidth(timed, DEVICE, COPY_BYTES)
    if not copy["copy_verified"]:
        problems.append("the copy-bandwidth copy did not copy")
    print(f"copy {copy['buffer_bytes'] / 2**30:.3g} GiB on {DEVICE}: {copy['ms']:.3f} ms, "
          f"{copy['GBps_read_plus_write']:.0f} GB/s read+write ({time.time() - t0:.1f} s)", flush=True)
    sdpa = bl.Sdpa(on_cuda=DEVICE.type == "cuda")
    t0 = time.time()
    decode, skipped, tuning, write = [], [], [], []
    try:  # a crash still leaves the rows so far in the outputs (and exit code 1)
        bench_decode(copy["GBps_read_plus_write"], sdpa, fi, problems, decode, skipped, tuning)
    except Exception:  # noqa: BLE001
        problems.append("decode benchmark crashed: " + traceback.format_exc(limit=4).replace("\n", " | "))
        print(traceback.format_exc(), file=sys.stderr)
    finally:
        fi.close()
    meta["decode_seconds"] = round(time.time() - t0, 1)
    meta["served_decode"] = SERVED
    meta["sdpa_refused"] = sdpa.refused
    meta["flashinfer"] = fi.version or "-"
    meta["flashinfer_status"] = (
        fi.status if fi.status != "ok" else
        "; ".join([f"d={d}: ready (warm-up child done within {fi.warmup_s.get(d)} s of its start, "
                   f"in-process load {fi.load_s.get(d)} s)" for d in fi.ready]
                  + [f"d={d}: {r}" for d, r in fi.reason.items()]) or "not needed")
    meta["flashinfer_warmup_s"] = fi.warmup_s
    meta["flashinfer_warmup_log"] = fi.warmup_log
    ARGS.out.mkdir(parents=True, exist_ok=True)
    stem = ARGS.out / ("bench_kernels_cpu_smoke" if SMOKE else "bench_kernels")
    hot_update, extend = [], None
    to_come = ["write", "hot_update", "extend"]

    def save() -> None:
        """The report as it stands: written after every section, so a step cut by its time limit keeps the
        sections done (the decode goals first)."""
        meta["seconds"] = round(time.time() - START, 1)
        meta["sections_to_come"] = list(to_come)
        sections = bench_hot_update.markdown(hot_update) + bench_extend.markdown(extend)
        if to_come:
            sections += ["", f"**Written before the sections {', '.join(to_come)} ran ({meta['seconds']} s in).**"]
        stem.with_suffix(".md").write_text(markdown(meta, check, copy, decode, skipped, tuning, write, problems)
                                           + "\n".join(sections) + "\n")
        stem.with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "check": check, "copy": copy, "decode": decode, "skipped": skipped, "tuning": tuning,
             "write": write, "hot_update": hot_update, "extend": extend, "problems": problems}, indent=1))

    save()
    plot(decode, stem.with_suffix(".png"))

    def section(name: str, label: str, run) -> None:
        """One section after the decode goals: timed, a crash kept as a problem, the report saved after it."""
        t0 = time.time()
        try:
            run()
        except Exception:  # noqa: BLE001
            problems.append(f"{label} benchmark crashed: " + traceback.format_exc(limit=4).replace("\n", " | "))
            print(traceback.format_exc(), file=sys.stderr)
        meta[f"{name}_seconds"] = round(time.time() - t0, 1)
        to_come.remove(name)
        save()

    def run_extend() -> None:
        nonlocal extend
        extend = bench_extend.measure(DEVICE, timed, SMOKE, budget_s=ARGS.extend_budget_s)
        problems.extend(f"prefill: {p}" for p in extend["problems"])

    section("write", "write", lambda: write.extend(bench_write()))
    section("hot_update", "hot update", lambda: hot_update.extend(bench_hot_update.measure(DEVICE, timed, SMOKE)))
    section("extend", "prefill", run_extend)
    print(f"wrote {stem}.md/.json/.png in {meta['seconds']} s")
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
