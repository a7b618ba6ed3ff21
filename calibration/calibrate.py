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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from oscar_sglang import artifacts as art
from oscar_sglang import rotation as rot

from . import capture
from .fit import RotatedSample, oscar_rotations, query_positions, search_clips
from .optr import OptRConfig, refine_layer
from .stats import StatsCollector

METHODS = ("identity", "hadamard", "hadamard-clip", "hadamard-center", "oscar", "oscar-center", "optr")
UNCENTERED = ("identity", "hadamard", "hadamard-clip", "oscar")
DATA_FREE = ("identity", "hadamard")


@dataclass
class CalibrationConfig:
    method: str = "optr"
    sink: int = art.DEFAULT_SINK
    recent: int = art.DEFAULT_RECENT
    group_size: int | None = None
    value_weighting: str = "exact"
    keep_sequences: int = 4  # sequences kept for the clip search and OptR (OptR holds one out)
    clip_queries: int = 256
    optr: OptRConfig = field(default_factory=OptRConfig)
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")


def attention_modules(model) -> list:
    """The attention modules in layer order (those carrying ``layer_idx`` and an ``o_proj``)."""
    mods = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")}
    return [mods[i] for i in sorted(mods)]


def collect_statistics(model, sequences, cfg: CalibrationConfig, progress=True) -> StatsCollector:
    fp = art.ModelFingerprint.from_config(model.config)
    collector = StatsCollector(fp.num_layers, fp.num_attention_heads, fp.num_kv_heads, fp.head_dim,
                               cfg.value_weighting, cfg.keep_sequences)
    with torch.no_grad(), capture.tapped(model, collector):
        for ids in tqdm(sequences, desc="capture statistics", unit="seq", disable=not progress):
            model(ids.reshape(1, -1).to(model.device), use_cache=False)
    for st in collector.layers:  # the fit runs on the CPU (small d x d problems per KV head)
        st.to("cpu")
    return collector


def _clips(samples, r_k, r_v, k_mean, cfg, group, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    rotated = []
    for s in samples:
        pos = query_positions(s.q.shape[1], cfg.sink, cfg.recent, cfg.clip_queries, gen)
        rotated.append(RotatedSample(s, r_k.float(), r_v.float(), k_mean.float(), cfg.sink, cfg.recent, scale, pos))
    return search_clips(rotated, group)


def _summary(sequences, cfg: CalibrationConfig, data_summary: dict | None) -> dict:
    return {
        "data": data_summary or {},
        "tokens": int(sum(s.numel() for s in sequences)),
        "sequences": len(sequences),
        "seq_len": int(sequences[0].numel()) if sequences else 0,
        "seed": cfg.seed,
        "value_weighting": cfg.value_weighting,
    }


def calibrate(model, sequences, cfg: CalibrationConfig, data_summary: dict | None = None,
              progress: bool = True) -> tuple[art.RotationArtifacts, list[dict]]:
    """Run the whole pipeline; returns the artifact and a per-layer report."""
    t0 = time.time()
    if cfg.method in DATA_FREE:
        return fit(model, None, cfg, _summary(sequences, cfg, data_summary), progress)
    torch.manual_seed(cfg.seed)
    collector = collect_statistics(model, sequences, cfg, progress)
    summary = _summary(sequences, cfg, data_summary)
    summary["seconds"] = {"statistics": round(time.time() - t0, 1)}
    a, report = fit(model, collector, cfg, summary, progress)
    a.calibration["seconds"]["total"] = round(time.time() - t0, 1)
    return a, report


def fit(model, collector: StatsCollector | None, cfg: CalibrationConfig, summary: dict,
        progress: bool = True) -> tuple[art.RotationArtifacts, list[dict]]:
    """Fit ``cfg.method`` from collected statistics (several methods can share one collector)."""
    t0 = time.time()
    fp = art.ModelFingerprint.from_config(model.config)
    group = cfg.group_size or fp.head_dim
    kw = dict(sink=cfg.sink, recent=cfg.recent, group_size=cfg.group_size)
    if cfg.method in DATA_FREE:
        a = art.BUILDERS[cfg.method](fp, **kw)
        a.calibration = {**summary, "tokens": 0, "note": "data-free baseline"}
        return a, []
    mods = attention_modules(model)
    centered = cfg.method not in UNCENTERED
    layers, report = [], []
    for i in tqdm(range(fp.num_layers), desc=f"fit {cfg.method}", unit="layer", disable=not progress):
        st = collector.layers[i]
        if cfg.method.startswith("hadamard"):
            h = rot.hadamard(fp.head_dim).expand(fp.num_kv_heads, -1, -1)
            r_k, r_v = h.clone(), h.clone()
        else:
            r_k, r_v = oscar_rotations(st)
        mu = st.key_mean if centered else torch.zeros(fp.num_kv_heads, fp.head_dim, dtype=torch.float64)
        scale = float(getattr(mods[i], "scaling", fp.head_dim ** -0.5))
        clips = _clips(st.samples, r_k, r_v, mu, cfg, group, scale, cfg.seed + i)
        row = {"layer": i}
        if cfg.method == "optr":
            w_o = mods[i].o_proj.weight.detach().cpu()
            res = refine_layer(st.samples, r_k, r_v, mu, clips["k_clip"], clips["v_clip"], w_o, sink=cfg.sink,
                               recent=cfg.recent, group=group, scale=scale, cfg=cfg.optr, seed=cfg.seed + 1000 + i)
            r_k, r_v = res["k_rotation"], res["v_rotation"]
            clips = _clips(st.samples, r_k, r_v, mu, cfg, group, scale, cfg.seed + i)
            row.update({name: res[name].tolist() for name in
                        ("k_heldout_before", "k_heldout_after", "k_kept", "v_heldout_before", "v_heldout_after", "v_kept")})
        layers.append(art.LayerRotation(r_k.float(), r_v.float(), mu.float(), clips["k_clip"], clips["v_clip"]))
        row.update({name: v.tolist() for name, v in clips.items()})
        report.append(row)
    summary = {**summary, "method_seconds": round(time.time() - t0, 1), "layers": report}
    summary.setdefault("seconds", {})
    return art.RotationArtifacts(fp, cfg.method, layers, calibration=summary, **kw), report


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def summary_table(report: list[dict]) -> str:
    """One line per layer: chosen clips, INT2 errors with and without them, OptR decisions."""
    if not report:
        return "(data-free baseline: no per-layer calibration)"
    has_optr = "k_kept" in report[0]
    head = "layer  K clip        V clip        K err (no clip)  V err (no clip)"
    head += "  OptR kept K/V  K held-out before->after" if has_optr else ""
    lines = [head]
    for r in report:
        line = (f"{r['layer']:5d}  {_mean(r['k_clip']):.3f}         {_mean(r['v_clip']):.3f}         "
                f"{_mean(r['k_rel_error']):.3f} ({_mean(r['k_rel_error_noclip']):.3f})    "
                f"{_mean(r['v_rel_error']):.3f} ({_mean(r['v_rel_error_noclip']):.3f})")
        if has_optr:
            line += (f"    {sum(r['k_kept'])}/{sum(r['v_kept'])} of {len(r['k_kept'])}       "
                     f"{sum(r['k_heldout_before']):.4f} -> {sum(r['k_heldout_after']):.4f}")
        lines.append(line)
    return "\n".join(lines)
