"""Per-pass attention metadata time vs batch (CPU): the oscar_int2 backend, old and new, beside SGLang's triton backend.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_host_overhead.py      # writes docs/host_overhead.{md,json}

Decode passes, ``--seq-min``..``--seq-max`` tokens per request (default
2048..4096), sink 64 / recent 256, batches 1 8 32 128 256 512.  Per batch, a
pool is prefilled once (every request's windows hot, the hot pool sized for
the batch: ``--oscar-hot-requests = batch``), then each timed pass is one
decode step of every request.  Timed, per pass (median of ``--passes``):

* **ours, new**: ``OscarInt2AttnBackend.init_forward_metadata`` (the real
  backend on a real ``OscarInt2Pool``, one layer) with a decode
  ``forward_batch``: ``pool.begin_pass`` = vectorised ``window_plan`` +
  ``HotSet.update``, with the pool attached to the request rows as the
  server attaches it (request lengths tracked, every live request's window
  re-pinned each pass: work over ``rows x (sink + recent)``, here
  ``rows = batch``).
* **ours, old**: what ``init_forward_metadata`` did before: the host lists
  (``seq_lens_cpu.tolist()``, ``prefix = seq - 1``), the per-request Python
  ``window_plan`` and the ``nonzero``/boolean-mask ``HotSet``
  (``tests/hot_reference.py``, the test oracle, without the re-pin it
  learned on 2026-12-02; in these passes every live request is in the
  batch, so the re-pin changes no stamp and both end in the same state,
  checked), from the same state.
* **SGLang triton**: the tensor work of ``TritonAttnBackend.init_forward_metadata``
  (``sglang/srt/layers/attention/triton_backend.py``, decode, no
  speculative decoding / DCP / sliding window).  Its metadata path launches
  two Triton kernels (``create_flashinfer_kv_indices_triton``, the
  ``req_to_token`` gather into ``kv_indices``, and ``get_num_kv_splits_triton``)
  that cannot run on CPU tensors except in Triton's interpreter, so this
  times the same work in torch: ``kv_indices = empty(seq_lens_sum)``,
  ``kv_indptr[1:] = cumsum(seq_lens)``, the ragged gather of every request's
  ``req_to_token[row, :seq]`` into ``kv_indices`` (searchsorted + index), the
  ``attn_logits``/``attn_lse``/``num_kv_splits``/``uneven_batch`` and four
  lean-decode buffers (SGLang's shapes: 32 query heads, 8 KV splits,
  v_head_dim 128), the split count (``clamp(ceil(seq / 256), 1, 8)`` in torch
  for the kernel) and the metadata record.

"ops" = aten ops dispatched per pass that are not views (counted with a
``TorchDispatchMode``; for SGLang, the torch ops of the real path plus its 2
Triton launches, not the ops of the stand-ins): on a GPU each is a kernel
launch or an allocation, which is what the host pays per pass there.  On CPU the time
also includes the tensor work itself (the gather of ``sum(seq)`` indices
dominates SGLang's at large batch; ours touches ``batch * (sink + recent)``
window entries).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from hot_reference import RefHotSet  # noqa: E402  (the old implementation, kept as the test oracle)

from oscar_sglang import artifacts as art  # noqa: E402

HEAD_DIM, GROUP = 64, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 256, 512])
    p.add_argument("--seq-min", type=int, default=2048)
    p.add_argument("--seq-max", type=int, default=4096)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--passes", type=int, default=30, help="timed decode passes per batch (default 30)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="output folder (default docs/)")
    return p.parse_args(argv)


class OpCount(TorchDispatchMode):
    """Counts the aten ops that are not views (each is a kernel launch or an allocation on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------
# Ours


def _backend(batch: int, num_slots: int, sink: int, recent: int, req_to_token: torch.Tensor):
    from oscar_sglang.sglang.backend import OscarInt2AttnBackend
    from oscar_sglang.sglang.pool import OscarInt2Pool
    from oscar_sglang.sglang.settings import ServingConfig

    fp = art.ModelFingerprint(architecture="LlamaForCausalLM", num_layers=1, hidden_size=HEAD_DIM,
                              num_attention_heads=1, num_kv_heads=1, head_dim=HEAD_DIM, vocab_size=100,
                              rope_type="default", rope_theta=1e4)
    eye = torch.eye(HEAD_DIM).unsqueeze(0)
    layer = art.LayerRotation(eye, eye, torch.zeros(1, HEAD_DIM), torch.ones(1), torch.ones(1))
    cfg = ServingConfig(art.RotationArtifacts(fp, "unit", [layer], sink=sink, recent=recent, group_size=GROUP),
                        sink, recent, hot_requests=batch)
    pool = OscarInt2Pool(num_slots - 1, 1, torch.bfloat16, head_num=1, head_dim=HEAD_DIM, layer_num=1,
                         device="cpu", config=cfg, start_layer=0, end_layer=1)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                             device="cpu")
    pool.attach_requests(runner.req_to_token_pool)      # as the server does: request lengths, re-pinning
    return OscarInt2AttnBackend(runner)


def old_init_forward_metadata(ref: RefHotSet, fb, req_to_token):
    """The decode branch of the earlier ``init_forward_metadata`` + ``pool.begin_pass``."""
    seq = fb.seq_lens_cpu.tolist()
    prefix = [n - 1 for n in seq]
    max_len = max(seq, default=0)
    hot_loc = ref.begin_pass(fb.out_cache_loc, fb.req_pool_indices, prefix, seq, req_to_token, repin=False)
    return hot_loc, max_len


# ---------------------------------------------------------------------------
# SGLang's triton backend, decode metadata, as torch work


@dataclass
class TritonDecodeMetadata:
    attn_logits: torch.Tensor
    attn_lse: torch.Tensor
    num_kv_splits: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    lean: tuple


class TritonLike:
    """The buffers and tensor work of ``TritonAttnBackend.init_forward_metadata`` (decode), on CPU."""

    NUM_HEAD, MAX_KV_SPLITS, V_HEAD_DIM, LEAN_PROGRAMS, LEAN_BLOCK_M = 32, 8, 128, 132, 16

    def __init__(self, max_bs: int, req_to_token: torch.Tensor):
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32)
        self.req_to_token = req_to_token

    def real_ops(self, fb):
        """The torch ops SGLang's path runs itself (allocations, cumsum); returns what the kernels fill."""
        bs = fb.batch_size
        kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int64)
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1:] = torch.cumsum(fb.seq_lens, dim=0)
        attn_logits = torch.empty((bs, self.NUM_HEAD, self.MAX_KV_SPLITS, self.V_HEAD_DIM), dtype=torch.float32)
        attn_lse = torch.empty((bs, self.NUM_HEAD, self.MAX_KV_SPLITS), dtype=torch.float32)
        num_kv_splits = torch.empty((bs,), dtype=torch.int32)
        uneven_batch = torch.zeros((1,), dtype=torch.int32)
        lean = (torch.empty((self.LEAN_PROGRAMS, self.LEAN_BLOCK_M), dtype=torch.float32),
                torch.empty((self.LEAN_PROGRAMS, self.LEAN_BLOCK_M), dtype=torch.float32),
                torch.empty((self.LEAN_PROGRAMS, self.LEAN_BLOCK_M, self.V_HEAD_DIM), dtype=torch.float32),
                torch.zeros((self.LEAN_PROGRAMS,), dtype=torch.int32))
        return kv_indices, kv_indptr, attn_logits, attn_lse, num_kv_splits, uneven_batch, lean

    def kernels(self, fb, kv_indices, kv_indptr, num_kv_splits):
        """Stand-ins for ``create_flashinfer_kv_indices_triton`` and ``get_num_kv_splits_triton``."""
        total = kv_indices.numel()
        token = torch.arange(total)
        req = torch.searchsorted(kv_indptr[1:], token.to(torch.int32), right=True)
        col = token - kv_indptr.index_select(0, req)
        rows = fb.req_pool_indices.index_select(0, req)
        kv_indices.copy_(self.req_to_token[rows, col])
        num_kv_splits.copy_(torch.clamp((fb.seq_lens + 255) // 256, 1, self.MAX_KV_SPLITS))

    def init_forward_metadata(self, fb):
        kv_indices, kv_indptr, attn_logits, attn_lse, num_kv_splits, _, lean = self.real_ops(fb)
        self.kernels(fb, kv_indices, kv_indptr, num_kv_splits)
        return TritonDecodeMetadata(attn_logits, attn_lse, num_kv_splits, kv_indptr, kv_indices, lean)


# ---------------------------------------------------------------------------


def _time(fn, passes: int, warmup: int) -> tuple[float, list[float]]:
    times = []
    for i in range(warmup + passes):
        t0 = time.perf_counter()
        fn(i)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt * 1e6)
    return statistics.median(times), times


@contextlib.contextmanager
def _launches_as_on_cuda(hot):
    """What a CUDA decode pass launches: the fused decode pass (``kernels/hot_pass``), its Triton kernels
    (and the re-pin's) counted as one launch each instead of run, its torch ops (the regions' ``topk``) run."""
    from oscar_sglang.kernels import api
    from oscar_sglang.kernels.hot_pass import triton_kernel as hot_pass
    from oscar_sglang.kernels.repin import triton_kernel as repin

    launches = [0]

    class Launch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[0] += 1
            return launch

    saved = [(m, n, getattr(m, n)) for m, n in ((hot_pass, "_release_retire_track"), (hot_pass, "_assign"),
                                                 (repin, "_repin_kernel"), (api, "hot_decode_pass"))]
    for m, n, _ in saved[:3]:
        setattr(m, n, Launch())
    api.hot_decode_pass = lambda hs, loc, rows, seq, r2t, live, repin_fn: hot_pass.decode_pass(
        hs, loc, rows, seq, r2t, live, lambda: repin.repin_windows(hs._stamp, hs._hot_index, hs._req_len,
                                                                   hs._req_pass, r2t, hs.sink, hs.recent))
    backend = hot.kernel_backend
    hot.kernel_backend = "triton"
    try:
        yield launches
    finally:
        hot.kernel_backend = backend
        for m, n, real in saved:
            setattr(m, n, real)


def bench_batch(batch: int, args) -> dict:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(batch)
    steps = args.warmup + args.passes + 1
    seq0 = torch.randint(args.seq_min, args.seq_max + 1, (batch,), generator=g)
    width = args.seq_max + steps + 1
    # request b's position p lives in slot 1 + b * width + p (slot 0: SGLang's padding slot)
    num_slots = 1 + batch * width
    req_to_token = (1 + torch.arange(batch).unsqueeze(1) * width + torch.arange(width)).to(torch.int32)
    rows = torch.arange(batch, dtype=torch.int64)
    backend = _backend(batch, num_slots, args.sink, args.recent, req_to_token)
    hot = backend.pool.hot
    # prefill every request (vectorised path), then the old implementation starts from the same state
    prefill = torch.cat([req_to_token[b, :int(seq0[b])] for b in range(batch)]).long()
    hot.begin_pass(prefill, rows, torch.zeros(batch, dtype=torch.int64), seq0, req_to_token)
    ref = RefHotSet(num_slots, hot._sink_region.size, hot._recent_region.size, args.sink, args.recent)
    ref.hot_index.copy_(hot.hot_index), ref.owner.copy_(hot.owner), ref.stamp.copy_(hot.stamp)
    ref.clock = hot.clock
    triton = TritonLike(batch, req_to_token)

    def decode_batch(step: int):
        seq = seq0 + 1 + step
        loc = req_to_token[rows, seq - 1].long()
        return SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=batch, out_cache_loc=loc,
                               req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq.clone(),
                               seq_lens_sum=int(seq.sum()))

    batches = [decode_batch(i) for i in range(steps)]
    # the same pass through both implementations leaves the same state (checked once, untimed)
    backend.init_forward_metadata(batches[0])
    want, _ = old_init_forward_metadata(ref, batches[0], req_to_token)
    assert torch.equal(backend.forward_metadata.hot_loc, want) and torch.equal(hot.stamp, ref.stamp)
    assert torch.equal(hot.hot_index, ref.hot_index) and torch.equal(hot.owner, ref.owner)
    assert int((want >= 0).sum()) == batch, "every new token is hot (the regions fit the batch)"

    new_us, _ = _time(lambda i: backend.init_forward_metadata(batches[1 + i]), args.passes, args.warmup)
    old_us, _ = _time(lambda i: old_init_forward_metadata(ref, batches[1 + i], req_to_token), args.passes,
                      args.warmup)
    triton_us, _ = _time(lambda i: triton.init_forward_metadata(batches[1 + i]), args.passes, args.warmup)
    assert torch.equal(hot.stamp, ref.stamp) and torch.equal(hot.hot_index, ref.hot_index)

    count = OpCount()
    with count:
        backend.init_forward_metadata(batches[-1])
    new_ops = count.n
    count = OpCount()
    with count, _launches_as_on_cuda(hot) as launches:
        backend.init_forward_metadata(batches[-1])         # last pass: the stubs leave the state as it is
    gpu_launches = count.n + launches[0]
    count = OpCount()
    with count:
        old_init_forward_metadata(ref, batches[-1], req_to_token)
    old_ops = count.n
    count = OpCount()
    with count:
        triton.real_ops(batches[-1])
    triton_ops = count.n + 2
    return dict(batch=batch, mean_seq=float(seq0.float().mean()), hot_entries=hot.entries,
                new_us=new_us, old_us=old_us, triton_us=triton_us, new_ops=new_ops, new_gpu_launches=gpu_launches,
                old_ops=old_ops,
                triton_ops=triton_ops, new_over_triton=new_us / triton_us, old_over_new=old_us / new_us)


def write_report(rows: list[dict], args, out: Path) -> None:
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_host_overhead.py " + " ".join(sys.argv[1:])
    meta = dict(date=datetime.date.today().isoformat(), command=cmd.strip(), torch=torch.__version__,
                threads=torch.get_num_threads(), machine=f"{platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} CPUs", sink=args.sink, recent=args.recent,
                seq_range=[args.seq_min, args.seq_max], passes=args.passes,
                load_average=[round(x, 2) for x in os.getloadavg()])
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_overhead.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = [
        "# Per-pass attention metadata on the host (CPU)",
        "",
        f"`{meta['command']}` ({meta['date']}, torch {meta['torch']}, {meta['threads']} thread, "
        f"{meta['machine']}, load average {meta['load_average'][0]} at the end: a shared machine, "
        "so compare within a row).",
        "",
        f"Decode passes, {args.seq_min}..{args.seq_max} tokens per request, sink {args.sink} / recent "
        f"{args.recent}, hot pool sized for the batch; median of {args.passes} passes. What is timed: see "
        "the docstring of `scripts/bench_host_overhead.py` (SGLang's triton backend: its decode "
        "`init_forward_metadata` tensor work with its two Triton kernels done in torch). "
        "ops = aten ops per pass other than views, i.e. kernel launches or allocations on a GPU "
        "(SGLang: its own torch ops + its 2 Triton launches).",
        "",
        "On CPU the times include the tensor work: SGLang's gather of `sum(seq)` KV indices dominates "
        "its column at large batch, ours touches `batch x (sink + recent)` window entries and a "
        "`topk` over the recent region. On a GPU the host cost is about the number of launches instead, "
        "flat in the batch for both: there ours is the larger (the `ops` columns); "
        "`begin_pass` has fixed shapes and no syncs; with decode CUDA graphs it ran eagerly before each replay until 2026-12-03 and is now recorded in the graph (the host launches none of it; docs/SGLANG.md), so these ops are the host cost of extend passes and of eager decode. Since 2026-12-01 it also puts the tokens leaving each window out of window (the pinning rule, docs/SGLANG.md): 69 ops per decode pass instead of 45; since 2026-12-02 the pool is attached to the request rows as in the server (lengths tracked) and every pass re-pins the windows of the live requests (a prefix token shared through a radix hit stays in window while any live request reads it there): 84-86 ops, and on CPU work over `rows x (sink + recent)` (rows = batch here; SGLang's request rows on a server, 2048-4096). Since 2026-12-03 that re-pin's updates of rows without a request no longer all go to one address, and on CUDA a decode pass is the fused one of `kernels/hot_pass` (two Triton kernels, the re-pin kernel and each region's `topk`): `GPU launches new` counts what a CUDA decode pass launches (its Triton kernels stubbed and counted, its torch ops counted); the `ops new` column is the general torch path, what CPU serving and extend passes run.",
        "",
        "| batch | hot entries | ours new (us) | ours old (us) | SGLang triton (us) | new / triton "
        "| old / new | ops new | GPU launches new | ops old | ops triton |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['hot_entries']} | {r['new_us']:.0f} | {r['old_us']:.0f} | "
                     f"{r['triton_us']:.0f} | {r['new_over_triton']:.2f} | {r['old_over_new']:.1f} | "
                     f"{r['new_ops']} | {r['new_gpu_launches']} | {r['old_ops']} | {r['triton_ops']} |")
    (out / "host_overhead.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for batch in args.batch:
        r = bench_batch(batch, args)
        print(f"batch {batch:4d}: new {r['new_us']:8.0f} us  old {r['old_us']:8.0f} us  "
              f"triton {r['triton_us']:8.0f} us  ops {r['new_ops']}/{r['old_ops']}/{r['triton_ops']}", flush=True)
        rows.append(r)
    write_report(rows, args, args.out)
    print(f"wrote {args.out / 'host_overhead.md'} and .json")


if __name__ == "__main__":
    main()
