"""Every kernel compiles for a real GPU target (sm_90) down to a cubin, even on a machine without a GPU.

The interpreter accepts programs the compiler refuses; this runs Triton's real
pipeline (ptxas included) on the launches the wrappers make, in a subprocess
without TRITON_INTERPRET, and checks each kernel's shared memory fits the
smallest opt-in limit of sm_80+ GPUs (99 KiB, sm_86/89); the extend tiles and
decode variants that only the benchmarks try on an H200 are held to sm_90's 227 KiB.
Since the layouts differ by target (sm_86/89 compile like sm_80, not like sm_90),
the extend and decode kernels are also compiled for sm_89 and held to its limit there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED_LIMIT = 99 * 1024


def test_kernels_compile_for_sm90():
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build has no bundled ptxas")
    code = ("import json; from oscar_sglang.kernels import compile_check as c;"
            "print(json.dumps(c.compile_all(90, verbose=False)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    kernels = {x["kernel"] for x in results}
    assert kernels == {"_write_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_extend_kernel",
                       "_bf16_split_kernel", "_repin_kernel", "_release_retire_track", "_assign",
                       "_read_kernel", "_rotate_queries_kernel"}
    for x in results:  # the benchmarks' candidate tiles and variants are for sm_90 (227 KiB); a default must fit all
        h200_only = x["launch"].startswith(("extend sweep", "decode variant"))
        assert x["shared"] <= (227 * 1024 if h200_only else SHARED_LIMIT), x
        # and no launch the server makes spills registers to a stack on sm_90 with the pinned Triton (3.8): a
        # spill is slow on a GPU and invisible on CPU otherwise (Triton 3.9 makes the write kernel spill 80 B:
        # docs/KERNELS.md, "Triton 3.9"; some variants only the benchmarks time spill on purpose, e.g. 128 registers)
        if not h200_only and "stack" in x:
            assert x["stack"] == 0 and x["local"] == 0, x
    assert any(x["launch"].startswith("extend sweep") for x in results)


def test_the_extend_and_decode_kernels_fit_sm89_shared_memory_tf32_extend_dots_with_one_stage():
    """sm_86/89 (A10, L4, L40S, RTX 30/40) allow 99 KiB of shared memory per block, the least of sm_80+, and
    compile like sm_80: the extend kernel's TF32 dots at d 128 take 98-101.5 KiB there (64-96 KiB on sm_90),
    over the limit with INT4 keys or symmetric rows, which Triton refuses to launch. So compiled for sm_89:
    every launch the wrappers make fits, but two-stage TF32 extend launches, which fit with one stage (the
    stage ``extend.triton_kernel.launch_fitting`` falls back to); the default bf16 dots fit as they are."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build has no bundled ptxas")
    prefixes = ("extend d=", "decode d=")
    code = ("import json; from oscar_sglang.kernels import compile_check as c;"
            f"p = {prefixes!r}; r = c.compile_all(89, verbose=False, only=p);"
            "L = [x for x in c.launches() if x[0].startswith(p)];"
            f"one = [c._launch_info(lbl, fn, a, {{**kw, 'num_stages': 1}}, 89) for x, (lbl, fn, a, kw) in zip(r, L)"
            f" if x['shared'] > {SHARED_LIMIT}];"
            "print(json.dumps([r, one]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    results, one_stage = json.loads(r.stdout.strip().splitlines()[-1])
    assert {x["kernel"] for x in results} == {"_extend_kernel", "_decode_split_kernel"}
    over = [x["launch"] for x in results if x["shared"] > SHARED_LIMIT]
    assert all(label.startswith("extend d=128") and label.endswith("tf32 dots") for label in over), over
    assert [x["launch"] for x in one_stage] == over and all(x["shared"] <= SHARED_LIMIT for x in one_stage), one_stage


def test_loop_counts_read_the_decode_loops_sass():
    """``compile_check --sass``: the main loop found in the SASS (the first, before any loop over blocks with a
    hot row), the hot-row branch left out of its common path, every opcode of that path counted, and the
    folded-scales decode converting no code to a float."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton build has no bundled cuobjdump")
    code = ("import json; from oscar_sglang.kernels import compile_check as c;"
            "print(json.dumps(c.print_loop_counts('decode d=128 int2 gqa=4', 90)"
            " + c.print_loop_counts('decode variant d=128 int2 gqa=4 fold=True', 90)"
            " + c.print_loop_counts('decode variant d=128 int2 gqa=4 hot_loop=True', 90)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = {x["launch"]: x for x in json.loads(r.stdout.strip().splitlines()[-1])}
    default, fold = rows["decode d=128 int2 gqa=4"], rows["decode variant d=128 int2 gqa=4 fold=True"]
    # the default reads the hot rows' BF16 copies inside its loop, under a branch left out of the common path;
    # with hot_loop blocks with a hot row go to a loop of their own after the main one (the first): that loop is
    # all common path, the cold block's attention included (a forward branch jumps over it on a hot block); the
    # folded loop attends every block's cold rows without a branch around them (3.8: its one branch is the loop's
    # own, back; 3.6 adds one over a single instruction), the hot rows in the loop after it
    assert 0 < default["common_path"] < default["loop"], default
    # every loop listed, the main one first; the folded loop's blocks with a hot row are attended in a loop after
    # it, their HOT_ROWS parts in a loop inside that one (what a hot block costs: docs/KERNELS.md)
    cold, hot_blocks, parts = fold["loops"][:3]
    assert cold[2] == fold["loop"] and cold[1] < hot_blocks[0], fold["loops"]
    assert hot_blocks[0] <= parts[0] and parts[1] <= hot_blocks[1] and parts[2] < hot_blocks[2], fold["loops"]
    own = rows["decode variant d=128 int2 gqa=4 hot_loop=True"]
    for x in (fold, own):
        assert 0 < x["common_path"] == x["loop"], x
    assert fold["ops"].get("BRA", 0) <= 2 and own["ops"].get("BRA", 0) >= 3, (fold["ops"], own["ops"])
    for x in (default, fold, own):
        assert x["ops"]["HMMA"] > 0 and sum(x["ops"].values()) == x["common_path"]
    # per 64-token block and thread (4 warps): the default converts each of its 128 codes to fp32 (an I2F each)
    # before the scale-and-zero FMA; the folded loop converts none: its inline PTX puts two codes in the fp16
    # mantissas of one register (a LOP3, 64 for 128 codes) and leaves the power of two under them for after the
    # dots (no HFMA2 per pair to take it off, as until 2026-12-05), and issues fewer instructions in all
    # (docs/KERNELS.md; both Triton 3.6 and 3.8)
    assert default["ops"].get("I2FP", 0) + default["ops"].get("I2F", 0) >= 128
    assert fold["ops"].get("I2FP", 0) + fold["ops"].get("I2F", 0) == 0
    assert fold["ops"].get("LOP3", 0) >= 64 and fold["ops"].get("HFMA2", 0) < 32
    assert fold["common_path"] < default["common_path"]
    # the values' codes unpacked before they cross to their dots' transposed layout (fp16 through shared memory by
    # ldmatrix.trans) instead of as bytes after (a PRMT shuffle per byte pair): far fewer PRMT, fewer instructions
    fold2 = rows["decode variant d=128 int2 gqa=4 fold=True num_warps=2"]
    first = rows["decode variant d=128 int2 gqa=4 fold=True num_warps=2 unpack_first=True"]
    assert first["ops"].get("PRMT", 0) < fold2["ops"].get("PRMT", 0) / 2, (first["ops"], fold2["ops"])
    assert first["common_path"] < fold2["common_path"] and first["shared"] > 2 * fold2["shared"]
    # ... for more shared-memory traffic: the fp16 values are 8 times the code bytes
    assert first["shared_wavefronts"] > 2 * fold2["shared_wavefronts"] > 0


def test_shared_wavefronts_of_a_warps_shared_memory_instructions():
    """128-byte wavefronts (no bank conflicts): what a warp moves per instruction, at least one."""
    from oscar_sglang.kernels.compile_check import shared_wavefronts

    cases = {"LDS": 1, "LDS.U16": 1, "STS.U8": 1, "LDS.64": 2, "STS.64": 2, "STS.128": 4, "LDS.U.128": 4,
             "LDSM.16.M88.4": 4, "LDSM.16.MT88.4": 4, "LDSM.16.M88.2": 2, "LDSM.16.M88": 1, "STSM.16.M88.4": 4,
             "LDG.E.128": 0, "HMMA.16816.F32": 0, "BAR.SYNC.DEFER_BLOCKING": 0, "LDL.64": 0}
    assert {op: shared_wavefronts(op) for op in cases} == cases


def test_no_jit_function_leaves_a_string_constexpr_to_its_default():
    """Triton 3.6, the H200 machine's, fails to compile a call to a ``@triton.jit`` function that leaves a string
    ``tl.constexpr`` parameter to its default ("'str' object has no attribute 'type'"); 3.8, CI's, accepts it, so
    only the GPU (or the dry run's 3.6 compile check) would find it.  Every such default in kernels/ is refused
    here (ints are fine with both)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "kernels"
    found, jitted = [], 0
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in fn.decorator_list):
                continue
            jitted += 1
            args = fn.args.args[len(fn.args.args) - len(fn.args.defaults):]
            for arg, default in zip(args, fn.args.defaults):
                if isinstance(default, ast.Constant) and isinstance(default.value, str):
                    found.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name}({arg.arg}={default.value!r})")
    assert not found, found
    assert jitted > 40, jitted  # the walk saw the kernels and their device functions


def test_every_launch_says_whether_it_contracts_floating_point():
    """Triton 3.9 warns at a launch that leaves floating-point contraction (``a * b + c`` -> FMA) to its
    default, and 3.10 turns that default off: a kernel that relied on it would compile to other numbers and
    other instructions (the decode loop's counts, docs/KERNELS.md) under a user's newer Triton.  So every launch
    the wrappers make says which it wants: off where the rows must equal torch's bit for bit (the write kernel's
    codes, the read kernel's rows), on everywhere else (what every GPU run so far compiled)."""
    from oscar_sglang.kernels.compile_check import launches

    fusion = {}
    for _, fn, _, kwargs in launches():
        assert "enable_fp_fusion" in kwargs, (fn.__name__, sorted(kwargs))
        fusion.setdefault(fn.__name__, set()).add(kwargs["enable_fp_fusion"])
    assert fusion == {"_write_kernel": {False}, "_read_kernel": {False}, "_decode_split_kernel": {True},
                      "_decode_reduce_kernel": {True}, "_extend_kernel": {True}, "_bf16_split_kernel": {True},
                      "_rotate_queries_kernel": {True}, "_repin_kernel": {True}, "_release_retire_track": {True},
                      "_assign": {True}}
