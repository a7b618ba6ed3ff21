"""INT2 round-trip error of real keys and values under a rotation artifact.

The error is measured on what the cache stores: ``x' = (x - mu) R`` quantized
and dequantized by the INT2 format, with the artifact's group size and clip
ratios.  Because ``R`` is orthogonal, ``||x̂' - x'||`` equals the error of the
reconstructed key or value in the model's own coordinates, so methods are
compared on the same footing.  Sink and recent BF16 windows are ignored here:
this is the format's error on every token, the worst case.
"""

from __future__ import annotations

import torch

from oscar_sglang import artifacts as art
from oscar_sglang import assets, configs
from oscar_sglang.artifacts import RotationArtifacts

from . import capture, data, diagnostics
from . import model as model_io


def relative_error(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None,
                   clip: torch.Tensor, group_size: int, bits: int = 2, scale: torch.Tensor | None = None) -> float:
    """``||Q(x') - x'||_F / ||x||_F`` for ``x[tokens, kv_heads, d]`` (rows of ``bits``, INT2 by default);
    with key channel scales the error is measured in the orthogonal frame (see ``diagnostics.head_errors``)."""
    diff = diagnostics.roundtrip_error(x, rotation, mean, clip, group_size, bits, scale)
    return (diff.norm() / x.float().norm()).item()


def per_layer_errors(kv: dict[int, tuple[torch.Tensor, torch.Tensor]], art: RotationArtifacts) -> list[dict]:
    """One row per layer: ``{"layer", "k", "v"}`` relative errors."""
    rows = []
    for layer, (k, v) in sorted(kv.items()):
        lr, lf = art.layers[layer], art.layer_formats[layer]
        rows.append({
            "layer": layer,
            "k": relative_error(k, lr.k_rotation, lr.k_mean, lr.k_clip, lf.k.group, lf.k.bits, lr.k_scale),
            "v": relative_error(v, lr.v_rotation, None, lr.v_clip, lf.v.group, lf.v.bits),
        })
    return rows


def key_statistics(kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[dict]:
    """Why keys are hard at INT2, per layer (means over KV heads of :func:`diagnostics.shape_statistics`):
    the share of key energy in the per-head mean (what centering removes) and the largest channel RMS over
    the median channel RMS (outlier channels, what a rotation spreads)."""
    rows = []
    for layer, (k, _) in sorted(kv.items()):
        st = diagnostics.shape_statistics(k)
        rows.append({"layer": layer, "key_mean_energy_share": st["mean_share"].mean().item(),
                     "key_max_over_median_channel_rms": st["rms_spread"].mean().item()})
    return rows


def with_key_means(art: RotationArtifacts, kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                   method: str) -> RotationArtifacts:
    """A copy of ``art`` whose per-(layer, KV head) key means come from ``kv`` (OptR's centering)."""
    from dataclasses import replace

    layers = [replace(lr, k_mean=kv[i][0].mean(0)) for i, lr in enumerate(art.layers)]
    return replace(art, layers=layers, method=method)


def markdown_table(results: dict[str, list[dict]]) -> str:
    """Per-layer K and V errors, one column pair per method, plus the mean row."""
    names = list(results)
    head = "| layer | " + " | ".join(f"K {n} | V {n}" for n in names) + " |"
    sep = "|---:|" + "---:|---:|" * len(names)
    lines = [head, sep]
    n_layers = len(next(iter(results.values())))
    for i in range(n_layers):
        cells = " | ".join(f"{results[n][i]['k']:.3f} | {results[n][i]['v']:.3f}" for n in names)
        lines.append(f"| {results[names[0]][i]['layer']} | {cells} |")
    means = " | ".join(
        f"**{sum(r['k'] for r in results[n]) / n_layers:.3f}** | **{sum(r['v'] for r in results[n]) / n_layers:.3f}**"
        for n in names)
    lines.append(f"| mean | {means} |")
    return "\n".join(lines)


def measure(model_path=None, eval_text=None, center_text=None, tokens=2048, seq_len=512,
            skip_tokens=1000, text_folder=None, levers: dict[str, RotationArtifacts] | None = None):
    """Identity, Hadamard and centred-Hadamard errors on real keys/values; returns ``(results, meta, diagnosis)``.

    The centred control takes its key means from ``center_text``, never from the text it is measured on.
    Defaults: the first evaluation and the first calibration text of ``configs/text_split.json``.
    ``diagnosis`` is :func:`diagnostics.diagnose` per (layer, KV head) with those three levers and
    ``levers`` (e.g. calibrated artifacts) after them.
    """
    cal_texts, eval_texts = configs.text_split()
    eval_text = eval_text or eval_texts[0]
    center_text = center_text or cal_texts[0]
    if eval_text == center_text:
        raise ValueError(f"measure keys on one text and take key means from another, not both from {eval_text}")
    lm, tok, path = model_io.load(model_path)
    fp = art.ModelFingerprint.from_config(lm.config)
    texts = assets.read_texts([eval_text, center_text], folder=text_folder)
    eval_seqs = data.token_sequences(tok, texts[eval_text], seq_len, tokens, skip_tokens)
    center_seqs = data.token_sequences(tok, texts[center_text], seq_len, tokens, skip_tokens)
    kv_eval = capture.capture_kv(lm, eval_seqs)
    kv_center = capture.capture_kv(lm, center_seqs)
    hadamard = art.hadamard(fp)
    methods = {
        "identity": art.identity(fp),
        "hadamard": hadamard,
        "hadamard+center": with_key_means(hadamard, kv_center, "hadamard+center"),
    }
    results = {name: per_layer_errors(kv_eval, a) for name, a in methods.items()}
    diagnosis = diagnostics.diagnose(kv_eval, {**methods, **(levers or {})})
    meta = {
        "model": str(path), "fingerprint": fp.__dict__, "eval_text": eval_text, "center_text": center_text,
        "eval_tokens": sum(s.numel() for s in eval_seqs), "seq_len": seq_len, "skip_tokens": skip_tokens,
        "group_size": fp.head_dim, "bits_per_element": 2 + 32 / fp.head_dim,
        "key_statistics": key_statistics(kv_eval),
    }
    return results, meta, diagnosis
