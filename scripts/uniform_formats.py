"""One row format for every layer's keys and one for its values, on top of a saved artifact's rotations.

    .venv/bin/python scripts/uniform_formats.py --from ROT --k int4 --v int2 --out ROT_K4

For ablations of the precision policy (which keys or values matter, what a
near-lossless INT8 cache keeps): the rotations, key means and scales are the
source's; a side keeps its clip levels where its format stays the source's
layer format, and gets no clip (1.0) where it changes.  Format names as the
startup line prints them: ``int2``, ``int4``, ``int8``, ``int2/g32``, ...
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch

from oscar_sglang import artifacts as art
from oscar_sglang.format import RowFormat


def parse_format(name: str) -> RowFormat:
    m = re.fullmatch(r"int(\d+)(sym)?(?:/g(\d+))?", name.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a row format like int2, int4, int8, int2/g32 or int2sym (scale "
                                         f"only), got {name!r}")
    try:
        return RowFormat(int(m.group(1)), int(m.group(3)) if m.group(3) else None, m.group(2) is not None)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def uniform(a: art.RotationArtifacts, k: RowFormat, v: RowFormat) -> art.RotationArtifacts:
    d = a.model.head_dim
    k, v = k.resolved(d), v.resolved(d)
    layers = []
    for lr, lf in zip(a.layers, a.layer_formats):
        layers.append(replace(lr, k_clip=lr.k_clip if lf.k.resolved(d) == k else torch.ones_like(lr.k_clip),
                              v_clip=lr.v_clip if lf.v.resolved(d) == v else torch.ones_like(lr.v_clip)))
    out = replace(a, layers=layers).with_formats([art.LayerFormat(k, v)] * len(layers))
    out.calibration = {**a.calibration, "uniform_formats": {"k": k.name(d), "v": v.name(d)}}
    out.calibration.pop("policy", None)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="src", type=Path, required=True, help="rotations directory to start from")
    p.add_argument("--k", type=parse_format, required=True, help="key row format of every layer")
    p.add_argument("--v", type=parse_format, required=True, help="value row format of every layer")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        out = uniform(art.load(args.src), args.k, args.v)
    except (FileNotFoundError, ValueError) as e:
        print(f"uniform_formats: error: {e}", file=sys.stderr)
        return 2
    art.save(out, args.out)
    print(f"wrote {args.out}: {out.bits_per_element:.3f} bits/element ({out.policy_summary()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
