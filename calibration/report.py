"""Markdown tables and PNG plots for the accuracy report (matplotlib imported lazily)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def niah_hits(niah: list[dict]) -> list[bool]:
    """Every trial's outcome, in a fixed order (length, depth, trial)."""
    return [bool(h) for x in niah for h in x.get("hits", [])]


MARGIN_LEGEND = ("key margin: per pass-key trial, the smallest lead in log-probability (nats) the key's tokens had "
                 "under greedy decoding, or, negative, by how much the first wrong token beat the key's; mean over "
                 "trials. margin vs BF16: the mean of the per-trial change against BF16 (same prompts) ± 1.96 "
                 "standard errors.")


def niah_margins(niah: list[dict]) -> list[float | None]:
    """Every trial's key margin (``evaluate.key_margin``), same order as :func:`niah_hits`; None where absent."""
    out = []
    for x in niah:
        m = x.get("margins") or [None] * len(x.get("hits", []))
        out += [None if v is None else float(v) for v in m]
    return out


def paired_margin_change(ref: list[float | None], other: list[float | None]) -> tuple[float, float, int] | None:
    """Mean of ``other - ref`` over the trials both have, its 95 % half-width (1.96 standard errors), and n."""
    diffs = [b - a for a, b in zip(ref, other) if a is not None and b is not None]
    if len(ref) != len(other) or len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, 1.96 * (var / len(diffs)) ** 0.5, len(diffs)


def _margin_cells(name: str, margins: list[float | None], ref: list[float | None]) -> str:
    vals = [m for m in margins if m is not None]
    mean = f"{sum(vals) / len(vals):.2f}" if vals else "–"
    change = paired_margin_change(ref, margins) if name != "bf16" else None
    return f"{mean} | " + (f"{change[0]:+.2f} ± {change[1]:.2f}" if change else "–") + " |"


def accuracy_table(results: dict) -> str:
    """One row per method: perplexities, mean layer error, pass keys found, how many of BF16's it keeps,
    and the pass keys' mean margin (nats; ``evaluate.key_margin``) with its paired change against BF16."""
    ctxs = sorted({int(c) for r in results.values() for c in r["ppl"]})
    ref = niah_hits((results.get("bf16") or {}).get("niah") or [])
    ref_margins = niah_margins((results.get("bf16") or {}).get("niah") or [])
    head = ("| method | bits/elt | " + "".join(f"PPL {c} | PPL {c} tail | " for c in ctxs)
            + "mean layer err | pass keys found | BF16's passes kept | key margin | margin vs BF16 |")
    lines = [head, "|---|---:|" + "---:|---:|" * len(ctxs) + "---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        ppl = "".join(f"{r['ppl'][str(c)]['ppl']:.2f} | {r['ppl'][str(c)]['ppl_tail']:.2f} | " for c in ctxs)
        err = r.get("layer_errors")
        err_s = f"{sum(err) / len(err):.3f}" if err else "0 (reference)"
        hits = niah_hits(r.get("niah") or [])
        found = f"{sum(hits)}/{len(hits)}" if hits else "–"
        kept = (f"{sum(a and b for a, b in zip(ref, hits))}/{sum(ref)}"
                if ref and len(ref) == len(hits) and name != "bf16" else "–")
        bits = r.get("bits_per_element")
        margins = _margin_cells(name, niah_margins(r.get("niah") or []), ref_margins)
        lines.append(f"| {name} | {bits if bits is not None else 16:g} | {ppl}{err_s} | {found} | {kept} | {margins}")
    return "\n".join(lines)


def plot_layer_errors(results: dict, path: Path, title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for name, r in results.items():
        if r.get("layer_errors"):
            ax.plot(range(len(r["layer_errors"])), r["layer_errors"], marker="o", ms=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative attention-output error after W_O")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_niah(results: dict, path: Path, title: str) -> None:
    plt = _plt()
    names = [n for n, r in results.items() if r.get("niah")]
    if not names:
        return
    first = results[names[0]]["niah"]
    lengths = sorted({x["length"] for x in first})
    depths = sorted({x["depth"] for x in first})
    fig, axes = plt.subplots(1, len(names), figsize=(2.3 * len(names), 2.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        grid = [[next(x["accuracy"] for x in results[name]["niah"] if x["length"] == L and x["depth"] == d)
                 for L in lengths] for d in depths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        for yi, row in enumerate(grid):
            for xi, v in enumerate(row):
                ax.text(xi, yi, f"{v:.0%}", ha="center", va="center", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("context tokens", fontsize=7)
    axes[0][0].set_ylabel("needle depth", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_margins(results: dict, path: Path, title: str) -> bool:
    """Each pass-key trial's key margin against BF16's on the same prompt (one marker set per method).

    On the diagonal a method decides like BF16; below it the key lost
    log-probability lead; left of / below zero the trial failed.  Returns
    False (nothing written) without BF16 margins to pair with.
    """
    ref = niah_margins((results.get("bf16") or {}).get("niah") or [])
    names = [n for n, r in results.items() if n != "bf16" and len(niah_margins(r.get("niah") or [])) == len(ref)]
    if not ref or all(m is None for m in ref) or not names:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    vals = [m for m in ref if m is not None]
    for name in names:
        margins = niah_margins(results[name]["niah"])
        pairs = [(a, b) for a, b in zip(ref, margins) if a is not None and b is not None]
        vals += [b for _, b in pairs]
        change = paired_margin_change(ref, margins)
        label = name + (f" ({change[0]:+.2f} ± {change[1]:.2f})" if change else "")
        ax.scatter([a for a, _ in pairs], [b for _, b in pairs], s=18, alpha=0.75, label=label)
    lo, hi = min(vals) - 0.25, max(vals) + 0.25
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.axhline(0, color="grey", lw=0.5, ls=":")
    ax.axvline(0, color="grey", lw=0.5, ls=":")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("BF16: key margin (nats)")
    ax.set_ylabel("method: key margin on the same prompt (nats)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, title="mean change vs BF16 ± 95 %", title_fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
