"""BF16 decode baselines and the copy-bandwidth ceiling for ``scripts/bench_kernels.py`` (benchmark only).

Every baseline answers the same decode problem as the INT2 kernel: one bf16
query token per request, ``q [batch, q_heads, d]``, GQA (query head ``h``
reads KV head ``h // gqa``), all ``context`` tokens of the request attended.

* ``copy_bandwidth``: ``dst.copy_(src)`` of a large buffer; bytes read +
  written / time, the practical memory-bandwidth ceiling of the device.
* ``dense_cache`` / ``Sdpa``: ``torch.nn.functional.scaled_dot_product_attention``
  over a contiguous ``[batch, kv_heads, context, d]`` BF16 cache, one backend
  forced at a time (``FLASH_ATTENTION``, then ``EFFICIENT_ATTENTION``, then
  ``CUDNN_ATTENTION``; ``MATH`` on CPU).  Per backend it tries
  ``enable_gqa=True`` first, then the *packed* form: the ``gqa`` query heads of
  a KV head become ``gqa`` query rows of that head (``q [batch, kv_heads, gqa,
  d]``, no mask), the same result with no K/V expansion.
* ``page_table`` / ``FlashInferDecode``: FlashInfer's
  ``BatchDecodeWithPagedKVCacheWrapper`` (NHD, pages of 16) over the very same
  paged BF16 buffers as the Triton BF16 baseline (``[num_slots, kv_heads, d]``
  viewed as ``[num_pages, 16, kv_heads, d]``).  Only when ``flashinfer`` is
  installed; its JIT build runs in child processes, one per head_dim, started
  early so they build while the other kernels are timed
  (``python scripts/bench_baselines.py --flashinfer-warmup ...``: build, run a
  tiny case, check it against torch).  A child past its time limit is killed
  with its process group (nvcc, ninja); a slow or broken build costs at most
  that limit and is recorded as the reason.
* ``paged_decode_torch``: plain-torch attention that reads K/V through the
  FlashInfer page table; the CPU smoke uses it to check the table.

Importing this module imports torch only (never triton or flashinfer).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

PAGE = 16


# --------------------------------------------------------------------------- timing

def timed_ms(fn: Callable[[], object], smoke: bool, warmup: int = 5, rep: float = 100,
             cpu_runs: int = 2, cpu_warmup: bool = True) -> float:
    """Milliseconds per call of ``fn``: triton's ``do_bench`` median on the GPU (``warmup``, ``rep`` ms);
    with ``smoke`` (CPU, the interpreter) one warm-up call (unless not ``cpu_warmup``), then the best of
    ``cpu_runs`` wall-clock calls."""
    if not smoke:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    if cpu_warmup:
        fn()
    runs = []
    for _ in range(cpu_runs):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return min(runs) * 1e3


# --------------------------------------------------------------------------- CUDA graphs

def in_backend(backend, fn):
    """``fn`` run under ``sdpa_kernel(backend)`` (as recorded in a graph too)."""
    def run():
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            return fn()
    return run


def graph_ms(step: Callable[[], object], timed: Callable[[Callable[[], object]], float]) -> float:
    """``step`` recorded in a CUDA graph (after two warm-ups on a side stream, as SGLang captures) and replayed."""
    from oscar_sglang.kernels.scenario import capture_graph

    graph, _ = capture_graph(step)
    return timed(graph.replay)


def graph_times(fns: dict, timed: Callable[[Callable[[], object]], float]) -> dict:
    """Each decode recorded in a CUDA graph and replayed (``{name}_ms``, or ``{name}_note`` where it fails): what a
    server's decode costs without the host's launches, which eager timing at batch 1 may partly include (the
    Triton wrappers' Python, 2-4 launches per call, against SDPA's one C++ call)."""
    out = {}
    for name, fn in fns.items():
        try:
            out[f"{name}_ms"] = graph_ms(fn, timed)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot be captured is a finding
            out[f"{name}_ms"], out[f"{name}_note"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    bf16 = [out[f"{n}_ms"] for n in ("triton_bf16", "sdpa") if out.get(f"{n}_ms") is not None]
    out["speedup"] = min(bf16) / out["int2_ms"] if bf16 and out.get("int2_ms") else None
    return out


# --------------------------------------------------------------------------- where a decode's time goes

FLUSH_BYTES = 256 << 20  # as do_bench's L2 flush: a decode's reads (an INT2 32k request's ~21 MB) start cold


def per_call(kernels, runs: int, skip=frozenset()) -> list[dict]:
    """``[{"kernel", "us", "launches"}]`` per call, longest first, from ``kernels``: ``(name, total_us, count)``
    of the device's kernels over ``runs`` calls (names in ``skip``, the L2 flush's, left out)."""
    out = {}
    for name, total_us, count in kernels:
        if name in skip or count <= 0:
            continue
        k = out.setdefault(name, {"kernel": name, "us": 0.0, "launches": 0.0})
        k["us"] += total_us / runs
        k["launches"] += count / runs
    return sorted(out.values(), key=lambda k: -k["us"])


def _profiled_kernels(fn: Callable[[], object], runs: int, flush: Callable[[], object] | None, device: str):
    """``(name, total us, count)`` of every CUDA kernel the profiler saw over ``runs`` calls of ``fn`` (``flush``
    before each); on a CPU device the operators it ran instead (the same plumbing, tested there)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            if flush is not None:
                flush()
            fn()
        if cuda:
            torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.key, e.self_device_time_total, e.count))
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:
            out.append((e.key, e.self_cpu_time_total, e.count))
    return out


def launch_times(fns: dict, runs: int = 20, device: str = "cuda", profiled=_profiled_kernels) -> dict:
    """Per decode of ``fns`` (eager, after a warm call; the L2 flushed before each call as ``do_bench`` does):
    each kernel's device time and launches per call (torch's profiler), and their sum: what the batch-1 decode
    is made of (split kernel, merge, query rotation) against SDPA's kernels, and, against the eager time, how
    long the GPU waited for the host.  ``{name: {"kernels": [...], "sum_us": ...}}`` or ``{name: {"note": ...}}``;
    the flush's own kernels (profiled alone first) left out."""
    flush_buf = torch.empty(FLUSH_BYTES if device == "cuda" else 1 << 10, dtype=torch.int8, device=device)

    def flush():
        flush_buf.add_(1)

    out = {}
    try:
        flush()
        skip = frozenset(name for name, _, _ in profiled(flush, 2, None, device))
    except Exception as e:  # noqa: BLE001 - the profiler itself may be missing (CUPTI)
        return {name: {"note": f"profiler: {type(e).__name__}: {str(e)[:160]}"} for name in fns}
    for name, fn in fns.items():
        try:
            fn()
            kernels = per_call(profiled(fn, runs, flush, device), runs, skip)
            out[name] = {"kernels": kernels, "sum_us": sum(k["us"] for k in kernels)}
        except Exception as e:  # noqa: BLE001 - recorded per decode
            out[name] = {"note": f"{type(e).__name__}: {str(e)[:160]}"}
    return out


def launch_lines(decode: list[dict]) -> list[str]:
    """The "where the time goes" section of bench_kernels.md (rows with ``launches``)."""
    rows = [r for r in decode if r.get("launches")]
    if not rows:
        return []
    lines = ["", "## Where a decode's time goes (torch profiler, eager)", "",
             "Each kernel's device time per call (mean of 20 calls, the L2 flushed before each) and launches per "
             "call; sum = the kernels' time, which the eager time above exceeds by what the GPU waited for the "
             "host's launches. INT2 = the served loop as timed above.", "",
             "| d | batch | context | decode | eager ms | kernels' sum us | kernels (us per call, launches) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, got in r["launches"].items():
            eager, total = r.get(f"{name}_ms"), got.get("sum_us")
            cell = "; ".join(f"{k['kernel'][:60]} {k['us']:.1f} ({k['launches']:g})" for k in got.get("kernels", []))
            lines.append(f"| {r['d']} | {r['batch']} | {r['context']} | {name} | "
                         + ("n/a" if eager is None else f"{eager:.4f}") + " | "
                         + ("n/a" if total is None else f"{total:.1f}") + f" | {cell or got.get('note', '-')} |")
    return lines


def graph_lines(decode: list[dict]) -> list[str]:
    """The CUDA-graph section of bench_kernels.md (rows timed in graphs only)."""
    rows = [r for r in decode if r.get("graph")]
    if not rows:
        return []

    def ms(g, n):
        return "n/a" if g.get(f"{n}_ms") is None else f"{g[f'{n}_ms']:.4f}"

    lines = ["", "## Decode in CUDA graphs (the goals' shapes)", "",
             "The same decodes recorded in a CUDA graph (two warm-ups on a side stream, as SGLang's runner) and "
             "replayed: the GPU's time without the host's launches, as a server's decode runs. INT2 = the "
             "automatic choice of the columns above; speedup = best BF16 / INT2; INT2 with the other rotation: "
             "the queries rotated where the automatic choice does not (inside the split kernel or before it).", "",
             "| d | batch | context | INT2 ms | INT2 ms, other rotation | Triton BF16 ms | SDPA ms | speedup | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["graph"]
        notes = "; ".join(f"{k[:-5]}: {v}" for k, v in g.items() if k.endswith("_note"))
        speed = "n/a" if g.get("speedup") is None else f"{g['speedup']:.2f}"
        lines.append(f"| {r['d']} | {r['batch']} | {r['context']} | {ms(g, 'int2')} | {ms(g, 'int2_other_q_rot')} | "
                     f"{ms(g, 'triton_bf16')} | {ms(g, 'sdpa')} | {speed} | {notes} |")
    return lines


# --------------------------------------------------------------------------- device memory

def fit_to_memory(cases: list[tuple[int, int]], bytes_for: Callable[[list[tuple[int, int]]], int],
                  free_bytes: int, headroom_bytes: int) -> tuple[list[tuple[int, int]], list[tuple[tuple, int]]]:
    """The ``(batch, context)`` cases whose buffers fit ``free_bytes``, and those left out with what they needed.

    ``bytes_for(kept)`` is what the benchmark allocates for a set of cases (its buffers are sized by the largest
    ``batch * context``); the cases of the largest token count are left out, then the next, until it plus
    ``headroom_bytes`` (each case's own buffers) fits.  The order of the kept cases is kept.
    """
    kept, left_out = list(cases), []
    while kept:
        need = bytes_for(kept)
        if need + headroom_bytes <= free_bytes:
            break
        most = max(b * c for b, c in kept)
        left_out += [(bc, need) for bc in kept if bc[0] * bc[1] == most]
        kept = [bc for bc in kept if bc[0] * bc[1] != most]
    return kept, left_out


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take: the driver's free memory plus what torch's caching allocator holds
    unused; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


# --------------------------------------------------------------------------- copy bandwidth

def copy_bandwidth(timed: Callable[[Callable[[], object]], float], device: torch.device, nbytes: int) -> dict:
    """Time ``dst.copy_(src)`` for two ``nbytes`` buffers; GB/s counts bytes read + written (2 * nbytes)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    ok = bool(torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[-4096:], src[-4096:]))
    del src, dst
    return {"device": str(device), "buffer_bytes": nbytes, "ms": ms, "GBps_read_plus_write": 2 * nbytes / ms / 1e6,
            "GBps_read_only": nbytes / ms / 1e6, "copy_verified": ok}


# --------------------------------------------------------------------------- dense cache + SDPA

def dense_cache(kb: torch.Tensor, vb: torch.Tensor, rows: torch.Tensor, lens: list[int],
                flat_k: torch.Tensor, flat_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[batch, kv_heads, ctx, d]`` copies of the paged ``kb, vb [num_slots, kv_heads, d]``.

    ``rows [batch, >= ctx]``: each request's token -> slot row (``req_to_token[req_pool_indices]``);
    all requests have the same length ``ctx``.  The result is a view of the preallocated flat
    buffers ``flat_k, flat_v`` (reused across cases); filled one request at a time to bound temporaries.
    """
    ctx = lens[0]
    assert all(n == ctx for n in lens), "the dense baseline takes equal lengths"
    bsz, (_, h, d) = len(lens), kb.shape
    k = flat_k[: bsz * h * ctx * d].view(bsz, h, ctx, d)
    v = flat_v[: bsz * h * ctx * d].view(bsz, h, ctx, d)
    for b in range(bsz):
        slots = rows[b, :ctx].long()
        k[b].copy_(kb[slots].transpose(0, 1))
        v[b].copy_(vb[slots].transpose(0, 1))
    return k, v


def _sdpa_gqa(q, k, v, scale):
    bsz, hq, d = q.shape
    return F.scaled_dot_product_attention(q.view(bsz, hq, 1, d), k, v, scale=scale, enable_gqa=True).view(bsz, hq, d)


def _sdpa_packed(q, k, v, scale):
    bsz, hq, d = q.shape
    hkv = k.shape[1]
    return F.scaled_dot_product_attention(q.view(bsz, hkv, hq // hkv, d), k, v, scale=scale).view(bsz, hq, d)


SDPA_FORMS = {"enable_gqa": _sdpa_gqa, "packed": _sdpa_packed}


def sdpa_backends(on_cuda: bool) -> list[tuple[str, object]]:
    """Backends to force, in order of preference."""
    from torch.nn.attention import SDPBackend

    if not on_cuda:
        return [("math", SDPBackend.MATH)]
    names = [("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")]
    return [(n, getattr(SDPBackend, a)) for n, a in names if hasattr(SDPBackend, a)]


class Sdpa:
    """SDPA decode over a dense cache, one backend forced; the first backend that runs is kept for later cases."""

    def __init__(self, on_cuda: bool, backends: list[tuple[str, object]] | None = None):
        self.on_cuda = on_cuda
        self.backends = sdpa_backends(on_cuda) if backends is None else backends
        self.choice: tuple[str, object] | None = None
        self.refused: list[str] = []  # "backend/form: reason" of the combinations that failed

    def _try(self, name, backend, form, q, k, v, scale):
        """``(fn, output)`` when ``form`` runs under ``backend`` alone, else None (the reason kept)."""
        from torch.nn.attention import sdpa_kernel

        run = SDPA_FORMS[form]
        fn = (lambda: run(q, k, v, scale))
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel(backend):
                warnings.simplefilter("always")
                out = fn()
            if self.on_cuda:
                torch.cuda.synchronize()
            return fn, out
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            why = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            msg = f"{name}/{form}: {type(e).__name__}: {first[:160]}" + (f" ({'; '.join(why)[:300]})" if why else "")
            if msg not in self.refused:
                self.refused.append(msg)
            return None

    def prepare(self, q, k, v, scale) -> tuple[object, list[tuple[str, Callable[[], torch.Tensor], torch.Tensor]]]:
        """``(backend, [(label, fn, first_output), ...])``: every form that runs under the first backend
        (the kept one first) that runs any; time each ``fn`` inside ``sdpa_kernel(backend)``.
        Raises RuntimeError when no backend runs."""
        order = list(self.backends)
        if self.choice is not None:
            order.remove(self.choice)
            order.insert(0, self.choice)
        for name, backend in order:
            ok = [(f"{name}/{form}", *got) for form in SDPA_FORMS
                  if (got := self._try(name, backend, form, q, k, v, scale)) is not None]
            if ok:
                self.choice = (name, backend)
                return backend, ok
        raise RuntimeError("no SDPA backend ran: " + "; ".join(self.refused[-6:]))


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 decode attention over a dense ``[batch, kv_heads, ctx, d]`` cache (small checks only)."""
    gqa = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(gqa, dim=1)
    v = v.float().repeat_interleave(gqa, dim=1)
    p = (torch.einsum("bhd,bhnd->bhn", q.float(), k) * scale).softmax(-1)
    return torch.einsum("bhn,bhnd->bhd", p, v)


# --------------------------------------------------------------------------- FlashInfer page table

def page_table(rows: torch.Tensor, lens: list[int], page: int = PAGE
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's ``(indptr [B+1], indices [nnz], last_page_len [B])`` (int32) from token -> slot rows.

    Needs each request's tokens on pages of ``page`` consecutive slots, in token order
    (``scenario.paged_layout``); checks that, since FlashInfer reads whole pages.
    """
    device = rows.device
    counts, idx = [], []
    for b, n in enumerate(lens):
        slots = rows[b, :n].long()
        first = slots[::page]
        pos = torch.arange(n, device=device)
        expect = first.repeat_interleave(page)[:n] + pos % page
        if not torch.equal(slots, expect) or bool((first % page != 0).any()):
            raise ValueError(f"request {b}: tokens are not on whole pages of {page} consecutive slots")
        idx.append((first // page).to(torch.int32))
        counts.append(len(first))
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(counts), 0)
    last = torch.tensor([n - page * (c - 1) if c else 0 for n, c in zip(lens, counts)], dtype=torch.int32)
    return indptr.to(device), torch.cat(idx), last.to(device)


def paged_decode_torch(q, k_pages, v_pages, indptr, indices, last_page_len, scale) -> torch.Tensor:
    """Plain fp32 attention reading K/V through a FlashInfer NHD page table (``[pages, page, kv_heads, d]``)."""
    bsz, hq, d = q.shape
    page, hkv = k_pages.shape[1], k_pages.shape[2]
    out = torch.empty(bsz, hq, d, dtype=torch.float32, device=q.device)
    ip, last = indptr.tolist(), last_page_len.tolist()
    for b in range(bsz):
        pages = indices[ip[b]: ip[b + 1]].long()
        n = (len(pages) - 1) * page + last[b]
        k = k_pages[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        v = v_pages[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


# --------------------------------------------------------------------------- FlashInfer

def _plan(wrapper, indptr, indices, last, hq, hkv, d, page, scale) -> None:
    common = dict(pos_encoding_mode="NONE", sm_scale=scale)
    try:
        wrapper.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16, **common)
    except TypeError:  # releases that name the dtype ``data_type`` only
        wrapper.plan(indptr, indices, last, hq, hkv, d, page, data_type=torch.bfloat16, **common)


def _kill_group(p: subprocess.Popen) -> None:
    """Kill the child's whole process group (it runs nvcc/ninja children); the child was started by us."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def spawn(cmd: list[str]) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, output captured."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_bounded(p: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """Wait up to ``timeout`` s; on timeout kill the child's group. ``(returncode or None on timeout, output)``."""
    try:
        out, _ = p.communicate(timeout=max(timeout, 0.01))
        return p.returncode, out
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, _ = p.communicate()
        return None, out or ""


class FlashInferDecode:
    """FlashInfer's paged BF16 decode; its JIT build runs in child processes, bounded; ``status`` says why not.

    :meth:`start` launches one warm-up child per head_dim at once (they build while the other
    baselines run); :meth:`setup` waits for that head_dim's child until ``timeout`` seconds after
    its start, then loads the built kernels in this process.
    """

    WORKSPACE_BYTES = 512 << 20

    def __init__(self, on_cuda: bool, kv_heads: int, gqa: int, tensor_cores: bool, timeout: float,
                 disabled: bool = False, child_device: str = "cuda"):
        self.kv_heads, self.gqa, self.tensor_cores, self.timeout = kv_heads, gqa, tensor_cores, timeout
        self.child_device = child_device  # the warm-up's device ("cpu" only in tests, with a stand-in module)
        self.version = None
        self.children: dict[int, tuple[subprocess.Popen, float]] = {}  # head_dim -> (child, start time)
        self.ready: dict[int, object] = {}  # head_dim -> wrapper
        self.reason: dict[int, str] = {}  # head_dim -> why not available
        self.warmup_s: dict[int, float] = {}
        self.load_s: dict[int, float] = {}
        self.warmup_log: dict[int, str] = {}  # head_dim -> the child's output (tail)
        self.status = "ok"
        if disabled:
            self.status = "not available: disabled by --no-flashinfer"
        elif not on_cuda:
            self.status = "not available: no CUDA (FlashInfer is GPU-only)"
        elif importlib.util.find_spec("flashinfer") is None:
            self.status = "not available: flashinfer is not installed"

    def warmup_command(self, d: int) -> list[str]:
        return [sys.executable, os.path.abspath(__file__), "--flashinfer-warmup", str(d), str(self.kv_heads),
                str(self.gqa), "1" if self.tensor_cores else "0", "--device", self.child_device]

    def start(self, dims: list[int]) -> None:
        if self.status != "ok":
            return
        for d in dims:
            if d not in self.children:
                self.children[d] = (spawn(self.warmup_command(d)), time.time())

    def setup(self, d: int, device: torch.device) -> str | None:
        """None when the kernels for ``d`` are loaded, else the reason they are not."""
        if self.status != "ok":
            return self.status
        if d in self.ready:
            return None
        if d in self.reason:
            return self.reason[d]
        self.start([d])
        p, t0 = self.children[d]
        rc, out = wait_bounded(p, self.timeout - (time.time() - t0))
        self.warmup_s[d] = round(time.time() - t0, 1)
        self.warmup_log[d] = out[-2000:]
        tail = " | ".join(line.strip() for line in out.strip().splitlines()[-3:])[:400]
        if rc is None:
            self.reason[d] = (f"not available: JIT build + check exceeded --flashinfer-timeout {self.timeout:g} s "
                              "(killed)")
        elif rc != 0:
            self.reason[d] = f"not available: warm-up failed (rc {rc}): {tail}"
        else:
            t1 = time.time()
            try:
                import flashinfer

                self.version = getattr(flashinfer, "__version__", "?")
                ws = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                self.ready[d] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=self.tensor_cores)
                self.load_s[d] = round(time.time() - t1, 1)
                return None
            except Exception as e:  # noqa: BLE001 - any failure is a recorded reason, never a crash
                self.reason[d] = f"not available: {type(e).__name__}: {str(e)[:200]}"
        return self.reason[d]

    def prepare(self, d: int, q, kb, vb, indptr, indices, last, scale) -> Callable[[], torch.Tensor]:
        """Plan (outside any timing) and return the decode call over ``kb, vb`` viewed as NHD pages."""
        wrapper = self.ready[d]
        hkv = kb.shape[1]
        k_pages = kb.view(-1, PAGE, hkv, d)
        v_pages = vb.view(-1, PAGE, hkv, d)
        _plan(wrapper, indptr, indices, last, q.shape[1], hkv, d, PAGE, scale)
        return lambda: wrapper.run(q, (k_pages, v_pages))

    def close(self) -> None:
        """Kill warm-up children still running (e.g. a head_dim never reached)."""
        for d, (p, _) in self.children.items():
            if p.poll() is None:
                _kill_group(p)
                p.communicate()
                self.reason.setdefault(d, "not available: warm-up abandoned (not needed before the end)")


def _warmup_main(d: int, kv_heads: int, gqa: int, tensor_cores: bool, device: str = "cuda") -> int:
    """Child process: build FlashInfer's kernels for ``d`` on a tiny case and check them against torch."""
    t0 = time.time()
    import flashinfer

    print(f"flashinfer {getattr(flashinfer, '__version__', '?')} imported in {time.time() - t0:.1f} s", flush=True)
    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = [37, 16, 5]
    pages_per = [-(-n // PAGE) for n in lens]
    order = torch.randperm(sum(pages_per) + 2, generator=g)[: sum(pages_per)] + 1
    indptr = torch.tensor([0, *torch.cumsum(torch.tensor(pages_per), 0).tolist()], dtype=torch.int32, device=dev)
    indices = order.to(torch.int32).to(dev)
    last = torch.tensor([n - PAGE * (p - 1) for n, p in zip(lens, pages_per)], dtype=torch.int32, device=dev)
    num_pages = int(order.max()) + 1
    k_pages = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dev, torch.bfloat16)
    v_pages = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dev, torch.bfloat16)
    q = torch.randn(len(lens), kv_heads * gqa, d, generator=g).to(dev, torch.bfloat16)
    scale = d ** -0.5
    ws = torch.empty(FlashInferDecode.WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    t1 = time.time()
    _plan(w, indptr, indices, last, q.shape[1], kv_heads, d, PAGE, scale)
    out = w.run(q, (k_pages, v_pages))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ref = paged_decode_torch(q, k_pages, v_pages, indptr, indices, last, scale)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"flashinfer d={d} tensor_cores={tensor_cores}: plan+run (JIT) {time.time() - t1:.1f} s, "
          f"max rel err vs torch {err:.2e}", flush=True)
    if not err < 2e-2:
        print("flashinfer output does not match the torch reference", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="FlashInfer JIT warm-up (run by bench_kernels.py in a child process)")
    ap.add_argument("--flashinfer-warmup", nargs=4, type=int, metavar=("D", "KV_HEADS", "GQA", "TENSOR_CORES"),
                    required=True)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    d_, kv_, gqa_, tc_ = a.flashinfer_warmup
    sys.exit(_warmup_main(d_, kv_, gqa_, bool(tc_), a.device))
