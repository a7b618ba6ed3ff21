"""The decode loop chosen on the machine that serves it: the candidates timed once at startup, the fastest kept.

The INT2 decode has loop variants (``triton_kernel.decode_attention``'s ``fold``, ``num_warps``, ``hot_loop``,
``whole_waves``) whose speed depends on the GPU and on the Triton version that compiles them: compiled for
sm_90, the same loop issues half the instructions with one Triton as with another and holds a multiprocessor
to 8 warps or to 12 (docs/KERNELS.md, "What the decode loop issues" and "How many warps a multiprocessor
holds").  No default fits every machine, so a server times its candidates itself, once, before it captures
CUDA graphs (``oscar_sglang/sglang/backend.py``):

* each candidate decodes a synthetic store of the served layer's formats and geometry (random codes and
  scales, pages in random order, the served sink and recent windows hot per request, the splits cut by work
  as the server's) at :data:`CASES` (one long
  request; a batch of shorter ones), after a warm call that compiles it;
* its output is checked against the default's on the same inputs (the same attention, another loop: at
  most :data:`AGREEMENT` relative to the largest value); one that differs or fails is dropped, with a note;
* per case, the fastest is kept when its time is at most ``1 - MARGIN`` of the default's there (timing noise
  does not move the server off the default); else the default.  A batch is served with the pick of the case
  nearest its size (:meth:`Choice.options_for`): batch 1 (the latency a user waits for per token) and large
  batches (throughput) may want different loops, e.g. one whole wave of splits at batch 1;
* ``whole_waves`` becomes ``resident=N`` (the programs per multiprocessor the compiled kernel reported at that
  case), the number a CUDA graph's split count follows.

Candidates are tried in order until ``budget_s`` is spent (the default first, always).  Nothing here imports
SGLang; :func:`choose` works on any device (on CPU the Triton interpreter runs it, which is what the tests do;
its times mean nothing there).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import scenario
from ..layout import DeviceRotation, LayerStore, empty_store
from . import triton_kernel

# (label, decode_attention options); the first is the default, the reference of the others; the rest in the
# order of their promise (instructions per token and warps per multiprocessor counted for sm_90, docs/KERNELS.md),
# so that a spent budget leaves out the least promising: the 2-warp fold (19-20 per token, 12 warps), the same over
# one whole wave (no new compile), the 4-warp fold (41-48, 12-16 warps), the default loop with its hot blocks in a
# loop of their own (fewer registers with some compilers, more with others), the 2-warp fold held to 128 registers
# over one whole wave (16 warps per multiprocessor; with triton 3.6 some spills in its loop)
CANDIDATES: tuple[tuple[str, dict], ...] = (
    ("default", {}),
    ("fold, 2 warps", {"fold": True, "num_warps": 2}),
    ("fold, 2 warps, whole waves", {"fold": True, "num_warps": 2, "whole_waves": True}),
    ("fold", {"fold": True}),
    ("hot blocks in their own loop", {"hot_loop": True}),
    ("fold, 2 warps, 128 registers, whole waves",
     {"fold": True, "num_warps": 2, "max_registers": 128, "whole_waves": True}),
)
# (batch, context): ~132k slots, ~76 MB at 8 KV heads of d 128 in INT2 (and do_bench's 256 MB cache flush), freed after;
# batch 32 stands for the throughput regime (a server's largest 32k waves hold ~26 requests), batch 1 for latency
CASES: tuple[tuple[int, int], ...] = ((1, 16384), (32, 4096))
MARGIN = 0.05       # a candidate must take at most 95% of the default's time at a case to be kept there
AGREEMENT = 2e-2    # largest |candidate - default| / largest |default| (the fold's fp16 rounding is ~1e-3)
SINK, RECENT, PAGE = 64, 256, 16


@dataclass
class Choice:
    """What :func:`choose` found: the candidate kept at each case (a batch regime) and what every candidate
    measured.  :meth:`options_for` gives the options of a batch: the kept candidate of the case nearest its size."""

    device: str
    cases: tuple[tuple[int, int], ...]
    base: str                          # the reference candidate's label (the default)
    picks: list[tuple[str, dict]] = field(default_factory=list)  # per case: label, decode_attention options
    ms: dict[str, list[float]] = field(default_factory=dict)     # label -> ms per case (timed candidates)
    notes: dict[str, str] = field(default_factory=dict)          # label -> why it was dropped or not timed
    seconds: float = 0.0

    def options_for(self, batch: int) -> dict:
        """The options kept for the case whose batch is nearest ``batch`` (in ratio; a tie: the smaller)."""
        i = min(range(len(self.cases)), key=lambda c: (abs(math.log(max(1, batch) / self.cases[c][0])),
                                                       self.cases[c][0]))
        return dict(self.picks[i][1])

    def ratio(self, label: str, case: int) -> float:
        """``label``'s time over the default's at ``case``."""
        return self.ms[label][case] / self.ms[self.base][case]

    def summary(self) -> str:
        """One line for the server's log: per case the kept loop, the knob value that serves it and its time over
        the default's; every candidate's ratios; why any was dropped."""
        def case(i):
            b, n = self.cases[i]
            label, opts = self.picks[i]
            gain = f", {self.ratio(label, i):.2f}x the default's time" if label != self.base else ""
            return f"b{b} x {n}: {label} ({knob_value(opts) or 'default'}{gain})"
        head = "decode loop: " + "; ".join(case(i) for i in range(len(self.cases)))
        head += f"; timed at startup on {self.device} in {self.seconds:.1f} s"
        parts = [f"{label} " + "/".join(f"{self.ratio(label, i):.2f}" for i in range(len(self.cases)))
                 for label in self.ms]
        tail = "; time / default's per case: " + ", ".join(parts) if parts else ""
        return head + tail + "".join(f"; {label}: {note}" for label, note in self.notes.items())


def knob_value(options: dict) -> str:
    """``OSCAR_SGLANG_DECODE_KERNEL``'s value for ``options`` (booleans as 0/1), '' for the defaults."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in options.items())


def timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds per call: Triton's ``do_bench`` median on a GPU (short: a startup cost); elsewhere one
    wall-clock call after the warm one."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def synthetic_store(like: LayerStore, slots: int, hot_entries: int, seed: int) -> LayerStore:
    """A store of ``like``'s formats and geometry on its device: random codes, scales in [0.01, 0.1], zeros in
    [-0.2, 0.2], BF16 hot rows (``hot_index`` all cold: the caller assigns)."""
    dev = like.k_codes.device
    store = empty_store(slots, like.kv_heads, like.head_dim, None, hot_entries, dev,
                        k_format=like.k_format, v_format=like.v_format)
    g = torch.Generator(device=dev).manual_seed(seed)
    for codes, scale, zero in ((store.k_codes, store.k_scale, store.k_zero),
                               (store.v_codes, store.v_scale, store.v_zero)):
        codes.copy_(torch.randint(0, 256, codes.shape, generator=g, device=dev, dtype=torch.int32))
        scale.copy_(0.01 + 0.09 * torch.rand(scale.shape, generator=g, device=dev))
        zero.copy_(0.4 * torch.rand(zero.shape, generator=g, device=dev) - 0.2)
    store.k_hot.copy_(torch.randn(store.k_hot.shape, generator=g, device=dev))
    store.v_hot.copy_(torch.randn(store.v_hot.shape, generator=g, device=dev))
    return store


def choose(like: LayerStore, rot: DeviceRotation, q_heads: int, *, cases=None, candidates=None,
           budget_s: float = 45.0, timer: Callable[[Callable[[], object], torch.device], float] = timed_ms,
           q_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
           windows: tuple[int, int] = (SINK, RECENT)) -> Choice:
    """Time ``candidates`` (the first is the reference) on synthetic stores like ``like`` (the served layer's
    formats, KV heads and head size; ``rot`` its rotation) with ``q_heads`` query heads, at ``cases``; return the
    :class:`Choice` (module docstring); ``cases`` and ``candidates`` default to :data:`CASES` and
    :data:`CANDIDATES`.  ``windows``: the served sink and recent windows, hot in every synthetic request and
    passed to each candidate as its ``hot_windows`` (the splits cut by work, as the server decodes)."""
    sink, recent = windows
    cases, candidates = tuple(cases or CASES), tuple(candidates or CANDIDATES)
    start = time.monotonic()
    dev = like.k_codes.device
    hot_per_req = lambda n: min(n, sink + recent)  # noqa: E731
    slots = max(b * (n + PAGE) for b, n in cases) + 8 * PAGE
    store = synthetic_store(like, slots, max(b * hot_per_req(n) for b, n in cases), seed)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    runs = []
    for i, (b, n) in enumerate(cases):
        paged = scenario.paged_layout([n] * b, PAGE, seed + i, spare_pages=0, device=dev)
        q = torch.randn(b, q_heads, like.head_dim, generator=g, device=dev).to(q_dtype)
        runs.append((paged, q, n))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} (Triton's interpreter)"
    base_label = candidates[0][0]
    choice = Choice(name, cases, base_label)
    reference: list[torch.Tensor] = []
    served: dict[str, list[dict]] = {}  # label -> options as served, per case (whole waves: that case's residency)
    for index, (label, opts) in enumerate(candidates):
        if index and time.monotonic() - start > budget_s:
            choice.notes[label] = f"not timed (the {budget_s:g} s budget spent)"
            continue
        try:
            ms, per_case = [], []
            for i, (paged, q, n) in enumerate(runs):
                scenario.assign_hot(store, paged, sink, recent)
                args = (q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens,
                        like.head_dim ** -0.5)
                report: dict = {}
                kw = {"max_seq_len": n, "hot_windows": (sink, recent), **opts}
                out = triton_kernel.decode_attention(*args, report=report, **kw).float()
                per_case.append(served_options(opts, report.get("resident")))
                if index == 0:
                    reference.append(out)
                else:
                    ref = reference[i]
                    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    if not err <= AGREEMENT:
                        raise ValueError(f"differs from the default by {err:.1e} at b{q.shape[0]} x {n}")
                ms.append(timer(lambda: triton_kernel.decode_attention(*args, **kw), dev))
            choice.ms[label], served[label] = ms, per_case
        except Exception as e:  # noqa: BLE001  (a candidate that fails is dropped, the server still starts)
            if index == 0:
                raise
            choice.notes[label] = f"dropped: {type(e).__name__}: {str(e)[:160]}"
    for i in range(len(cases)):  # per case: the fastest, if at least MARGIN faster than the default there
        best = min(choice.ms, key=lambda label: choice.ms[label][i])
        if choice.ms[best][i] > (1 - MARGIN) * choice.ms[base_label][i]:
            best = base_label
        choice.picks.append((best, served[best][i]))
    choice.seconds = time.monotonic() - start
    del store, runs, reference
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # a server's memory is planned without these buffers
    return choice


def served_options(opts: dict, resident: int | None) -> dict:
    """``opts`` as a server passes them: ``whole_waves`` as ``resident=N`` (the compiled kernel's programs per
    multiprocessor, which a CUDA graph's split count follows), dropped where the device did not report it."""
    out = {}
    for key, value in opts.items():
        if key != "whole_waves":
            out[key] = value
        elif value and resident:
            out["resident"] = int(resident)
    return out
