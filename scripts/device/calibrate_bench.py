"""Time the calibration pipeline where a model of a given geometry runs, with random weights (speed, not accuracy).

    python scripts/device/calibrate_bench.py --model DIR --text FILE --out OUT [--tokens 20000] [--method optr]
        [--bits 2.75|int2] [--layers N] [--threads N] [--device cpu]

``--model`` is a config-only folder (``scripts/dummy_models.py``): the model
is built from its config directly on the device (``--device auto``: CUDA when
visible) in ``--dtype auto``, then ``oscar_sglang.calibration.calibrate``
runs on ``--tokens`` tokens of ``--text`` (the bundle's ShareGPT-format
Shakespeare file, a ``.txt``, or a data spec of ``oscar-calibrate --data``
such as ``mix``): statistics capture on the device (float64 sums there), then
the fit on the CPU. The defaults of ``--tokens``, ``--seq-len``,
``--method`` and ``--bits`` are ``oscar-calibrate``'s (its default pipeline:
OptR and the precision policy, symmetric rows allowed); ``--bits int2``
leaves the policy out. ``--layers N`` builds only the first
``N`` layers of the geometry: every stage but the capture works layer by layer,
so ``N`` layers' fit and policy seconds scale to the whole model (the JSON gives
them per layer). Prints and writes ``OUT/calibrate_bench.json``: build,
capture, fit and policy seconds, peak GPU memory and peak RSS. The artifact is
validated and written to a temporary folder.
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
from oscar_sglang.calibration import cli as calibration_cli
from oscar_sglang.calibration import data
from oscar_sglang.calibration import model as model_io
from oscar_sglang.calibration.calibrate import METHODS, CalibrationConfig, calibrate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--text", required=True,
                   help="ShareGPT-format JSON, a .txt file, or a data spec of oscar-calibrate --data (e.g. mix)")
    p.add_argument("--out", type=Path, required=True)
    # the defaults are oscar-calibrate's own, so that the bench times the pipeline a user runs
    cli = calibration_cli.build_parser()
    p.add_argument("--tokens", type=int, default=cli.get_default("tokens"))
    p.add_argument("--seq-len", type=int, default=cli.get_default("seq_len"))
    p.add_argument("--method", default=cli.get_default("method"), choices=METHODS)
    p.add_argument("--device", default="auto", choices=model_io.DEVICES)
    p.add_argument("--dtype", default="auto", choices=("auto", *model_io.DTYPES))
    p.add_argument("--bits", type=calibration_cli.bits_budget, default=cli.get_default("bits"),
                   help="precision policy budget, or 'int2' for none (default: oscar-calibrate's)")
    p.add_argument("--layers", type=int, default=None, help="build only the first N layers of the geometry")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    return args


def read_texts(text: str) -> dict[str, str]:
    path = Path(text)
    if not path.exists():
        return data.load_texts(text)
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        return {r["id"]: "\n".join(turn["value"] for turn in r["conversations"]) for r in rows}
    return {path.stem: path.read_text()}


def main(argv=None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    device = model_io.resolve_device(args.device)
    dtype = model_io.resolve_dtype(args.dtype, device)
    config = AutoConfig.from_pretrained(args.model)
    if args.layers is not None:
        config.num_hidden_layers = min(args.layers, config.num_hidden_layers)
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
    cfg = CalibrationConfig(method=args.method, bits=args.bits, symmetric_rows=args.bits is not None)
    artifact, _ = calibrate(lm, seqs, cfg,
                            {"spec": str(args.text), "model": str(args.model)}, progress=False)
    total_s = time.perf_counter() - t1
    with tempfile.TemporaryDirectory() as tmp:
        art.save(artifact, tmp)  # validates (shapes, orthogonality, finiteness)
        art.load(tmp, expect=art.ModelFingerprint.from_config(config))
    seconds = artifact.calibration["seconds"]
    layers = config.num_hidden_layers
    fit_s = artifact.calibration.get("method_seconds", 0.0)
    result = {
        "model": args.model.name, "layers": layers, "parameters": params, "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "method": args.method, "bits": args.bits,
        "threads": torch.get_num_threads(),
        "tokens": int(sum(s.numel() for s in seqs)), "seq_len": args.seq_len, "build_s": round(build_s, 1),
        "capture_s": seconds.get("statistics", 0.0), "fit_s": fit_s, "policy_s": seconds.get("policy"),
        "fit_s_per_layer": round(fit_s / layers, 2),
        "policy_s_per_layer": round(seconds["policy"] / layers, 2) if "policy" in seconds else None,
        "total_s": round(total_s, 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]),
    }
    (args.out / "calibrate_bench.json").write_text(json.dumps(result, indent=1))
    per_layer = f"{result['fit_s_per_layer']} s"
    policy = ""
    if result["policy_s"] is not None:
        policy = f", policy {result['policy_s']} s"
        per_layer += f" + {result['policy_s_per_layer']} s"
    print(f"calibrated ({args.method}{'' if args.bits is None else f', {args.bits:g} bits'}, {result['tokens']} "
          f"tokens, {layers} layers): capture {result['capture_s']} s, fit {fit_s} s{policy} ({per_layer} per "
          f"layer), "
          f"whole pipeline {result['total_s']} s; peak GPU memory {result['peak_gpu_mb']} MB, "
          f"peak RSS {result['peak_rss_mb']} MB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
