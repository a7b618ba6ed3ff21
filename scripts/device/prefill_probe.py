"""Before the servers on a GPU: which INT2 prefill path is faster there, so the INT2 server's 32k waves use it.

    python scripts/device/prefill_probe.py --out OUT      # prints choice=sdpa or choice=kernel last

The INT2 server prefills a 32k prompt in SGLang's 8k chunks either through ``kernels/extend/sdpa.py`` (the
default on a GPU since 2026-12-05: the prefix dequantized once, then torch's flash attention) or with the
Triton extend kernel (``OSCAR_SGLANG_EXTEND_KERNEL=kernel``: the INT2 prefix dequantized in every query
block). Which is faster is a property of the GPU, and its 32k waves are mostly prefill, so the GPU run
should not find it out only after the servers step (the kernel benchmark's prefill section runs after it).
This times both on the chunk that costs the most, the last one of a 32k prompt (24k cached tokens + 8k new;
8 KV heads, GQA 4:1, d 128: the servers' model), checks that they agree, and keeps the default (``sdpa``)
unless the kernel is at least ``KERNEL_GAIN`` times as fast. ``scripts/device_check.sh`` then exports the
choice as the knob for the servers step, whose report names it in every INT2 row's note. Writes
``OUT/prefill_probe.json``.

Without CUDA (the dry run) the same on tiny shapes through Triton's interpreter, and the choice is always
``kernel``: interpreter timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

KERNEL_GAIN = 1.2  # the kernel must be this much faster to replace the default: a restart's worth of noise


def choose(kernel_ms: float | None, sdpa_ms: float | None, rel_err: float | None, tol: float, cuda: bool) -> tuple:
    """(choice, why): the default ``"sdpa"`` on a GPU unless the kernel, both timed and agreeing within ``tol``,
    is at least KERNEL_GAIN x as fast; ``"kernel"`` where the sdpa path failed or the two disagree (the kernel
    passed its native tests on the H200 in run 2; the sdpa path's read kernel had not yet run there), and
    without CUDA (never taken there)."""
    if not cuda:
        return "kernel", "no CUDA: the interpreter's timings say nothing about a GPU"
    if sdpa_ms is None:
        return "kernel", "the sdpa path was not timed"
    if kernel_ms is None:
        return "sdpa", "the kernel was not timed"
    if rel_err is None or rel_err > tol:  # one is wrong: the kernel's native tests passed on the H200 (run 2)
        return "kernel", f"the paths disagree (max relative difference {rel_err}, tolerance {tol})"
    gain = sdpa_ms / kernel_ms
    if gain >= KERNEL_GAIN:
        return "kernel", f"the Triton kernel is {gain:.2f}x as fast (>= {KERNEL_GAIN})"
    return "sdpa", (f"the sdpa path is {kernel_ms / sdpa_ms:.2f}x as fast "
                    f"(the kernel would need {KERNEL_GAIN}x its speed)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=8192)
    a = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import triton

    from oscar_sglang.kernels import interpret

    if not cuda:
        interpret.enable()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench_extend
    import bench_extend as be

    prompt, chunk, kv, sink, recent = (a.prompt, a.chunk, 8, 64, 256) if cuda else (96, 32, 2, 8, 16)
    device = torch.device("cuda" if cuda else "cpu")

    def timed(fn) -> float:
        if cuda:
            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    t0 = time.time()
    pb = be._Problem(prompt, kv, 4, 128, sink, recent, device)
    c = pb.chunk(prompt - chunk, chunk)
    res = {"prompt": prompt, "chunk": chunk, "prefix": prompt - chunk, "kv_heads": kv, "d": 128, "cuda": cuda,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    from oscar_sglang.kernels.extend import sdpa

    shape = (1, kv * 4, chunk, 128), (1, kv, prompt, 128)  # the sdpa path's SDPA call on this chunk
    q4, k4 = (torch.empty(s, dtype=torch.bfloat16, device=device) for s in shape)
    res["sdpa_kv_heads"] = "as they are" if sdpa.flash_takes_gqa(q4, k4, k4) else "expanded to the query heads"
    del q4, k4
    outs = {}
    for name, fn in (("kernel", lambda: pb.int2(c, "bf16")), ("sdpa", lambda: pb.int2_sdpa(c))):
        try:
            outs[name] = fn()
            res[f"{name}_ms"] = timed(fn)
        except Exception as e:  # noqa: BLE001 - a path that fails is not chosen, and says why
            res[f"{name}_ms"], res[f"{name}_note"] = None, f"{type(e).__name__}: {str(e)[:300]}"
    res["rel_err"] = be.rel_err(outs["sdpa"], outs["kernel"]) if len(outs) == 2 else None
    res["choice"], res["why"] = choose(res["kernel_ms"], res["sdpa_ms"], res["rel_err"], be.TOL, cuda)
    res["seconds"] = round(time.time() - t0, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prefill_probe.json").write_text(json.dumps(res, indent=1) + "\n")
    ms = {k: "n/a" if res[f"{k}_ms"] is None else f"{res[f'{k}_ms']:.2f} ms" for k in ("kernel", "sdpa")}
    print(f"INT2 prefill, one layer, {chunk} new tokens over {prompt - chunk} cached: Triton kernel {ms['kernel']}, "
          f"sdpa path {ms['sdpa']} (KV heads {res['sdpa_kv_heads']}), max relative difference "
          f"{'n/a' if res['rel_err'] is None else format(res['rel_err'], '.1e')}; {res['why']}")
    for k in ("kernel_note", "sdpa_note"):
        if res.get(k):
            print(f"{k}: {res[k]}")
    print(f"choice={res['choice']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
