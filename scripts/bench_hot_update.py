"""GPU time of the hot side pool's update per decode step (``HotSet.begin_pass``), part of ``bench_kernels.py``.

    python scripts/bench_kernels.py --out OUT        # writes it as a section of bench_kernels.md/.json

Every decode step runs one update for all layers before them (``oscar_sglang/sglang/hot.py``): under
SGLang's decode CUDA graphs it is recorded in the graph (on CUDA the fused decode pass of
``kernels/hot_pass``, 12 launches; ~90 small ones in the general torch path); it adds to the step what a
layer's decode kernel does not show.  Measured here, per
batch size, on the state SGLang gives it: ``--rows`` request rows tracked (SGLang allocates 2048-4096
whatever the load; the re-pin scans them all), sink 64 / recent 256, the hot pool sized for 32
requests, every request ``--context`` tokens long with its windows hot:

* ``graph``: the update recorded in a CUDA graph at that batch size (every row live) and replayed: what
  a decode step pays on the GPU;
* ``eager``: the same update launched op by op (SGLang's eager decode, and ``OSCAR_SGLANG_GRAPH_HOT_UPDATE=eager``):
  mostly host launch time;
* each for the fused decode pass (Triton, what a GPU runs) and the general torch path;
* ``repin``: the re-pin alone over all rows, the Triton kernel and the torch reference (which ran on the
  GPU before 2026-12-03).

The same decode step is replayed (its clock advances, positions stay): the work per replay is a real
step's.  On CPU (``--cpu-smoke``) tiny sizes, eager only, the re-pin kernel through the interpreter.
"""

from __future__ import annotations

import torch

from oscar_sglang.kernels.repin import reference as repin_ref
from oscar_sglang.sglang import sizing
from oscar_sglang.sglang.hot import HotSet

import bench_baselines as bl  # scripts/: its importers put it on the path

HOT_REQUESTS = 32


def _state(rows: int, batch: int, context: int, sink: int, recent: int, device):
    """A hot set tracking ``rows`` request rows, ``batch`` live requests of ``context`` tokens prefilled, and the
    next decode step's tensors."""
    plan = sizing.hot_plan(HOT_REQUESTS, sink, recent)
    width = context + 64
    num_slots = 1 + batch * width
    hs = HotSet(num_slots, plan.sink_entries, plan.recent_entries, sink, recent, device=device)
    hs.track_requests(rows)
    req_to_token = torch.zeros(rows, width, dtype=torch.int32, device=device)
    live_rows = torch.arange(1, batch + 1, device=device)                 # row 0: SGLang's padding row
    slots = 1 + (live_rows - 1).unsqueeze(1) * width + torch.arange(width, device=device)
    req_to_token[live_rows] = slots.to(torch.int32)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    lengths = torch.full((batch,), context, dtype=torch.long, device=device)
    hs.begin_pass(slots[:, :context].reshape(-1), live_rows, zeros, lengths, req_to_token)      # the prefill
    loc = slots[:, context].contiguous()
    seq = lengths + 1
    return hs, req_to_token, live_rows, loc, seq


def measure(device, timed, smoke: bool, rows: int = 4096, context: int = 4096,
            batches=(1, 8, 32, 128)) -> list[dict]:
    """One row per batch size: ms per update (graph replay, eager) and per re-pin (Triton, torch)."""
    sink, recent = (8, 16) if smoke else (64, 256)
    if smoke:
        rows, context, batches = 64, 40, (1, 4)
    out = []
    for batch in batches:
        hs, req_to_token, live_rows, loc, seq = _state(rows, batch, context, sink, recent, device)
        live = torch.ones(batch, dtype=torch.bool, device=device)

        def step():
            hs.begin_pass(loc, live_rows, seq - 1, seq, req_to_token, decode=True, live=live)

        row = {"batch": batch, "rows": rows, "context": context, "sink": sink, "recent": recent,
               "hot_entries": hs.entries}
        for path, backend in (("fused", "triton"), ("torch", "torch")):
            hs.kernel_backend = backend
            row[f"{path}_eager_ms"] = timed(step)
            row[f"{path}_graph_ms"] = None
            if device.type == "cuda":
                try:                      # a capture that fails is written down, the other numbers kept
                    row[f"{path}_graph_ms"] = bl.graph_ms(step, timed)
                except Exception as e:  # noqa: BLE001
                    row[f"{path}_graph_note"] = f"{type(e).__name__}: {str(e)[:200]}"
                    torch.cuda.synchronize()
        args = (hs._stamp, hs._hot_index, hs._req_len, hs._req_pass, req_to_token, sink, recent)
        from oscar_sglang.kernels.repin import triton_kernel as repin_tk

        row["repin_triton_ms"] = timed(lambda: repin_tk.repin_windows(*args))
        row["repin_torch_ms"] = timed(lambda: repin_ref.repin_windows(*args, hs._spread))
        out.append(row)
        print(f"hot update batch={batch} rows={rows}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                                                   if k.endswith("_ms") and v is not None),
              flush=True)
    return out


def markdown(rows: list[dict]) -> list[str]:
    """The section of bench_kernels.md."""
    if not rows:
        return []
    r0 = rows[0]

    def ms(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = ["", "## Hot pool update per decode step (once for all layers)", "",
             f"`HotSet.begin_pass` over {r0['rows']} tracked request rows (SGLang's table), sink {r0['sink']} / "
             f"recent {r0['recent']}, {r0['hot_entries']} hot entries, requests of {r0['context']} tokens "
             "(scripts/bench_hot_update.py). fused = the decode pass in Triton (`kernels/hot_pass`, what a "
             "GPU runs), torch = its general torch path (~90 small ops); graph = recorded in a CUDA graph and "
             "replayed (a decode step's cost on the GPU), eager = launched op by op (host-bound); re-pin = the "
             "scan of every row's window alone, Triton kernel vs the torch re-pin.", "",
             "| batch | fused, graph ms | torch, graph ms | fused, eager ms | torch, eager ms | re-pin Triton ms "
             "| re-pin torch ms |", "|---|---|---|---|---|---|---|"]
    notes = [f"- batch {r['batch']}, {path} path: the CUDA graph capture failed: {r[f'{path}_graph_note']}"
             for r in rows for path in ("fused", "torch") if r.get(f"{path}_graph_note")]
    for r in rows:
        lines.append(f"| {r['batch']} | {ms(r['fused_graph_ms'])} | {ms(r['torch_graph_ms'])} | "
                     f"{ms(r['fused_eager_ms'])} | {ms(r['torch_eager_ms'])} | {ms(r['repin_triton_ms'])} | "
                     f"{ms(r['repin_torch_ms'])} |")
    return lines + ([""] + notes if notes else [])
