"""Precision policy: per layer, for keys and values separately, the row format that buys the most per bit.

The calibrated rotations leave some layers much harder to quantize than
others.  Given an average budget of ``B`` stored bits per K/V element (codes
plus fp16 scale and zero, over all layers), the policy chooses for every
(layer, K or V) one of the :data:`OPTIONS` so that the measured output error
is smallest:

1. **Measure** (:func:`measure`): for each layer, side and option, on the kept
   calibration sequences, the squared error of the attention output *after
   ``W_O``* (what the next layer receives) when that side is stored in that
   format and the other side is exact, relative to the output's energy, per
   held-out group.  Decode reads as served: sink and recent windows exact,
   everything else from the format.  Clip levels for each option are searched
   on the option's own format and kept only where they pass the held-out
   check (as the base method's clips).  Errors of different layers do not
   compound (each layer is measured on exact inputs).
2. **Choose** (:func:`choose`): start every side at the cheapest option (the
   base method's INT2 rows) and repeatedly take the upgrade with the largest
   error saved per bit added that still fits the budget (any larger option of
   one side, not only the next), until none fits or none helps.  Errors of a
   layer's keys and values, and of different layers, are added.
3. **Held-out check**: each held-out group (a domain of the mix, or a half of
   one text) in turn is left out; the policy chosen on the other groups is
   scored on it against the base formats and against a data-free
   allocation of the same budget (the same upgrade for every layer).  The
   numbers go to the report and the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from oscar_sglang import artifacts as art
from oscar_sglang.format import RowFormat

from .fit import CLIP_GRID, RotatedSample, clip_curves, fold_scores, query_positions, relative_by_group

# Candidate row formats, by cost at head_dim 64 / 128 (bits per element):
# INT2 one group 2.5 / 2.25, INT2 g32 3.0, INT2 g16 4.0, INT4 one group 4.5 / 4.25, INT4 g32 5.0, INT8 8.5 / 8.25.
# INT8 is the near-lossless last resort (its rounding error is ~85x INT2's smaller, about BF16's own).
OPTIONS = (RowFormat(2), RowFormat(2, 32), RowFormat(2, 16), RowFormat(4), RowFormat(4, 32), RowFormat(8))
# Symmetric rows (scale only, zero implied; oscar_sglang.format): INT2 2.25 / 2.125, INT4 4.25 / 4.125.  Cheaper than
# the base for centered rows, so the policy may move easy layers below the base and spend the saving on hard ones.
SYMMETRIC_OPTIONS = (RowFormat(2, symmetric=True), RowFormat(4, symmetric=True))
# 16 bits / 2.75 = 5.8x the tokens of BF16 before the hot pool: capacity stays >= 5.5x BF16.
DEFAULT_BITS = 2.75
SIDES = ("k", "v")


def candidate_formats(head_dim: int, base: RowFormat | None = None, symmetric: bool = False) -> list[RowFormat]:
    """The options valid for ``head_dim``, cheapest first: ``base`` (default INT2, one group) and every option
    dearer than it; with ``symmetric`` also the symmetric rows (:data:`SYMMETRIC_OPTIONS`, some cheaper than base)."""
    base = (base or RowFormat(2)).resolved(head_dim)
    out = [base]
    for f in OPTIONS + (SYMMETRIC_OPTIONS if symmetric else ()):
        g = f.group_for(head_dim)
        if g > head_dim or head_dim % g:
            continue
        f = f.resolved(head_dim)
        if f not in out and (f.symmetric or f.bits_per_element(head_dim) > base.bits_per_element(head_dim)):
            out.append(f)
    return sorted(out, key=lambda f: (f.bits_per_element(head_dim), -f.bits, f.symmetric))


@dataclass
class OptionCosts:
    """What every option costs and buys, per (layer, side)."""

    formats: list[RowFormat]  # cheapest first
    bits: list[float]  # bits per element of each format
    err: torch.Tensor  # [layers, 2 (K, V), options, groups] float64: relative squared output error
    clips: torch.Tensor  # [layers, 2, options, kv_heads] float32: clip ratio of each option
    group_names: list[str]
    head_dim: int
    base_index: int = 0  # formats[base_index] is the base method's format (the policy's reference)

    def base_choice(self) -> torch.Tensor:
        """Every layer and side in the base format ``[layers, 2]``."""
        return torch.full(self.err.shape[:2], self.base_index, dtype=torch.long)

    def total(self, choice: torch.Tensor, groups=None) -> float:
        """Summed error of ``choice [layers, 2]`` (option index per side), mean over ``groups`` (default all)."""
        groups = list(range(self.err.shape[-1])) if groups is None else list(groups)
        e = self.err[..., groups].mean(-1)  # [L, 2, O]
        return float(e.gather(2, choice.unsqueeze(-1)).sum())

    def average_bits(self, choice: torch.Tensor) -> float:
        return float(torch.tensor(self.bits, dtype=torch.float64)[choice].mean())


def _positions(samples, sink, recent, n_queries, seed, fixed=None):
    """Query positions per sample: ``fixed[i]`` where given (e.g. a copy task's repeat), else random reads."""
    gen = torch.Generator().manual_seed(seed)
    fixed = fixed or [None] * len(samples)
    return [query_positions(s.q.shape[1], sink, recent, n_queries, gen) if f is None else f
            for s, f in zip(samples, fixed)]


@torch.no_grad()
def _layer_costs(samples, sample_groups: torch.Tensor, n_groups: int, layer: art.LayerRotation, base: art.LayerFormat,
                 formats: list[RowFormat], w_o: torch.Tensor, scale: float, sink: int, recent: int, n_queries: int,
                 seed: int, fixed_positions=None):
    positions = _positions(samples, sink, recent, n_queries, seed, fixed_positions)
    rotated = [RotatedSample(s, layer.k_rotation, layer.v_rotation, layer.k_mean, sink, recent, scale, p,
                             layer.k_scale) for s, p in zip(samples, positions)]
    kvh = layer.k_clip.shape[0]
    grid = torch.tensor(CLIP_GRID, dtype=torch.float32)
    err = torch.zeros(2, len(formats), n_groups, dtype=torch.float64)
    clips = torch.ones(2, len(formats), kvh)
    for si, side in enumerate(SIDES):
        base_f, base_clip = (base.k, layer.k_clip) if side == "k" else (base.v, layer.v_clip)
        for oi, f in enumerate(formats):
            if f == base_f:
                clip = base_clip.float()
            else:  # this option's own clip, kept only where it helps held-out groups (as the base's clips)
                curves = clip_curves(rotated, f.group, side, f.bits, f.symmetric)
                best = relative_by_group(*curves, sample_groups, range(n_groups)).argmin(0)
                if n_groups >= 2:
                    held = [fold_scores(*curves, sample_groups, n_groups, g) for g in range(n_groups)]
                    keep = sum(h[0] for h in held) < sum(h[1] for h in held)
                    best = torch.where(keep, best, torch.zeros_like(best))
                clip = grid[best]
            clips[si, oi] = clip
            e_sum = torch.zeros(n_groups, dtype=torch.float64)
            ref_sum = torch.zeros(n_groups, dtype=torch.float64)
            for r, g in zip(rotated, sample_groups.tolist()):
                x = r.kr if side == "k" else r.vr
                xq = f.fake_quantize(x, clip.reshape(-1, 1, 1))
                e, ref = r.output_error(xq if side == "k" else None, xq if side == "v" else None,
                                        layer.v_rotation, w_o, scale)
                e_sum[g] += e
                ref_sum[g] += ref
            err[si, oi] = e_sum / ref_sum.clamp_min(1e-30)
    return err, clips


def measure(samples_per_layer: list[list], sample_groups: list[int], group_names: list[str],
            artifact: art.RotationArtifacts, w_o: list[torch.Tensor], scales: list[float], n_queries: int = 64,
            seed: int = 0, progress: bool = True, fixed_positions: list | None = None,
            symmetric: bool = False, checkpoint=None) -> OptionCosts:
    """Error of every option for every (layer, side) on the kept sequences (module docstring, step 1).

    ``fixed_positions[i]``: the query positions of sample ``i`` (None: ``n_queries`` random decode reads).
    ``symmetric``: the symmetric row options too (:data:`SYMMETRIC_OPTIONS`).
    ``checkpoint`` (a :class:`checkpoint.LayerCheckpoint`): layers measured by an earlier run of the same
    inputs are read back, each layer measured here is recorded.
    """
    d = artifact.model.head_dim
    bases = artifact.layer_formats
    base = bases[0].k
    formats = candidate_formats(d, base, symmetric)
    if any(b.k != base or b.v != base for b in bases):
        raise ValueError("the precision policy starts from an artifact with one row format for every layer")
    groups = torch.tensor(sample_groups)
    n_groups = len(group_names)
    errs, clips = [], []
    for i in tqdm(range(len(artifact.layers)), desc="policy: measure options", unit="layer", disable=not progress):
        saved = None if checkpoint is None else checkpoint.get("policy", i)
        if saved is not None:
            e, c = saved[0]["err"], saved[0]["clips"]
        else:
            lr = artifact.layers[i].to(None, torch.float32)
            e, c = _layer_costs(samples_per_layer[i], groups, n_groups, lr, bases[i], formats, w_o[i].float(),
                                scales[i], artifact.sink, artifact.recent, n_queries, seed + 3000 + i, fixed_positions)
            if checkpoint is not None:
                checkpoint.put("policy", i, {"err": e, "clips": c}, {})
        errs.append(e)
        clips.append(c)
    return OptionCosts(formats, [f.bits_per_element(d) for f in formats], torch.stack(errs), torch.stack(clips),
                       list(group_names), d, formats.index(base))


def check_budget(budget_bits: float, formats: list[RowFormat], head_dim: int) -> None:
    """Refuse a budget below the cheapest of ``formats`` (cheapest first, as :func:`candidate_formats` lists
    them): called before any measuring (``calibrate``, ``oscar-eval``) and again by :func:`choose`."""
    cheapest = formats[0].bits_per_element(head_dim)
    if budget_bits + 1e-9 < cheapest:
        raise ValueError(f"a budget of {budget_bits:g} bits per element is below the cheapest format "
                         f"({formats[0].name()}: {cheapest:g} bits)")


def choose(costs: OptionCosts, budget_bits: float, groups=None) -> torch.Tensor:
    """Option index per (layer, side) ``[layers, 2]`` under ``budget_bits`` (module docstring, step 2)."""
    n_layers = costs.err.shape[0]
    bits = torch.tensor(costs.bits, dtype=torch.float64)
    check_budget(budget_bits, costs.formats, costs.head_dim)
    groups = list(range(costs.err.shape[-1])) if groups is None else list(groups)
    e = costs.err[..., groups].mean(-1)  # [L, 2, O]
    choice = torch.zeros(n_layers, 2, dtype=torch.long)
    spent = float(bits[0]) * 2 * n_layers
    allowed = budget_bits * 2 * n_layers + 1e-9
    while True:
        cur_bits = bits[choice].unsqueeze(-1)  # [L, 2, 1]
        cur_err = e.gather(2, choice.unsqueeze(-1))
        extra = bits.reshape(1, 1, -1) - cur_bits
        saved = cur_err - e
        ok = (extra > 0) & (saved > 0) & (spent + extra <= allowed)
        if not bool(ok.any()):
            return choice
        gain = torch.where(ok, saved / extra.clamp_min(1e-12), torch.full_like(saved, -1.0))
        flat = int(gain.argmax())
        layer, side, option = flat // (2 * len(bits)), (flat // len(bits)) % 2, flat % len(bits)
        spent += float(extra[layer, side, option])
        choice[layer, side] = option


def uniform_choice(costs: OptionCosts, budget_bits: float) -> torch.Tensor:
    """The data-free allocation: the same (K option, V option) for every layer, the best that fits the budget
    by its summed error over all groups; compared against in the held-out check, not served."""
    n_layers = costs.err.shape[0]
    best, best_err = torch.zeros(n_layers, 2, dtype=torch.long), None
    for ok in range(len(costs.bits)):
        for ov in range(len(costs.bits)):
            if (costs.bits[ok] + costs.bits[ov]) / 2 > budget_bits + 1e-9:
                continue
            c = torch.tensor([[ok, ov]] * n_layers)
            err = costs.total(c)
            if best_err is None or err < best_err:
                best, best_err = c, err
    return best


def heldout_check(costs: OptionCosts, budget_bits: float) -> dict:
    """Leave each group out: the policy chosen on the others, scored on it (module docstring, step 3)."""
    n = costs.err.shape[-1]
    base = costs.base_choice()
    folds = []
    if n >= 2:
        uniform, on_all = uniform_choice(costs, budget_bits), choose(costs, budget_bits)
        for f in range(n):
            c = choose(costs, budget_bits, [g for g in range(n) if g != f])
            folds.append({"heldout": costs.group_names[f], "base": costs.total(base, [f]),
                          "policy": costs.total(c, [f]), "uniform": costs.total(uniform, [f]),
                          "policy_all_groups": costs.total(on_all, [f])})
    beats_base = all(x["policy"] < x["base"] for x in folds) if folds else None
    beats_uniform = all(x["policy"] <= x["uniform"] for x in folds) if folds else None
    return {"folds": folds, "beats_base_on_every_heldout_group": beats_base,
            "beats_uniform_on_every_heldout_group": beats_uniform}


def apply(artifact: art.RotationArtifacts, costs: OptionCosts, choice: torch.Tensor) -> art.RotationArtifacts:
    """The artifact with each layer's chosen K/V formats and those options' clip levels."""
    layers, formats = [], []
    for i, lr in enumerate(artifact.layers):
        ok, ov = int(choice[i, 0]), int(choice[i, 1])
        layers.append(replace(lr, k_clip=costs.clips[i, 0, ok].clone(), v_clip=costs.clips[i, 1, ov].clone()))
        formats.append(art.LayerFormat(costs.formats[ok], costs.formats[ov]))
    out = replace(artifact, layers=layers)
    return out.with_formats(formats)


def report(costs: OptionCosts, choice: torch.Tensor, budget_bits: float, check: dict | None = None) -> dict:
    """What goes into the manifest: the budget, the options, per layer the choice and its error, the check."""
    d_names = [f.name(costs.head_dim) for f in costs.formats]
    layers = []
    for i in range(costs.err.shape[0]):
        e = costs.err[i].mean(-1)  # [2, O]
        layers.append({"layer": i, "k": d_names[int(choice[i, 0])], "v": d_names[int(choice[i, 1])],
                       "k_error": {n: round(float(x), 6) for n, x in zip(d_names, e[0])},
                       "v_error": {n: round(float(x), 6) for n, x in zip(d_names, e[1])}})
    base = costs.base_choice()
    return {"budget_bits": budget_bits, "average_bits": round(costs.average_bits(choice), 4),
            "options": {n: b for n, b in zip(d_names, costs.bits)}, "base": d_names[costs.base_index],
            "error_base": round(costs.total(base), 6), "error_policy": round(costs.total(choice), 6),
            "objective": "sum over layers of the relative squared attention-output error after W_O (K and V "
                         "measured separately, the other side exact), mean over held-out groups",
            "layers": layers, "heldout_check": check or {}}


def summary_table(rep: dict) -> str:
    """One line per layer whose formats are not the base, then totals."""
    base = rep.get("base", next(iter(rep["options"])))
    lines = [f"precision policy: {rep['average_bits']:.3f} bits/element (budget {rep['budget_bits']:g}); "
             f"summed output error {rep['error_base']:.4f} (all {base}) -> {rep['error_policy']:.4f}"]
    up = [r for r in rep["layers"] if r["k"] != base or r["v"] != base]
    if up:
        lines.append("layer  K format   V format   K error base->chosen   V error base->chosen")
        for r in up:
            lines.append(f"{r['layer']:5d}  {r['k']:9s}  {r['v']:9s}  {r['k_error'][base]:.4f} -> "
                         f"{r['k_error'][r['k']]:.4f}       {r['v_error'][base]:.4f} -> {r['v_error'][r['v']]:.4f}")
    for f in rep.get("heldout_check", {}).get("folds", []):
        lines.append(f"held out {f['heldout']}: base {f['base']:.4f}, data-free same budget {f['uniform']:.4f}, "
                     f"policy chosen without it {f['policy']:.4f} (with it {f['policy_all_groups']:.4f})")
    return "\n".join(lines)
