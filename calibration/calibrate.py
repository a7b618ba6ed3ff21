"""The calibration pipeline: statistics -> rotations -> clip levels -> (OptR) -> artifact.

Methods (``METHODS``):

=================  ==========================  ===============  ==========  =========
method             rotation                    key centering    clip search  learned
=================  ==========================  ===============  ==========  =========
identity           I                           no               no           no
hadamard           H (QuaRot-style)            no               no           no
hadamard-clip      H                           no               yes          no
hadamard-center    H                           yes              yes          no
oscar              U_Q H P / U_S H P           no               yes          no
oscar-center       U_Q H P / U_S H P           yes              yes          no
optr               OSCAR start, R0 exp(A-Aᵀ)   yes              yes          yes
=================  ==========================  ===============  ==========  =========

Held-out acceptance: every data-dependent choice (the OSCAR eigenbasis per
KV head, the searched clip levels, OptR's learned rotation) is kept only where
it also helps on a held-out group of calibration sequences that it was not
fitted on: a domain left out of the mix (``data.Sequences.groups``), or the
other half of a single-domain text.  See ``ACCEPTANCE``; every decision and
its held-out losses go into the report and the manifest.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from oscar_sglang import artifacts as art
from oscar_sglang import rotation as rot
from oscar_sglang.format import RowFormat

from . import capture, data
from .fit import (CLIP_GRID, RotatedSample, clip_curves, fold_scores, oscar_rotations, query_positions,
                  relative_by_group)
from .optr import OptRConfig, refine_layer
from .stats import LayerStats, StatsCollector

METHODS = ("identity", "hadamard", "hadamard-clip", "hadamard-center", "oscar", "oscar-center", "optr")
UNCENTERED = ("identity", "hadamard", "hadamard-clip", "oscar")
DATA_FREE = ("identity", "hadamard")

ACCEPTANCE = (
    "Calibration sequences form held-out groups: their domains (mix), or the first and second half of the "
    "sequences when there is one domain. Per layer, KV head, keys and values separately, for each group f: "
    "fit on the other groups (OSCAR eigenbasis from their statistics, key mean, clip searched on their kept "
    "sequences) and measure the relative squared error (keys: logit error; values: attention-output error; "
    "INT2 reads only) on f's kept sequences. Summed over f: the OSCAR eigenbasis is kept only where it beats "
    "the Hadamard rotation, the searched clip only where it beats no clip; otherwise the data-free choice is "
    "used. OptR trains on the groups other than f = layer mod groups and keeps a head's learned rotation only "
    "if its loss on f's sequences improves. The final eigenbasis, key mean and clip levels are refit on all "
    "groups (clip: each group weighs equally)."
)


@dataclass
class CalibrationConfig:
    method: str = "optr"
    sink: int = art.DEFAULT_SINK
    recent: int = art.DEFAULT_RECENT
    group_size: int | None = None
    value_weighting: str = "exact"
    # Sequences kept for the clip search, the held-out checks and OptR, dealt out over the held-out groups
    # (at least one each; the clip search weighs groups equally): 4 -> 2 + 2 halves of one domain, 2 + 1 + 1
    # over a 3-domain mix.
    keep_sequences: int = 4
    clip_queries: int = 256
    decision_queries: int = 64  # query positions per sequence for the held-out checks
    optr: OptRConfig = field(default_factory=OptRConfig)
    seed: int = 0
    # Precision policy (policy.py): average stored bits per K/V element; None: every layer INT2 (no policy).
    bits: float | None = None
    # Per-channel key scaling (key_scale.py), searched after the rotation and clips, held-out checked.
    key_scaling: bool = False
    # The policy may also choose symmetric rows (scale only; policy.SYMMETRIC_OPTIONS), some cheaper than INT2.
    symmetric_rows: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.bits is not None and not 0 < self.bits <= 16:
            raise ValueError(f"--bits must be an average of stored bits per element in (0, 16], got {self.bits}")


def attention_modules(model) -> list:
    """The attention modules in layer order (those carrying ``layer_idx`` and an ``o_proj``)."""
    mods = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")}
    return [mods[i] for i in sorted(mods)]


def check_model(model) -> None:
    """Refuse, before any work, a model whose attention the calibration cannot see or the INT2 server refuses.

    The capture reads every layer through transformers' attention interface and the fit needs each layer's
    ``o_proj`` (capture.py): a model without one such module per layer (GPT-2's fused ``c_attn``/``c_proj``)
    would fail after its statistics.  Sliding-window layers and logit soft-capping (Gemma 2 and 3) are what
    ``--kv-cache-dtype oscar-int2`` refuses at startup (docs/SGLANG.md, "What is refused"): rotations for them
    could never be served.
    """
    fp = art.ModelFingerprint.from_config(model.config)
    name, layers = type(model).__name__, fp.num_layers
    found = sorted(m.layer_idx for m in attention_modules(model))
    if found != list(range(layers)):
        raise ValueError(f"{name}: oscar-calibrate needs one attention module with an o_proj per layer, read "
                         f"through transformers' attention interface (Llama, Mistral, Qwen2/3, Gemma, Granite, "
                         f"OLMo 2, Phi-3 and alike: docs/MODELS.md); found {len(found)} for {layers} layers")
    text = getattr(model.config, "text_config", None) or model.config
    sliding = [t for t in (getattr(text, "layer_types", None) or []) if "sliding" in str(t)]
    if sliding:
        raise ValueError(f"{name}: {len(sliding)} of its {layers} layers use sliding-window attention, which "
                         "--kv-cache-dtype oscar-int2 does not serve (docs/SGLANG.md, 'What is refused')")
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap:
        raise ValueError(f"{name}: its attention logits are soft-capped ({cap:g}), which --kv-cache-dtype "
                         "oscar-int2 does not serve (docs/SGLANG.md, 'What is refused')")


# --- held-out groups and their statistics ----------------------------------------------------------

def heldout_groups(sequences) -> list[tuple[str, list]]:
    """``[(name, sequences)]``: the domains of ``sequences`` (``.groups``), or, with one domain, its two halves."""
    labels = list(getattr(sequences, "groups", None) or ["data"] * len(sequences))
    by: dict[str, list] = {}
    for g, s in zip(labels, sequences):
        by.setdefault(g, []).append(s)
    if len(by) >= 2:
        return list(by.items())
    (name, seqs), = by.items()
    if len(seqs) < 2:
        return [(name, seqs)]
    h = (len(seqs) + 1) // 2
    return [(f"{name} (first half)", seqs[:h]), (f"{name} (second half)", seqs[h:])]


def _merge(stats: list[LayerStats], samples: bool = True) -> LayerStats:
    return LayerStats(sum(s.c_q for s in stats), sum(s.c_s for s in stats), sum(s.k_sum for s in stats),
                      sum(s.tokens for s in stats), [x for s in stats for x in s.samples] if samples else [])


class GroupedStatistics:
    """Statistics per held-out group; ``layers[i]`` merges all groups (as one :class:`StatsCollector` would)."""

    def __init__(self, names: list[str], collectors: list[StatsCollector]):
        self.names, self.collectors = list(names), list(collectors)
        n = len(collectors[0].layers)
        self.layers = [_merge([c.layers[i] for c in collectors]) for i in range(n)]

    def group_layers(self, i: int) -> list[LayerStats]:
        return [c.layers[i] for c in self.collectors]

    def sample_groups(self) -> list[int]:
        """Group index of each kept sample of ``layers[i].samples`` (same for every layer)."""
        return [g for g, c in enumerate(self.collectors) for _ in c.layers[0].samples]


def keep_per_group(keep: int, n_groups: int) -> list[int]:
    """``keep`` kept sequences dealt out over the groups in order, at least one each: 4 over 3 -> [2, 1, 1]."""
    if keep <= 0:
        return [0] * n_groups
    return [max(1, keep // n_groups + (1 if g < keep % n_groups else 0)) for g in range(n_groups)]


def collect_statistics(model, sequences, cfg: CalibrationConfig, progress=True) -> GroupedStatistics:
    """Capture statistics per held-out group (:func:`heldout_groups`), keeping sequences evenly per group."""
    fp = art.ModelFingerprint.from_config(model.config)
    groups = heldout_groups(sequences)
    keep = keep_per_group(cfg.keep_sequences, len(groups))
    collectors = []
    bar = tqdm(total=len(sequences), desc="capture statistics", unit="seq", disable=not progress)
    with torch.no_grad():
        for (_, seqs), k in zip(groups, keep):
            collector = StatsCollector(fp.num_layers, fp.num_attention_heads, fp.num_kv_heads, fp.head_dim,
                                       cfg.value_weighting, k)
            with capture.tapped(model, collector):
                for ids in seqs:
                    capture.run_layers(model, ids)
                    bar.update(1)
            for st in collector.layers:  # the fit runs on the CPU (small d x d problems per KV head)
                st.to("cpu")
            collectors.append(collector)
    bar.close()
    return GroupedStatistics([n for n, _ in groups], collectors)


def _summary(sequences, cfg: CalibrationConfig, data_summary: dict | None) -> dict:
    groups = heldout_groups(sequences) if len(sequences) else []
    data = dict(data_summary or {})
    prov = getattr(sequences, "provenance", None)
    if prov:
        data.setdefault("provenance", prov)
    return {
        "data": data,
        "tokens": int(sum(s.numel() for s in sequences)),
        "sequences": len(sequences),
        "seq_len": int(sequences[0].numel()) if sequences else 0,
        "seed": cfg.seed,
        "value_weighting": cfg.value_weighting,
        "heldout_groups": {name: len(seqs) for name, seqs in groups},
    }


def calibrate(model, sequences, cfg: CalibrationConfig, data_summary: dict | None = None,
              progress: bool = True, policy_sequences=None,
              copy_sequences=None, checkpoint=None) -> tuple[art.RotationArtifacts, list[dict]]:
    """Run the whole pipeline; returns the artifact and a per-layer report.

    ``policy_sequences`` (with ``cfg.bits``): the sequences the precision policy measures its options on
    (:func:`policy_statistics`), e.g. longer ones than the fit's; default the fit's kept sequences.
    ``copy_sequences``: also measure the policy on the copy task built from them (:func:`with_copy_task`).
    ``checkpoint`` (a :class:`checkpoint.LayerCheckpoint` for these inputs): the fit's and the policy's finished
    layers are recorded as they finish and read back by a later run, which resumes an interrupted one.
    """
    t0 = time.time()
    check_model(model)   # before the statistics and the fit, not after them
    if cfg.bits is not None:
        check_budget(model, cfg)
    if cfg.method in DATA_FREE and cfg.bits is None:
        return fit(model, None, cfg, _summary(sequences, cfg, data_summary), progress)
    torch.manual_seed(cfg.seed)
    stats = collect_statistics(model, sequences, cfg, progress)
    summary = _summary(sequences, cfg, data_summary)
    summary["seconds"] = {"statistics": round(time.time() - t0, 1)}
    a, report = fit(model, None if cfg.method in DATA_FREE else stats, cfg, summary, progress, checkpoint)
    if cfg.method in DATA_FREE:
        a.calibration = {**summary, "note": "data-free rotations; the precision policy measured on this text"}
    a.calibration.setdefault("seconds", {})
    if cfg.bits is not None:
        t1 = time.time()
        pstats, fixed = policy_inputs(model, stats, cfg, policy_sequences, copy_sequences, progress)
        a = apply_policy(model, pstats, a, cfg, progress, fixed, checkpoint=checkpoint)
        a.calibration["seconds"]["policy"] = round(time.time() - t1, 1)
    a.calibration["seconds"]["total"] = round(time.time() - t0, 1)
    return a, report


def check_budget(model, cfg: CalibrationConfig) -> None:
    """Refuse ``cfg.bits`` if it is below the cheapest row format the policy could pick for ``model``."""
    from . import policy

    d = art.ModelFingerprint.from_config(model.config).head_dim
    policy.check_budget(cfg.bits, policy.candidate_formats(d, RowFormat(2, cfg.group_size), cfg.symmetric_rows), d)


def policy_statistics(model, sequences, cfg: CalibrationConfig, progress: bool = True) -> GroupedStatistics:
    """Statistics for the policy's own sequences, every one of them kept (same held-out groups by domain)."""
    return collect_statistics(model, sequences, dataclasses.replace(cfg, keep_sequences=len(sequences)), progress)


COPY_SPAN = 64  # tokens repeated at the end of each copy-task sequence (data.copy_task)


def with_copy_task(model, stats: GroupedStatistics, sequences, cfg: CalibrationConfig,
                   progress: bool = True) -> tuple[GroupedStatistics, list]:
    """``stats`` plus the copy task on ``sequences`` as held-out groups ``DOMAIN+copy`` of their own, and the
    query positions per kept sample for :func:`apply_policy` (None: random decode reads; the repeat for the
    copy task, whose queries read their source from INT2 keys, as retrieval does)."""
    copies, pos = data.copy_task(sequences, COPY_SPAN, cfg.sink, cfg.recent, cfg.seed)
    c = policy_statistics(model, copies, cfg, progress)
    merged = GroupedStatistics(stats.names + c.names, stats.collectors + c.collectors)
    return merged, [None] * len(stats.sample_groups()) + [pos] * len(c.sample_groups())


def policy_inputs(model, stats: GroupedStatistics, cfg: CalibrationConfig, policy_sequences=None,
                  copy_sequences=None, progress: bool = True) -> tuple[GroupedStatistics, list | None]:
    """What the policy measures on: ``stats`` (or statistics of ``policy_sequences``), plus the copy task on
    ``copy_sequences``; and the fixed query positions per kept sample (None: random decode reads)."""
    if policy_sequences is not None:
        stats = policy_statistics(model, policy_sequences, cfg, progress)
    if copy_sequences is None:
        return stats, None
    return with_copy_task(model, stats, copy_sequences, cfg, progress)


def policy_costs(model, stats: GroupedStatistics, artifact: art.RotationArtifacts, cfg: CalibrationConfig,
                 progress: bool = True, fixed_positions: list | None = None, checkpoint=None):
    """What every row-format option costs and buys per (layer, K/V) on ``stats`` (``policy.measure``)."""
    from . import policy

    mods = attention_modules(model)
    hd = artifact.model.head_dim
    return policy.measure([st.samples for st in stats.layers], stats.sample_groups(), stats.names, artifact,
                          [m.o_proj.weight.detach().cpu() for m in mods],
                          [float(getattr(m, "scaling", hd ** -0.5)) for m in mods],
                          n_queries=cfg.decision_queries, seed=cfg.seed, progress=progress,
                          fixed_positions=fixed_positions, symmetric=cfg.symmetric_rows, checkpoint=checkpoint)


def apply_policy(model, stats: GroupedStatistics, artifact: art.RotationArtifacts, cfg: CalibrationConfig,
                 progress: bool = True, fixed_positions: list | None = None, costs=None,
                 checkpoint=None) -> art.RotationArtifacts:
    """Measure every row-format option per (layer, K/V) and store the best mix under ``cfg.bits`` (policy.py).

    ``fixed_positions``: query positions per kept sample (:func:`with_copy_task`); default random reads.
    ``costs``: measured already (:func:`policy_costs` of the same inputs; several budgets share one measure).
    """
    from . import policy

    if costs is None:
        costs = policy_costs(model, stats, artifact, cfg, progress, fixed_positions, checkpoint)
    choice = policy.choose(costs, cfg.bits)
    check = policy.heldout_check(costs, cfg.bits)
    out = policy.apply(artifact, costs, choice)
    rep = policy.report(costs, choice, cfg.bits, check)
    first = stats.layers[0].samples
    lengths = sorted({int(x.q.shape[1]) for x in first}) or [0]
    rep["measured_on"] = {"sequences": len(first), "seq_len": lengths[0] if len(lengths) == 1 else lengths,
                          "groups": {n: stats.sample_groups().count(g) for g, n in enumerate(stats.names)}}
    if fixed_positions and any(f is not None for f in fixed_positions):
        rep["measured_on"]["copy_task"] = {"span": COPY_SPAN, "groups": [n for n in stats.names
                                                                           if data.COPY_SUFFIX in n]}
    out.calibration = {**artifact.calibration, "policy": rep}
    return out


# --- error curves and the held-out acceptance -------------------------------------------------------

def _rotated(samples, r_k, r_v, k_mean, cfg, scale, positions) -> list[RotatedSample]:
    return [RotatedSample(s, r_k.float(), r_v.float(), k_mean.float(), cfg.sink, cfg.recent, scale, pos)
            for s, pos in zip(samples, positions)]


def _positions(samples, cfg, n_queries: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [query_positions(s.q.shape[1], cfg.sink, cfg.recent, n_queries, gen) for s in samples]


def _heldout_decisions(groups: list[LayerStats], samples, sample_groups, cfg, group_size, scale, hadamard,
                       centered: bool, use_oscar: bool, seed: int) -> dict:
    """Leave-one-group-out check of the eigenbasis and the clip levels (see ``ACCEPTANCE``)."""
    n_groups, kvh = len(groups), hadamard.shape[0]
    positions = _positions(samples, cfg, cfg.decision_queries, seed)
    zero = torch.zeros(kvh, hadamard.shape[-1], dtype=torch.float64)
    cands = ("hadamard", "oscar") if use_oscar else ("hadamard",)
    held = {(w, c, x): torch.zeros(kvh, dtype=torch.float64) for w in "kv" for c in cands for x in ("clip", "noclip")}
    cache = {}
    for f in range(n_groups):
        rest = _merge([g for j, g in enumerate(groups) if j != f], samples=False)
        mu = rest.key_mean if centered else zero
        for c in cands:
            r_k, r_v = (hadamard, hadamard) if c == "hadamard" else oscar_rotations(rest)
            rotated = _rotated(samples, r_k, r_v, mu, cfg, scale, positions)
            for w in "kv":
                key = (c, w)
                if c == "hadamard" and (w == "v" or not centered):  # no fold-dependent mean: same every fold
                    curves = cache.get(key) or cache.setdefault(key, clip_curves(rotated, group_size, w))
                else:
                    curves = clip_curves(rotated, group_size, w)
                at_clip, no_clip = fold_scores(*curves, sample_groups, n_groups, f)
                held[(w, c, "clip")] += at_clip
                held[(w, c, "noclip")] += no_clip
    out = {}
    for w in "kv":
        h_clip, h_none = held[(w, "hadamard", "clip")], held[(w, "hadamard", "noclip")]
        if use_oscar:
            o_clip, o_none = held[(w, "oscar", "clip")], held[(w, "oscar", "noclip")]
            use = o_clip < h_clip
            out[f"{w}_heldout_oscar"], out[f"{w}_heldout_hadamard"] = o_clip, h_clip
            clip_err, none_err = torch.where(use, o_clip, h_clip), torch.where(use, o_none, h_none)
        else:
            use = torch.zeros(kvh, dtype=torch.bool)
            clip_err, none_err = h_clip, h_none
        out[f"{w}_oscar"] = use
        out[f"{w}_clip_kept"] = clip_err < none_err
        out[f"{w}_heldout_clip"], out[f"{w}_heldout_noclip"] = clip_err, none_err
    return out


def _final_clips(samples, sample_groups, n_groups, r_k, r_v, k_mean, cfg, group_size, scale, keep, seed) -> dict:
    """Clip levels on all kept sequences (each group weighing equally), reverted to no clip where not accepted."""
    positions = _positions(samples, cfg, cfg.clip_queries, seed)
    rotated = _rotated(samples, r_k, r_v, k_mean, cfg, scale, positions)
    grid = torch.tensor(CLIP_GRID, dtype=torch.float32)
    heads = torch.arange(r_k.shape[0])
    out = {}
    for w in "kv":
        err, energy = clip_curves(rotated, group_size, w)
        best = relative_by_group(err, energy, sample_groups, range(n_groups)).argmin(0)
        best = torch.where(keep[w], best, torch.zeros_like(best))
        tot_err, tot_energy = err.sum(0), energy.sum(0).clamp_min(1e-30)
        out[f"{w}_clip"] = grid[best]
        out[f"{w}_rel_error"] = (tot_err[best, heads] / tot_energy).sqrt()
        out[f"{w}_rel_error_noclip"] = (tot_err[0] / tot_energy).sqrt()
    return {k: out[k] for k in ("k_clip", "v_clip", "k_rel_error", "v_rel_error", "k_rel_error_noclip",
                                "v_rel_error_noclip")}


def _as_grouped(stats) -> GroupedStatistics:
    return stats if isinstance(stats, GroupedStatistics) else GroupedStatistics(["data"], [stats])


def fit(model, stats: GroupedStatistics | StatsCollector | None, cfg: CalibrationConfig, summary: dict,
        progress: bool = True, checkpoint=None) -> tuple[art.RotationArtifacts, list[dict]]:
    """Fit ``cfg.method`` from collected statistics (several methods can share them).

    ``checkpoint`` (a :class:`checkpoint.LayerCheckpoint`): layers finished by an earlier run of the same inputs
    are read back, each layer fitted here is recorded as it finishes."""
    t0 = time.time()
    fp = art.ModelFingerprint.from_config(model.config)
    group = cfg.group_size or fp.head_dim
    kw = dict(sink=cfg.sink, recent=cfg.recent, group_size=cfg.group_size)
    if cfg.method in DATA_FREE:
        a = art.BUILDERS[cfg.method](fp, **kw)
        a.calibration = {**summary, "tokens": 0, "note": "data-free baseline"}
        return a, []
    stats = _as_grouped(stats)
    mods = attention_modules(model)
    centered = cfg.method not in UNCENTERED
    use_oscar = not cfg.method.startswith("hadamard")
    n_groups = len(stats.names)
    sample_groups = torch.tensor(stats.sample_groups())
    hadamard = rot.hadamard(fp.head_dim).expand(fp.num_kv_heads, -1, -1).clone()
    zero = torch.zeros(fp.num_kv_heads, fp.head_dim, dtype=torch.float64)
    all_heads = torch.ones(fp.num_kv_heads, dtype=torch.bool)
    layers, report = [], []
    stage = f"fit-{cfg.method}"
    for i in tqdm(range(fp.num_layers), desc=f"fit {cfg.method}", unit="layer", disable=not progress):
        saved = None if checkpoint is None else checkpoint.get(stage, i)
        if saved is not None:
            tensors, row = saved
            layers.append(art.LayerRotation(*(tensors[name] for name in art.LayerRotation.TENSOR_NAMES)))
            report.append(row)
            continue
        st = stats.layers[i]
        scale = float(getattr(mods[i], "scaling", fp.head_dim ** -0.5))
        row = {"layer": i}
        if n_groups >= 2:
            dec = _heldout_decisions(stats.group_layers(i), st.samples, sample_groups, cfg, group, scale, hadamard,
                                     centered, use_oscar, cfg.seed + 2000 + i)
            row.update({k: v.tolist() for k, v in dec.items()})
            keep = {"k": dec["k_clip_kept"], "v": dec["v_clip_kept"]}
            pick = {"k": dec["k_oscar"], "v": dec["v_oscar"]}
        else:  # nothing to hold out: the fitted choices stand unchecked
            keep = {"k": all_heads, "v": all_heads}
            pick = {"k": all_heads if use_oscar else ~all_heads, "v": all_heads if use_oscar else ~all_heads}
        if use_oscar:
            o_k, o_v = oscar_rotations(st)
            r_k = torch.where(pick["k"].reshape(-1, 1, 1), o_k, hadamard)
            r_v = torch.where(pick["v"].reshape(-1, 1, 1), o_v, hadamard)
        else:
            r_k, r_v = hadamard.clone(), hadamard.clone()
        mu = st.key_mean if centered else zero
        clips = _final_clips(st.samples, sample_groups, n_groups, r_k, r_v, mu, cfg, group, scale, keep, cfg.seed + i)
        if cfg.method == "optr":
            w_o = mods[i].o_proj.weight.detach().cpu()
            if n_groups >= 2:  # train on all groups but one, check on that one
                f = i % n_groups
                order = [s for s, g in zip(st.samples, sample_groups.tolist()) if g != f]
                held = [s for s, g in zip(st.samples, sample_groups.tolist()) if g == f]
                ocfg = dataclasses.replace(cfg.optr, heldout=len(held))
                samples, row["optr_heldout_group"] = order + held, stats.names[f]
            else:
                samples, ocfg, row["optr_heldout_group"] = st.samples, cfg.optr, "last kept sequence"
            res = refine_layer(samples, r_k, r_v, mu, clips["k_clip"], clips["v_clip"], w_o, sink=cfg.sink,
                               recent=cfg.recent, group=group, scale=scale, cfg=ocfg, seed=cfg.seed + 1000 + i)
            r_k, r_v = res["k_rotation"], res["v_rotation"]
            clips = _final_clips(st.samples, sample_groups, n_groups, r_k, r_v, mu, cfg, group, scale, keep,
                                 cfg.seed + i)
            row.update({name: res[name].tolist() for name in
                        ("k_heldout_before", "k_heldout_after", "k_kept", "v_heldout_before", "v_heldout_after", "v_kept")})
        k_scale = None
        if cfg.key_scaling:
            from . import key_scale

            rotated = _rotated(st.samples, r_k, r_v, mu, cfg, scale,
                               _positions(st.samples, cfg, cfg.decision_queries, cfg.seed + 3000 + i))
            ks = key_scale.search(rotated, sample_groups, n_groups, clips["k_clip"], group)
            k_scale, clips["k_clip"] = ks["k_scale"], ks["k_clip"]
            row.update({"k_scale_kept": ks["kept"].tolist(), "k_scale_exponent": ks["exponent"],
                        "k_rel_error_scaled": ks["rel_error"].tolist(),
                        "k_heldout_scaled": ks["heldout_scaled"].tolist(),
                        "k_heldout_unscaled": ks["heldout_unscaled"].tolist(),
                        "k_rel_error_unscaled": ks["rel_error_unscaled"].tolist()})
        layers.append(art.LayerRotation(r_k.float(), r_v.float(), mu.float(), clips["k_clip"], clips["v_clip"],
                                        k_scale))
        row.update({name: v.tolist() for name, v in clips.items()})
        report.append(row)
        if checkpoint is not None:
            checkpoint.put(stage, i, {name: getattr(layers[-1], name) for name in art.LayerRotation.TENSOR_NAMES},
                           row)
    summary = {**summary, "method_seconds": round(time.time() - t0, 1), "layers": report,
               "acceptance": ACCEPTANCE if n_groups >= 2 else
               "one held-out group only: data-dependent choices kept unchecked (OptR checks the last kept sequence)"}
    summary.setdefault("seconds", {})
    summary.setdefault("heldout_groups", {n: None for n in stats.names})
    return art.RotationArtifacts(fp, cfg.method, layers, calibration=summary, **kw), report


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def summary_table(report: list[dict]) -> str:
    """One line per layer: chosen clips, INT2 errors with and without them, held-out decisions, OptR decisions."""
    if not report:
        return "(data-free baseline: no per-layer calibration)"
    has_optr = "k_kept" in report[0]
    has_oscar = "k_oscar" in report[0]
    has_clip_check = "k_clip_kept" in report[0]
    head = "layer  K clip  V clip  K err (no clip)  V err (no clip)"
    head += "  OSCAR K/V" if has_oscar else ""
    head += "  clip K/V" if has_clip_check else ""
    head += "  OptR kept K/V  K held-out before->after" if has_optr else ""
    lines = [head]
    for r in report:
        n = len(r["k_clip"])
        line = (f"{r['layer']:5d}  {_mean(r['k_clip']):.3f}   {_mean(r['v_clip']):.3f}   "
                f"{_mean(r['k_rel_error']):.3f} ({_mean(r['k_rel_error_noclip']):.3f})    "
                f"{_mean(r['v_rel_error']):.3f} ({_mean(r['v_rel_error_noclip']):.3f})")
        if has_oscar:
            line += f"    {sum(r['k_oscar'])}/{sum(r['v_oscar'])} of {n}"
        if has_clip_check:
            line += f"  {sum(r['k_clip_kept'])}/{sum(r['v_clip_kept'])} of {n}"
        if has_optr:
            line += (f"   {sum(r['k_kept'])}/{sum(r['v_kept'])} of {n}       "
                     f"{sum(r['k_heldout_before']):.4f} -> {sum(r['k_heldout_after']):.4f}")
        lines.append(line)
    totals = []
    for key, label in (("k_oscar", "OSCAR eigenbasis kept (K)"), ("v_oscar", "OSCAR eigenbasis kept (V)"),
                       ("k_clip_kept", "searched clip kept (K)"), ("v_clip_kept", "searched clip kept (V)"),
                       ("k_kept", "OptR rotation kept (K)"), ("v_kept", "OptR rotation kept (V)"),
                       ("k_scale_kept", "key channel scaling kept")):
        if key in report[0]:
            totals.append(f"{label}: {sum(sum(r[key]) for r in report)}/{sum(len(r[key]) for r in report)}")
    if totals:
        lines.append("held-out decisions: " + "; ".join(totals))
    return "\n".join(lines)
