"""Per-channel key scaling: an invertible, non-orthogonal lever on top of the rotation (issue 10).

After the rotation, keys are stored as ``k' = ((k - mean) R_K) * s`` with one
positive scale per KV head and channel, and queries read ``q' = (q R_K) / s``:
``q' . k'`` is the exact logit, so attention is unchanged before quantization
(``artifacts.LayerRotation.k_transform`` / ``q_transform``).  What changes is
where the INT2 rounding error lands.  The row's step is set by its range, so
every channel of a row gets about the same absolute error ``e`` in the stored
frame, and the logit error is ``sum_c (q R_K)_c e_c / s_c``: channels where
the queries are large gain from a larger ``s`` (their error shrinks by
``1/s``), channels where the keys are large pay for it (they stretch every
row's range).  With Gaussian-like rows (range ~ row RMS) the logit error is
``(sum_c s_c^2 b_c)(sum_c a_c / s_c^2)`` for query energies ``a_c`` and key
energies ``b_c``, smallest at ``s_c = (a_c / b_c)^(1/4)``; with rows whose
range is set by one extreme channel it is smallest at ``s_c = b_c^(-1/2)``.
So the candidates are the family

    s_c = a_c^(alpha / 2) / b_c^(beta / 2)        (:data:`EXPONENTS`)

normalised to geometric mean 1 and bounded to ``artifacts.KEY_SCALE_BOUNDS``,
``a`` and ``b`` measured on the kept calibration sequences in the rotated
frame.  Each KV head takes the candidate and clip level with the smallest
key logit error over the INT2 reads (the clip search's measure), and keeps it
only if it passes the held-out check the other data-dependent choices pass:
for each held-out group, energies measured and the candidate chosen on the
other groups, scored on it against the unscaled rows at their own clip;
summed over groups the scaled rows must have the smaller error.
"""

from __future__ import annotations

import torch

from oscar_sglang import artifacts as art
from oscar_sglang import format as fmt

from .fit import RotatedSample, relative_by_group

# (alpha, beta): (0.5, 0.5) the Gaussian-row optimum, (0, 1) the extreme-channel one, and between.
EXPONENTS = ((0.5, 0.5), (0.25, 0.5), (0.0, 0.5), (0.0, 1.0), (0.25, 0.25))
CLIPS = (1.0, 0.9, 0.8, 0.7)


def channel_energies(rotated: list[RotatedSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean squared rotated query (summed over each KV head's query heads) and key per channel, ``[G, d]`` each."""
    rep = rotated[0].rep
    q = sum(r.qr.double().square().mean(1) for r in rotated) / len(rotated)
    k = sum(r.kr.double().square().mean(1) for r in rotated) / len(rotated)
    return q.reshape(k.shape[0], rep, -1).sum(1), k


def candidate_scales(q_energy: torch.Tensor, k_energy: torch.Tensor, exponents=EXPONENTS) -> torch.Tensor:
    """``[len(exponents), G, d]`` float32 scales ``a^(alpha/2) / b^(beta/2)``, geometric mean 1 per head, bounded."""
    lo, hi = art.KEY_SCALE_BOUNDS
    a, b = q_energy.clamp_min(1e-20).log(), k_energy.clamp_min(1e-20).log()
    out = []
    for alpha, beta in exponents:
        log_s = 0.5 * (alpha * a - beta * b)
        log_s = log_s - log_s.mean(-1, keepdim=True)
        out.append(log_s.exp().clamp(lo * 1.01, hi / 1.01))
    return torch.stack(out).float()


def _errors(rotated: list[RotatedSample], scales: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Key logit error ``[S, candidates, clips, G]`` of every kept sequence for each candidate scale and clip."""
    out = torch.zeros(len(rotated), scales.shape[0], len(CLIPS), scales.shape[1], dtype=torch.float64)
    for si, r in enumerate(rotated):
        qr, kr = r.qr, r.kr
        for ci, s in enumerate(scales):
            r.rescale_keys(s)
            for li, c in enumerate(CLIPS):
                out[si, ci, li] = r.key_error(fmt.fake_quantize(r.kr, group, c, bits=bits)).double()
            r.qr, r.kr = qr, kr
    return out


def _unscaled(rotated: list[RotatedSample], clip: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Key logit error ``[S, G]`` of the unscaled rows at their own clip levels."""
    return torch.stack([r.key_error(fmt.fake_quantize(r.kr, group, clip.reshape(-1, 1, 1), bits=bits)).double()
                        for r in rotated])


def _pick(err: torch.Tensor, energy: torch.Tensor, sample_groups: torch.Tensor, groups) -> torch.Tensor:
    """Best (candidate, clip) per head on ``groups``: flat index into ``candidates * clips``, ``[G]``."""
    s, c, l, g = err.shape
    return relative_by_group(err.reshape(s, c * l, g), energy, sample_groups, groups).argmin(0)


@torch.no_grad()
def search(rotated: list[RotatedSample], sample_groups: torch.Tensor, n_groups: int, k_clip: torch.Tensor,
           group: int, bits: int = 2) -> dict:
    """Key channel scales and clip levels per KV head, held-out checked (module docstring).

    ``rotated``: the kept sequences, unscaled, with the layer's final rotation
    and key mean.  Returns ``k_scale [G, d]`` (ones where not kept),
    ``k_clip [G]``, ``kept [G]`` and the held-out errors behind the decision.
    """
    kvh = k_clip.shape[0]
    energy = torch.stack([r.key_energy().double() for r in rotated])  # logits are unchanged by the scaling
    base = _unscaled(rotated, k_clip, group, bits)
    heads = torch.arange(kvh)
    held_scaled = torch.zeros(kvh, dtype=torch.float64)
    held_base = torch.zeros(kvh, dtype=torch.float64)
    if n_groups >= 2:
        for f in range(n_groups):
            rest = [g for g in range(n_groups) if g != f]
            train = [r for r, g in zip(rotated, sample_groups.tolist()) if g != f]
            scales = candidate_scales(*channel_energies(train))
            err = _errors(rotated, scales, group, bits)
            choice = _pick(err, energy, sample_groups, rest)
            held = relative_by_group(err.flatten(1, 2), energy, sample_groups, [f])
            held_scaled += held[choice, heads]
            held_base += relative_by_group(base.unsqueeze(1), energy, sample_groups, [f])[0]
        kept = held_scaled < held_base
    else:  # nothing to hold out: the in-sample choice stands unchecked, as the other choices do
        kept = torch.ones(kvh, dtype=torch.bool)
    scales = candidate_scales(*channel_energies(rotated))
    err = _errors(rotated, scales, group, bits)
    choice = _pick(err, energy, sample_groups, range(n_groups))
    cand, clip_i = choice // len(CLIPS), choice % len(CLIPS)
    k_scale = torch.where(kept.unsqueeze(-1), scales[cand, heads], torch.ones_like(scales[0]))
    clips = torch.tensor(CLIPS, dtype=torch.float32)[clip_i]
    tot_energy = energy.sum(0).clamp_min(1e-30)
    scaled_err = err.flatten(1, 2).sum(0)[choice, heads] / tot_energy
    base_err = base.sum(0) / tot_energy
    return {
        "k_scale": k_scale,
        "k_clip": torch.where(kept, clips, k_clip.float()),
        "kept": kept,
        "exponent": [list(EXPONENTS[int(c)]) if k else None for c, k in zip(cand, kept)],
        "heldout_scaled": held_scaled,
        "heldout_unscaled": held_base,
        "rel_error": torch.where(kept, scaled_err, base_err).sqrt(),
        "rel_error_unscaled": base_err.sqrt(),
    }
