"""scripts/device/decode_variants.py on CPU: its profile mode runs the kernels it names (under the interpreter),
and its report says which variant was how fast against the BF16 decode, and where one did not run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "device"))
import decode_variants  # noqa: E402


def test_profile_mode_launches_the_named_variants_and_agrees(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/device/decode_variants.py"), "--out", str(tmp_path),
                        "--profile"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    profiled = [line for line in r.stdout.splitlines() if line.startswith("profiled batch 2 ctx 96: ")]
    labels = [line.split(": ")[1].split(" (")[0] for line in profiled]
    assert labels == ["as run 1", "prefetch 1 + hot_skip, block_n 64", "default, fold", "default, fold, 2 warps"]
    assert all(line.endswith("differs from the first by 0.0e+00") for line in profiled)  # deterministic
    # the folded scales' fp16 dots against the first run's fp32 ones: within fp16 rounding, not bit-equal
    err = float(r.stdout.split("max relative difference ")[1].split()[0])
    assert 0 < err < 2**-8


def test_report_gives_each_variants_time_and_its_ratio_to_bf16():
    labels = [label for label, _ in decode_variants.VARIANTS]
    row = {"batch": 32, "context": 32768, "bf16_ms": 1.0, "first_vs_reference": 5e-3,
           **{label: {"ms": 2.0, "rel_diff_vs_first": 1e-3} for label in labels}}
    row[labels[1]] = {"ms": None, "note": "OutOfResources: shared memory"}
    text = decode_variants.markdown({"device": "X", "triton": "3.6.0", "torch": "2.11", "seconds": 1.0,
                                     "command": "cmd", "rows": [row], "problems": ["a problem"]})
    line = next(x for x in text.splitlines() if x.startswith("| 32 | 32768 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "1.000" and cells[3] == "2.000 (0.50)" and cells[4] == "OutOfResources: shared memory"
    assert "first vs reference 5.0e-03" in text and "- problem: a problem" in text


def test_report_gives_each_variants_grid_where_the_gpu_said():
    labels = [label for label, _ in decode_variants.VARIANTS]
    grid = {"splits": 2, "registers": 128, "spills": 36, "shared": 10240, "num_warps": 2, "resident": 8,
            "waves": 0.485}
    row = {"batch": 32, "context": 32768, "bf16_ms": 1.0,
           **{label: {"ms": 2.0, "rel_diff_vs_first": 1e-3, "grid": {"splits": 3}} for label in labels}}
    row[labels[-1]]["grid"] = grid
    text = decode_variants.markdown({"device": "X", "triton": "3.6.0", "torch": "2.11", "seconds": 1.0,
                                     "command": "cmd", "rows": [row], "problems": []})
    grids = [x for x in text.splitlines() if x.startswith("| 32 | 32768 | default")]
    assert grids == [f"| 32 | 32768 | {labels[-1]} | 2 | 128 (36) | 10.0 | 8 | 0.48 |"]
    # on the interpreter (no registers) no grid table at all; a GPU that did not say: why, once
    row[labels[-1]]["grid"] = {"splits": 3, "note": "registers not read: AttributeError: n_regs"}
    row[labels[-2]]["grid"] = {"splits": 3, "note": "registers not read: AttributeError: n_regs"}
    text = decode_variants.markdown({"device": "X", "triton": "3.6.0", "torch": "2.11", "seconds": 1.0,
                                     "command": "cmd", "rows": [row], "problems": []})
    assert text.count("- grid: registers not read: AttributeError: n_regs") == 1
    row[labels[-1]]["grid"] = row[labels[-2]]["grid"] = {"splits": 3}
    assert "Grids:" not in decode_variants.markdown({"device": "X", "triton": "3.6.0", "torch": "2.11",
                                                      "seconds": 1.0, "command": "cmd", "rows": [row],
                                                      "problems": []})


def _rows(times: dict, grid_of=None):
    """A report's rows, each variant at ``times[label]`` ms per case (a list, one per case)."""
    cases = [(1, 32768), (32, 32768), (128, 16384)]
    return [{"batch": b, "context": c, "bf16_ms": 1.0,
             **{label: {"ms": times[label][i], "rel_diff_vs_first": 1e-3, "grid": (grid_of or {}).get(label, {})}
                for label in times}} for i, (b, c) in enumerate(cases)]


def test_verdict_names_the_variant_fastest_everywhere_and_the_knob_that_serves_it():
    from oscar_sglang.sglang import settings

    labels = [label for label, _ in decode_variants.VARIANTS]
    last = labels[-1]  # the folded 2-warp loop at 128 registers, whole waves
    times = {label: [2.0, 3.0, 4.0] for label in labels}
    times[labels[1]] = [1.0, 2.0, 3.0]
    times[last] = [0.5, 1.0, 2.0]
    grid = {last: {"splits": 64, "registers": 128, "spills": 36, "shared": 10240, "num_warps": 2, "resident": 8,
                   "waves": 0.97}}
    line = decode_variants.verdict({"rows": _rows(times, grid)})
    assert line.startswith(f"Fastest at every case: {last}, 1.50-2.00x the default's speed; ")
    value = line.split("OSCAR_SGLANG_DECODE_KERNEL=")[1]
    # (on CPU the script's variants carry block_n 16 for the interpreter)
    assert value.startswith("fold=1,num_warps=2,max_registers=128,resident=8")
    # what the server makes of it: the variant's options, its whole waves as the measured residency
    opts = dict(decode_variants.VARIANTS)[last]
    assert settings.decode_kernel_options({settings.ENV_DECODE_KERNEL: value}) == \
        {**{k: v for k, v in opts.items() if k != "whole_waves"}, "resident": 8}
    # every variant's knob is one the server takes
    for label, opts in decode_variants.VARIANTS:
        settings.decode_kernel_options({settings.ENV_DECODE_KERNEL: decode_variants.knob(opts, grid.get(last))})


def test_verdict_when_the_default_wins_or_no_variant_wins_everywhere():
    labels = [label for label, _ in decode_variants.VARIANTS]
    times = {label: [2.0, 3.0, 4.0] for label in labels}
    times[labels[1]] = [1.0, 1.0, 1.0]
    assert "the default" in decode_variants.verdict({"rows": _rows(times)})
    times[labels[4]] = [0.5, 5.0, 0.5]
    line = decode_variants.verdict({"rows": _rows(times)})
    assert line == (f"No variant was fastest at every case: b1 32768: {labels[4]}; b32 32768: {labels[1]}; "
                    f"b128 16384: {labels[4]}.")
    times[labels[4]] = [None, 5.0, 0.5]  # a variant that did not run somewhere is not a candidate
    assert decode_variants.verdict({"rows": _rows(times)}).startswith("Fastest at every case: the default")
