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
    # on the interpreter (no registers) no grid table at all
    row[labels[-1]]["grid"] = {"splits": 3}
    assert "Grids:" not in decode_variants.markdown({"device": "X", "triton": "3.6.0", "torch": "2.11",
                                                      "seconds": 1.0, "command": "cmd", "rows": [row],
                                                      "problems": []})
