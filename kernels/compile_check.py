"""Compile every kernel for a CUDA target on a machine without a GPU (catches GPU-only compile errors).

    .venv/bin/python -m oscar_sglang.kernels.compile_check [--arch 90] [--workers N]

The interpreter runs kernels as numpy and accepts things the compiler
refuses; this goes through Triton's real pipeline down to a cubin (ptxas)
for representative launches (INT2 rows, and mixed key/value formats: INT4 keys
with INT2 values, INT8 keys with INT4 values) and prints registers and spills
per kernel.
The launches are recorded from the real wrappers on CPU tensors, so the
signatures are exactly the ones used.  Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from .occupancy import resident_programs


LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")
# tiles of the extend kernel beside its default (block_rows 64, block_n 32, 8 warps, 2 stages) that
# scripts/bench_extend.py times on the GPU
EXTEND_SWEEP = ({"block_rows": 128}, {"block_n": 64}, {"block_rows": 128, "block_n": 64}, {"num_warps": 4})
# the artifacts' default sink and recent windows, which a server passes to every decode (``hot_windows``: the
# splits cut by work; "as run 1" below cuts them evenly, as it did)
WINDOWS = (64, 256)
# the decode loop's variants that scripts/device/decode_variants.py times (the first H200 run: latency-bound)
# (the default since then: block_n 64, prefetch 1, hot_skip; these are the others; "whole waves" compiles as
# the loop it sizes)
DECODE_VARIANTS = ({"block_n": 32, "prefetch": 0, "hot_skip": False, "hot_weight": 0}, {"hot_loop": True}, {"dots": "bf16"},
                   {"fold": True},
                   {"fold": True, "num_warps": 2}, {"fold": True, "num_warps": 2, "max_registers": 128},
                   {"fold": True, "num_warps": 2, "unpack_first": True})


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: records the launch instead of running it."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.fn, args, kwargs))
        return launch


def _type(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
                      torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i64" if abs(v) >= 2**31 else "i32"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v)}")


def _specialized(v) -> tuple[str, object]:
    """``(type, attribute)`` of an argument as Triton's launcher specializes it: a pointer 16-byte aligned and an
    integer divisible by 16 get ``tt.divisibility 16`` (so loads vectorize as in a real launch), the integer 1
    becomes a constant.  Triton's own function where this Triton has it; else the plain type."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        return _type(v), None
    return native_specialize_impl(CUDABackend, v, False, True, True)


@contextlib.contextmanager
def _replaced(module, name, value):
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield real
    finally:
        setattr(module, name, real)


def _record(module, name, run) -> list:
    log: list = []
    with _replaced(module, name, None) as real:
        setattr(module, name, _Recorder(real, log))
        run()
    return log


def _no_merge(mid_o, mid_lse, *_, **__):
    """Stands in for the reduce after a recorded (not run) split kernel."""
    return torch.zeros(mid_o.shape[0], mid_o.shape[1], mid_o.shape[3])


def _torch_rotation(q, q_rot):
    """Stands in for the query rotation kernel (recorded on its own) in front of a recorded split kernel."""
    from oscar_sglang.rotation import rotate_queries

    return rotate_queries(q, q_rot).contiguous()


def launches() -> list[tuple[str, object, tuple, dict]]:
    """Representative launches of every kernel: (label, jit function, args, constexpr kwargs)."""
    from oscar_sglang import format as fmt

    from . import layout, scenario
    from .decode import bf16_baseline
    from .decode import query_rotation as qrot
    from .decode import triton_kernel as dec
    from .extend import triton_kernel as ext
    from .hot_pass import triton_kernel as hot
    from .read import triton_kernel as rd
    from .repin import triton_kernel as rep
    from .write import triton_kernel as wr

    out = []

    def add(label, module, name, run, **override):
        for fn, args, kwargs in _record(module, name, run):
            out.append((label, fn, args, {**kwargs, **override}))

    int2, int4, int8 = fmt.RowFormat(2), fmt.RowFormat(4), fmt.RowFormat(8)
    rotations = set()
    for d, kf, vf, gqa in ((128, int2, int2, 4), (128, fmt.RowFormat(2, 32), fmt.RowFormat(2, 32), 3),
                           (64, int2, int2, 8), (64, fmt.RowFormat(2, 32), fmt.RowFormat(2, 32), 1),
                           (128, int4, int2, 4), (64, int8, fmt.RowFormat(4, 16), 4),
                           (128, fmt.RowFormat(2, symmetric=True), fmt.RowFormat(4, 32, True), 4)):
        kv = 2
        paged = scenario.paged_layout([5, 40], 16)
        rot = scenario.random_rotation(kv, d)
        store = layout.empty_store(paged.num_slots, kv, d, None, 8, k_format=kf, v_format=vf)
        g = store.k_format.group
        k, v = scenario.random_kv(4, kv, d)
        q = torch.randn(2, kv * gqa, d)
        same = kf.resolved(d) == vf.resolved(d)
        tag = (f"d={d} {kf.name(d)} gqa={gqa}" if same and kf.bits == 2 else
               f"d={d} K {kf.name(d)} V {vf.name(d)} gqa={gqa}")
        add(f"write {tag}", wr, "_write_kernel",
            lambda: wr.write_kv(k, v, torch.arange(4), store, rot, torch.tensor([0, -1, 2, 3])))
        if d == 128 and tag.startswith("d=128 int2 "):  # the tile the kernel benchmark times beside the default
            add(f"write {tag} kc=16", wr, "_write_kernel",
                lambda: wr.write_kv(k, v, torch.arange(4), store, rot, torch.tensor([0, -1, 2, 3]), kc=16))
        if (d, gqa) not in rotations:  # the query rotation kernel (bf16 queries, as a server passes them)
            rotations.add((d, gqa))
            add(f"decode query rotation d={d} gqa={gqa}", qrot, "_rotate_queries_kernel",
                lambda: qrot.rotated_queries(q.bfloat16(), rot.q_rot))
        with _replaced(dec, "merge_splits", _no_merge), _replaced(dec, "rotated_queries", _torch_rotation):
            for in_kernel in (False, True):  # queries rotated before the launch / inside it (small grids)
                add(f"decode {tag}{' q-rot in kernel' if in_kernel else ''}", dec, "_decode_split_kernel",
                    lambda: dec.decode_attention(q.bfloat16() if in_kernel else q, store, rot, paged.req_to_token,
                                                 paged.req_pool_indices, paged.seq_lens, 0.1, num_splits=4,
                                                 rotate_q_in_kernel=in_kernel, hot_windows=WINDOWS))
            if kf.bits == 2 and same and g == d:  # the decode loop's variants (decode_variants.py) at d 128;
                fold2 = {"fold": True, "num_warps": 2}  # at d 64 (SmolLM2) the 2-warp folded loop
                variants = ((*DECODE_VARIANTS, {**fold2, "rotate_q_in_kernel": True}) if d == 128 else
                            (fold2, {**fold2, "unpack_first": True}))
                for opts in variants:
                    in_kernel = opts.get("rotate_q_in_kernel", False)  # bf16 queries, as a server passes them
                    add(f"decode variant {tag} " + " ".join(f"{k}={v}" for k, v in opts.items()), dec,
                        "_decode_split_kernel",
                        lambda opts=opts, in_kernel=in_kernel: dec.decode_attention(
                            q.bfloat16() if in_kernel else q, store, rot, paged.req_to_token,
                            paged.req_pool_indices, paged.seq_lens, 0.1, num_splits=4, hot_windows=WINDOWS,
                            **{"rotate_q_in_kernel": False, **opts}))
            if d == 128 and tag.startswith("d=128 int2 "):  # the folded loop over symmetric rows (calibration's
                sym = fmt.RowFormat(2, symmetric=True)  # choice where the policy offers them): biased value codes
                store_sym = layout.empty_store(paged.num_slots, kv, d, None, 8, k_format=sym, v_format=sym)
                add(f"decode variant d={d} {sym.name(d)} gqa={gqa} fold=True num_warps=2", dec,
                    "_decode_split_kernel",
                    lambda: dec.decode_attention(q, store_sym, rot, paged.req_to_token, paged.req_pool_indices,
                                                 paged.seq_lens, 0.1, num_splits=4, rotate_q_in_kernel=False,
                                                 fold=True, num_warps=2, hot_windows=WINDOWS))
        add(f"read {tag} bf16", rd, "_read_kernel",
            lambda: rd.read_rows(store, torch.tensor([3, 0, 2, 1]), torch.bfloat16))
        qe = torch.randn(4, kv * gqa, d)
        for dots in ext.DOT_CHOICES:
            add(f"extend {tag} {dots} dots", ext, "_extend_kernel",
                lambda: ext.extend_attention(qe, k, v, store, rot, paged.req_to_token, paged.req_pool_indices,
                                             torch.tensor([3, 0]), torch.tensor([1, 3]), 0.1, dots=dots))
        if d == 128 and kf.bits == 2 and same and g == d:  # the prefill benchmark's tile sweep (bf16 dots)
            for tile in EXTEND_SWEEP:
                add(f"extend sweep {tag} " + " ".join(f"{k}={v}" for k, v in tile.items()), ext, "_extend_kernel",
                    lambda: ext.extend_attention(qe, k, v, store, rot, paged.req_to_token, paged.req_pool_indices,
                                                 torch.tensor([3, 0]), torch.tensor([1, 3]), 0.1, **tile))
        if g == d and kf.bits == 2 and same:
            with _replaced(bf16_baseline, "merge_splits", _no_merge):
                add(f"bf16 baseline {tag}", bf16_baseline, "_bf16_split_kernel",
                    lambda: bf16_baseline.decode_attention_bf16(q.bfloat16(), k, v, paged.req_to_token,
                                                                paged.req_pool_indices, paged.seq_lens, 0.1,
                                                                num_splits=2),
                    BF16_DOT=True)  # what runs on CUDA tensors
    # d 256 (Gemma-1's head size): the decode loop at its default block (default_block_n: 32 tokens there)
    paged, rot = scenario.paged_layout([5, 40], 16), scenario.random_rotation(2, 256)
    store = layout.empty_store(paged.num_slots, 2, 256, None, 8)
    q = torch.randn(2, 4, 256)
    with _replaced(dec, "merge_splits", _no_merge), _replaced(dec, "rotated_queries", _torch_rotation):
        add("decode d=256 int2 gqa=2", dec, "_decode_split_kernel",
            lambda: dec.decode_attention(q, store, rot, paged.req_to_token, paged.req_pool_indices, paged.seq_lens,
                                         0.1, num_splits=4, rotate_q_in_kernel=False, hot_windows=WINDOWS))
    req_len, req_pass = torch.tensor([0, 300, 9000]), torch.tensor([0, 7, 9])
    add("repin sink=64 recent=256", rep, "_repin_kernel",
        lambda: rep.repin_windows(torch.zeros(41, dtype=torch.long), torch.full((100,), -1, dtype=torch.int32),
                                  req_len, req_pass, torch.zeros(3, 9100, dtype=torch.int32), 64, 256))
    for over in (False, True):                   # regions that hold the batch's demand / that do not
        hs = _hot_set(sink_entries=2 if over else 80, recent_entries=3 if over else 320)
        live = torch.tensor([True, True, False, True])
        for name, other in (("_release_retire_track", "_assign"), ("_assign", "_release_retire_track")):
            with _replaced(hot, other, _Recorder(None, [])):          # the other kernel: recorded, dropped
                add(f"hot decode pass{', regions < batch' if over else ''}", hot, name,
                    lambda: hot.decode_pass(hs, torch.tensor([5, 9, 0, 7]), torch.tensor([1, 2, 0, 3]),
                                            torch.tensor([100, 300, 1, 70]), torch.zeros(4, 400, dtype=torch.int32),
                                            live, lambda: None))
    mid_o, mid_lse = torch.zeros(2, 8, 5, 128), torch.zeros(2, 8, 5)
    add("reduce d=128 splits=5", dec, "_decode_reduce_kernel", lambda: dec.merge_splits(mid_o, mid_lse))
    v_rot = scenario.random_rotation(2, 128).v_rot
    add("reduce+derotate d=128 splits=5 gqa=4 bf16", dec, "_decode_reduce_kernel",
        lambda: dec.merge_splits(mid_o, mid_lse, v_rot, torch.bfloat16))
    return out


def _hot_set(sink_entries: int, recent_entries: int):
    """A hot set (sink 64, recent 256) tracking 4 request rows, for the decode pass's launches."""
    from oscar_sglang.sglang.hot import HotSet

    hs = HotSet(1000, sink_entries, recent_entries, 64, 256)
    hs.track_requests(4)
    return hs


def compile_launch(fn, args: tuple, kwargs: dict, target):
    """One recorded launch compiled for ``target`` as the launcher would (same signature, constants,
    alignment attributes, options); returns Triton's compiled kernel (``.asm["cubin"]``, ``.metadata``)."""
    import triton
    from triton.compiler import ASTSource

    names = fn.arg_names
    options = {n: kwargs[n] for n in LAUNCH_OPTIONS if n in kwargs}
    sig, consts, attrs = {}, {}, {}
    for i, (n, a) in enumerate(zip(names, args)):
        sig[n], attr = _specialized(a)
        if sig[n] == "constexpr":
            consts[n] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    for n, a in kwargs.items():
        if n not in LAUNCH_OPTIONS:
            sig[n] = "constexpr"
            consts[n] = a
    sig = {n: sig[n] for n in names}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=options)


def _launch_info(label: str, fn, args: tuple, kwargs: dict, arch: int) -> dict:
    """Compile one recorded launch for ``sm_<arch>``: its name, shared memory, registers, spills, residency."""
    from triton.backends.compiler import GPUTarget

    kernel = compile_launch(fn, args, kwargs, GPUTarget("cuda", arch, 32))
    info = {"launch": label, "kernel": fn.__name__, "shared": kernel.metadata.shared,
            **_resource_usage(kernel.asm["cubin"])}
    if "reg" in info:  # warps one multiprocessor holds (sm_80/sm_90 limits)
        warps = kernel.metadata.num_warps
        info["warps/SM"] = warps * resident_programs(info["reg"], info["shared"], warps)
    return info


_WORKER_LAUNCHES: list | None = None


def _compile_nth(job: tuple[int, int]) -> dict:
    """In a worker process: compile launch ``i`` of its own :func:`launches` (recorded once per process;
    the same list in every process, since the launches depend only on shapes, dtypes and constants)."""
    global _WORKER_LAUNCHES
    if _WORKER_LAUNCHES is None:
        _WORKER_LAUNCHES = launches()
    i, arch = job
    return _launch_info(*_WORKER_LAUNCHES[i], arch)


def compile_all(arch: int = 90, verbose: bool = True, workers: int | None = None,
                only: tuple[str, ...] | None = None) -> list[dict]:
    """Compile every recorded launch for ``sm_<arch>`` (``only``: those whose label starts with one of these);
    returns name, registers and spills per launch, in :func:`launches`' order.  ``workers`` processes compile
    side by side (default: one per CPU core; each compile is one thread of LLVM and ptxas, ~1 s, the write
    kernel's up to ~5 s)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check must run without TRITON_INTERPRET=1")
    recorded = [(i, launch) for i, launch in enumerate(launches()) if only is None or launch[0].startswith(only)]
    workers = max(1, min(workers or os.cpu_count() or 1, len(recorded)))

    def report(info):
        if verbose:
            print(f"{info['launch']:40s} {info['kernel']:22s} " + " ".join(
                f"{k} {v}" for k, v in info.items() if k not in ("launch", "kernel")), flush=True)
        return info

    if workers == 1:
        return [report(_launch_info(*launch, arch)) for _, launch in recorded]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        infos = pool.imap(_compile_nth, [(i, arch) for i, _ in recorded])
        out = []
        for (_, (label, *_)), info in zip(recorded, infos):
            if info["launch"] != label:
                raise RuntimeError(f"a worker recorded launch {info['launch']!r} where this process has {label!r}")
            out.append(report(info))
        return out


def _resource_usage(cubin: bytes) -> dict:
    """Registers, stack and local (spill) bytes from ``cuobjdump --dump-resource-usage`` (empty if unavailable)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
        except OSError:
            return {}
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}


def _sass(cubin: bytes) -> list[tuple[int, str, str]]:
    """``(address, opcode, line)`` of each SASS instruction of a cubin (``cuobjdump -sass``)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, timeout=60).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), line))
    return out


def loop_counts(cubin: bytes, skipped_min: int = 64) -> dict:
    """Static instruction counts of a kernel's main loop: the first loop (span of a backward branch) that no
    other contains (the decode's loop over its blocks, before the folded decode's loop over blocks with a hot
    row; the extend kernel's over the prefix, before its causal part).

    ``loop``: every instruction of the loop body; ``common_path``: the body less the regions that conditional
    forward branches of more than ``skipped_min`` instructions jump over (in the decode kernel with
    ``hot_skip``: the code of a block with a hot row; never a region that holds all the loop's tensor-core
    dots, which is the loop's work), that is what one iteration over a block without hot rows issues per warp;
    ``ops``: that path's opcodes (first word), most frequent first; ``shared_wavefronts``: that path's
    shared-memory traffic in 128-byte wavefronts (:func:`shared_wavefronts`), for the balance of a block's
    issue, shared memory and HBM cycles (docs/KERNELS.md); ``loops``: every loop of the kernel, nested ones
    included, as ``[first address, last address, instructions]`` in address order (the folded decode: its
    cold loop, its loop over blocks with a hot row, and inside that the loop over a block's ``HOT_ROWS`` parts).
    """
    import collections
    import re

    sass = _sass(cubin)
    step = 16  # bytes per sm_70+ instruction
    loops = []
    skips = []
    for addr, op, line in sass:
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)\s*;", line)  # the target: the instruction's last operand (not its encoding)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr:
            loops.append((target, addr))
        elif re.search(r"@!?P\d", line) and (target - addr) // step > skipped_min:
            skips.append((addr + step, target))
    outer = [a for a in loops if not any(b != a and b[0] <= a[0] and a[1] <= b[1] for b in loops)]
    loop = min(outer) if outer else None
    if loop is None:
        return {"loop": 0, "common_path": 0, "ops": {}, "shared_wavefronts": 0, "loops": []}
    every = [[lo, hi, sum(1 for a, _, _ in sass if lo <= a <= hi)] for lo, hi in sorted(set(loops))]
    body = [(a, op) for a, op, _ in sass if loop[0] <= a <= loop[1]]
    skips = [(lo, hi) for lo, hi in skips if loop[0] <= lo and hi <= loop[1]]

    def mma(ops):
        return any(op.startswith("HMMA") for op in ops)

    if mma(op for _, op in body):  # a region that holds every dot of the loop is its work, not a rare branch
        # (the folded decode: a block with a hot row jumps over the cold block's attention, to its own loop)
        skips = [(lo, hi) for lo, hi in skips if mma(op for a, op in body if not lo <= a < hi)]
    path = [op for a, op in body if not any(lo <= a < hi for lo, hi in skips)]
    ops = collections.Counter(op.split(".")[0] for op in path)
    return {"loop": len(body), "common_path": len(path), "ops": dict(ops.most_common()),
            "shared_wavefronts": sum(shared_wavefronts(op) for op in path), "loops": every}


def shared_wavefronts(op: str) -> int:
    """Shared-memory wavefronts of one warp's SASS instruction ``op`` (full opcode), assuming no bank conflicts: a
    wavefront moves 128 bytes (32 banks of 4 bytes: sm_80/sm_90 serve one per cycle and multiprocessor), so a
    32-bit access per thread is 1, 64-bit 2, 128-bit 4, ``ldmatrix``/``stmatrix`` one per 8x8 matrix (``.4``:
    4); 0 for anything else."""
    parts = op.split(".")
    if parts[0] in ("LDSM", "STSM"):
        return int(parts[-1]) if parts[-1] in ("2", "4") else 1
    if parts[0] not in ("LDS", "STS"):
        return 0
    return {"64": 2, "128": 4}.get(parts[-1], 1)


def print_loop_counts(pattern: str, arch: int = 90) -> list[dict]:
    """:func:`loop_counts` of every recorded launch whose label contains ``pattern``."""
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check must run without TRITON_INTERPRET=1")
    rows = []
    for label, fn, args, kwargs in launches():
        if pattern not in label:
            continue
        kernel = compile_launch(fn, args, kwargs, GPUTarget("cuda", arch, 32))
        row = {"launch": label, "kernel": fn.__name__, **_resource_usage(kernel.asm["cubin"]),
               "shared": kernel.metadata.shared, **loop_counts(kernel.asm["cubin"])}
        rows.append(row)
        print(f"{label} ({fn.__name__}): loop {row['loop']} instructions, common path {row['common_path']}, "
              f"shared-memory wavefronts {row['shared_wavefronts']}, "
              f"reg {row.get('reg')} stack {row.get('stack')} shared {row['shared']}; every loop "
              + ", ".join(f"{n} ({lo:#x}-{hi:#x})" for lo, hi, n in row["loops"]) + "\n    "
              + ", ".join(f"{k} {v}" for k, v in list(row["ops"].items())[:16]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100), 90 (H100/H200)")
    p.add_argument("--sass", metavar="PATTERN", help="instead: the launches whose label contains PATTERN, with "
                   "static instruction counts of their main loop from the SASS (loop_counts)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes compiling side by side (default: one per CPU core)")
    a = p.parse_args(argv)
    if a.sass is not None:
        print_loop_counts(a.sass, a.arch)
        return 0
    compile_all(a.arch, workers=a.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
