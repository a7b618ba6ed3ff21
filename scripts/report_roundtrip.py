"""INT2 round-trip error of real keys and values, per layer, identity vs Hadamard (vs centred Hadamard).

    .venv/bin/python scripts/report_roundtrip.py            # default model, writes docs/roundtrip.*

Captures post-RoPE keys and values of the model on an evaluation text, and
measures ``||Q(x R) - x R|| / ||x||`` per layer for each rotation.  The
centred control subtracts per-(layer, KV head) key means taken from a
*different* text (the calibration text), as OptR's centering would.
Writes a markdown table, a PNG plot and the raw JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from oscar_sglang import artifacts as art
from oscar_sglang.calibration import diagnostics, roundtrip

ROOT = Path(__file__).resolve().parents[1]


def plot(results, meta, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, which, title in ((axes[0], "k", "keys"), (axes[1], "v", "values")):
        for name, rows in results.items():
            ax.plot([r["layer"] for r in rows], [r[which] for r in rows], marker="o", ms=3, label=name)
        ax.set_title(f"INT2 round-trip error of {title}")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("||Q(x') - x'|| / ||x||")
    axes[0].legend()
    fig.suptitle(f"{Path(meta['model']).name}: {meta['eval_tokens']} tokens of {meta['eval_text']}, "
                 f"group {meta['group_size']} ({meta['bits_per_element']} bits/elt)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_diagnostics(rows, meta, out: Path) -> None:
    """Per (layer, KV head): what makes keys/values hard and the error after each lever."""
    title = (f"{Path(meta['model']).name}: {meta['eval_tokens']} tokens of {meta['eval_text']} "
             f"(key means from {meta['center_text']}), {meta['bits_per_element']} bits/elt")
    diagnostics.write_report(rows, out, title, meta["command"], meta["date"],
                             {k: v for k, v in meta.items() if k != "key_statistics"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF file (default: embedded SmolLM2-135M)")
    p.add_argument("--eval-text", default=None, help="text (by stem) whose keys/values are measured (default: first evaluation text)")
    p.add_argument("--center-text", default=None, help="text the key means are taken from (default: first calibration text)")
    p.add_argument("--text-folder", type=Path, default=None, help="folder of .txt files (default: Shakespeare cache)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for roundtrip.* and diagnostics.*")
    p.add_argument("--rotations", type=Path, nargs="*", default=[],
                   help="calibrated rotations directories to diagnose as further levers (named by folder)")
    args = p.parse_args(argv)
    t0 = time.time()
    levers = {d.name: art.load(d) for d in args.rotations}
    results, meta, diagnosis = roundtrip.measure(args.model, args.eval_text, args.center_text, args.tokens,
                                                 args.seq_len, text_folder=args.text_folder, levers=levers)
    meta["seconds"] = round(time.time() - t0, 1)
    meta["date"] = datetime.date.today().isoformat()
    meta["command"] = "python scripts/report_roundtrip.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    table = roundtrip.markdown_table(results)
    (args.out / "roundtrip.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (args.out / "roundtrip_table.md").write_text(table + "\n")
    plot(results, meta, args.out / "roundtrip.png")
    print(table)
    write_diagnostics(diagnosis, meta, args.out)
    print(f"\nwrote {args.out}/roundtrip.json, roundtrip_table.md, roundtrip.png, diagnostics.json, "
          f"diagnostics.md, diagnostics.png in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
