"""Why a layer's keys or values are hard at INT2, per (layer, KV head), and how much each lever buys.

For captured post-RoPE keys and values ``x[tokens, kv_heads, d]`` of one layer:

* ``mean_share``: the share of the energy in the per-head channel mean,
  ``||mean||^2 / E||x||^2`` (what key centering removes; large for keys with a
  constant offset from RoPE's low-frequency channels or a QKV bias);
* ``rms_spread``: the largest channel RMS over the median channel RMS (a few
  huge channels stretch every row's range; what a rotation spreads);
* ``outliers``: how many channels have an RMS above ``OUTLIER_FACTOR`` times the median;
* the INT2 round-trip error ``||Q(x') - x'|| / ||x||`` of the row format after
  each lever, cumulatively: ``identity``, ``hadamard`` (rotation),
  ``hadamard+center`` (key means of another text; keys only), and any
  calibrated artifacts passed in (their own rotations, means and clips).

The means used for centering must come from a different text than the one
measured, as in serving.  Plain torch; no SGLang.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot
from oscar_sglang.artifacts import RotationArtifacts

OUTLIER_FACTOR = 4.0


def shape_statistics(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per KV head of ``x[tokens, kv_heads, d]``: mean_share, rms_spread, outliers (tensors ``[kv_heads]``)."""
    x = x.double()
    energy = x.pow(2).sum(-1).mean(0)
    mean_share = x.mean(0).pow(2).sum(-1) / energy.clamp_min(1e-30)
    rms = x.pow(2).mean(0).sqrt()  # [kv_heads, d]
    median = rms.median(-1).values.clamp_min(1e-30)
    return {"mean_share": mean_share, "rms_spread": rms.amax(-1) / median,
            "outliers": (rms > OUTLIER_FACTOR * median.unsqueeze(-1)).sum(-1).double()}


def roundtrip_error(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None, clip: torch.Tensor,
                    group_size: int, bits: int = 2, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``Q(x') - x'`` for ``x[tokens, kv_heads, d]`` stored as ``x' = (x - mean) R`` (rows of ``bits``); with key
    channel scales ``scale [kv_heads, d]`` the rows are ``(x - mean) R diag(s)`` and the error is returned in the
    orthogonal frame (divided by ``s``), where norms are the model's."""
    s = None if scale is None else scale.float()
    xr = rot.rotate_kv(x, rotation if s is None else rotation * s.unsqueeze(-2), mean)
    xq = fmt.fake_quantize(xr, group_size, clip_ratio=clip.reshape(-1, 1), bits=bits)
    return (xq - xr) if s is None else (xq - xr) / s


def head_errors(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None, clip: torch.Tensor,
                group_size: int, bits: int = 2, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Round-trip error per KV head (INT2 unless ``bits``), ``[kv_heads]``: ``||Q(x') - x'|| / ||x||`` over the
    head's rows (:func:`roundtrip_error`)."""
    diff = roundtrip_error(x, rotation, mean, clip, group_size, bits, scale)
    return diff.double().pow(2).sum((0, 2)).sqrt() / x.double().pow(2).sum((0, 2)).sqrt().clamp_min(1e-30)


def diagnose(kv: dict[int, tuple[torch.Tensor, torch.Tensor]], levers: dict[str, RotationArtifacts]) -> list[dict]:
    """One row per (layer, KV head, "k"/"v"): the shape statistics and the error after each lever.

    ``levers`` maps a name to an artifact; values ignore an artifact's key means.
    """
    rows = []
    for layer, (k, v) in sorted(kv.items()):
        for which, x in (("k", k), ("v", v)):
            stats = shape_statistics(x)
            errors = {}
            for name, a in levers.items():
                lr, lf = a.layers[layer], a.layer_formats[layer]
                r, clip, f = (lr.k_rotation, lr.k_clip, lf.k) if which == "k" else (lr.v_rotation, lr.v_clip, lf.v)
                errors[name] = head_errors(x, r, lr.k_mean if which == "k" else None, clip, f.group, f.bits,
                                           lr.k_scale if which == "k" else None)
            for h in range(x.shape[1]):
                row = {"layer": layer, "head": h, "tensor": which}
                row.update({s: float(t[h]) for s, t in stats.items()})
                row["error"] = {name: float(e[h]) for name, e in errors.items()}
                rows.append(row)
    return rows


def worst_table(rows: list[dict], lever: str, n: int = 12) -> str:
    """Markdown: the ``n`` (layer, head, K/V) with the largest error after ``lever``, with what makes them hard."""
    names = list(rows[0]["error"]) if rows else []
    top = sorted(rows, key=lambda r: -r["error"][lever])[:n]
    head = "| layer | KV head | K/V | mean share | max/median channel RMS | outlier channels | " + \
        " | ".join(f"err {x}" for x in names) + " |"
    lines = [head, "|" + "---:|" * (6 + len(names))]
    for r in top:
        lines.append(f"| {r['layer']} | {r['head']} | {r['tensor'].upper()} | {r['mean_share']:.2f} | "
                     f"{r['rms_spread']:.1f} | {r['outliers']:.0f} | "
                     + " | ".join(f"{r['error'][x]:.3f}" for x in names) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path, title: str) -> None:
    """Heat maps (layer x KV head) of mean share, channel-RMS spread and each lever's error, keys and values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = 1 + max(r["layer"] for r in rows)
    heads = 1 + max(r["head"] for r in rows)
    names = list(rows[0]["error"])
    panels = [("mean_share", "mean share"), ("rms_spread", "max/median channel RMS")] + \
        [(f"error:{n}", f"INT2 error, {n}") for n in names]
    fig, axes = plt.subplots(2, len(panels), figsize=(2.3 * len(panels) + 1, 7), squeeze=False)
    for row_i, which in enumerate(("k", "v")):
        for col, (key, label) in enumerate(panels):
            grid = torch.full((layers, heads), float("nan"))
            for r in rows:
                if r["tensor"] == which:
                    grid[r["layer"], r["head"]] = r["error"][key[6:]] if key.startswith("error:") else r[key]
            ax = axes[row_i][col]
            im = ax.imshow(grid.numpy(), aspect="auto", cmap="magma", interpolation="nearest")
            ax.set_title(f"{'keys' if which == 'k' else 'values'}: {label}", fontsize=8)
            ax.set_xlabel("KV head", fontsize=7)
            ax.set_ylabel("layer", fontsize=7)
            fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(rows: list[dict], out: Path, title: str, command: str, date: str, meta: dict | None = None) -> None:
    """``diagnostics.{json,md,png}`` in ``out``: the hardest (layer, head, K/V), the means, the heat maps."""
    levers = list(rows[0]["error"])
    best = levers[-1]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostics.json").write_text(json.dumps({"meta": {**(meta or {}), "title": title, "command": command,
                                                               "date": date}, "rows": rows}, indent=1) + "\n")
    lines = [f"# INT2 diagnostics per layer and KV head ({date})", "",
             f"Command: `{command.strip()}`; {title}.", "",
             "Mean share: energy in the per-head channel mean (what key centering removes); max/median "
             "channel RMS and outlier channels (RMS > 4x the median): what a rotation spreads; errors: "
             "INT2 round trip ||Q(x') - x'|| / ||x|| after each lever, cumulatively "
             f"({', '.join(levers)}).", "",
             f"The {min(12, len(rows))} hardest (layer, head, K/V) after `{best}`:", "",
             worst_table(rows, best), ""]
    for which, name in (("k", "keys"), ("v", "values")):
        sel = [r for r in rows if r["tensor"] == which]
        means = ", ".join(f"{x} {sum(r['error'][x] for r in sel) / len(sel):.3f}" for x in levers)
        lines.append(f"Mean over {len(sel)} (layer, head) of the {name}: {means}; mean share "
                     f"{sum(r['mean_share'] for r in sel) / len(sel):.2f}, max/median channel RMS "
                     f"{sum(r['rms_spread'] for r in sel) / len(sel):.1f}.")
    (out / "diagnostics.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "diagnostics.png", title)
