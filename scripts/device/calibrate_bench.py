"""Time the calibration pipeline where a model of a given geometry runs, with random weights (speed, not accuracy).

    python scripts/device/calibrate_bench.py --model DIR --text FILE --out OUT [--tokens 8192] [--method oscar-center]

``--model`` is a config-only folder (``scripts/dummy_models.py``): the model
is built from its config directly on the device (``--device auto``: CUDA when
visible) in ``--dtype auto``, then ``oscar_sglang.calibration.calibrate``
runs on ``--tokens`` tokens of ``--text`` (the bundle's ShareGPT-format
Shakespeare file, or a ``.txt``): statistics capture on the device (float64
sums there), then the fit on the CPU. Prints and writes
``OUT/calibrate_bench.json``: build, capture and fit seconds, peak GPU memory
and peak RSS. The artifact is validated and written to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from oscar_sglang import artifacts as art
from oscar_sglang.calibration import data
from oscar_sglang.calibration import model as model_io
from oscar_sglang.calibration.calibrate import METHODS, CalibrationConfig, calibrate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--text", type=Path, required=True, help="ShareGPT-format JSON or a .txt file")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--method", default="oscar-center", choices=METHODS)
    p.add_argument("--device", default="auto", choices=model_io.DEVICES)
    p.add_argument("--dtype", default="auto", choices=("auto", *model_io.DTYPES))
    return p.parse_args(argv)


def read_texts(path: Path) -> dict[str, str]:
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        return {r["id"]: "\n".join(turn["value"] for turn in r["conversations"]) for r in rows}
    return {path.stem: path.read_text()}


def main(argv=None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = model_io.resolve_device(args.device)
    dtype = model_io.resolve_dtype(args.dtype, device)
    config = AutoConfig.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    t0 = time.perf_counter()
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in lm.parameters())
    print(f"built {args.model.name} ({params / 1e9:.2f} B parameters, random weights) on {device} in "
          f"{str(dtype).removeprefix('torch.')} in {build_s:.1f} s", flush=True)
    seqs = data.sequences_from_texts(tokenizer, read_texts(args.text), args.seq_len, args.tokens)
    t1 = time.perf_counter()
    artifact, _ = calibrate(lm, seqs, CalibrationConfig(method=args.method),
                            {"spec": str(args.text), "model": str(args.model)}, progress=False)
    total_s = time.perf_counter() - t1
    with tempfile.TemporaryDirectory() as tmp:
        art.save(artifact, tmp)  # validates (shapes, orthogonality, finiteness)
        art.load(tmp, expect=art.ModelFingerprint.from_config(config))
    result = {
        "model": args.model.name, "parameters": params, "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "method": args.method,
        "tokens": int(sum(s.numel() for s in seqs)), "seq_len": args.seq_len, "build_s": round(build_s, 1),
        "capture_s": artifact.calibration["seconds"]["statistics"], "total_s": round(total_s, 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]),
    }
    (args.out / "calibrate_bench.json").write_text(json.dumps(result, indent=1))
    print(f"calibrated ({args.method}, {result['tokens']} tokens): capture {result['capture_s']} s, "
          f"whole pipeline {result['total_s']} s; peak GPU memory {result['peak_gpu_mb']} MB, "
          f"peak RSS {result['peak_rss_mb']} MB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
