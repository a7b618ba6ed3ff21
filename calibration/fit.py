"""OSCAR rotations from statistics, and the per-head clip search (METHOD.md steps 3-5).

The clip search scores each candidate ratio by the error that matters, on
calibration sequences, over exactly the (query, key) pairs that serving
reads from INT2 in decode (see :mod:`.served`):

* keys: the squared logit error ``Σ (q'_i · Δk'_t)²``, summed over the query
  heads of the KV head (query-weighted);
* values: the squared attention-output error ``Σ_i ||Σ_t p_it Δv'_t||²`` with
  the exact attention probabilities (attention-weighted).
"""

from __future__ import annotations

import torch

from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot

from . import served
from .stats import LayerSample, LayerStats

CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45)
QUERY_BLOCK = 64  # query positions per block of the error measures (RotatedSample)


def oscar_rotations(stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
    """``R_K = U_Q H P`` and ``R_V = U_S H P`` per KV head (float64 ``[kv_heads, d, d]``)."""
    _, u_q = rot.eigenbasis(stats.query_cov)
    _, u_s = rot.eigenbasis(stats.value_cov)
    return rot.compose(u_q), rot.compose(u_s)


def query_positions(seq_len: int, sink: int, recent: int, max_queries: int, generator: torch.Generator) -> torch.Tensor:
    """Query positions that read at least one INT2 key in decode, subsampled to ``max_queries``."""
    first = sink + recent
    if first >= seq_len:
        raise ValueError(f"sequences of {seq_len} tokens never leave the BF16 windows (sink {sink} + recent "
                         f"{recent}); calibrate with longer sequences or smaller windows")
    pos = torch.arange(first, seq_len)
    if pos.numel() > max_queries:
        pos = pos[torch.randperm(pos.numel(), generator=generator)[:max_queries]].sort().values
    return pos


class RotatedSample:
    """One sequence in rotated space with its query subset and masks, reused across candidates."""

    def __init__(self, sample: LayerSample, k_rot, v_rot, k_mean, sink, recent, scale, pos, k_scale=None):
        q = sample.q.float()[:, pos]  # [H, nq, d]
        k, v = sample.k.float(), sample.v.float()  # [G, T, d]
        h, g = q.shape[0], k.shape[0]
        self.rep = h // g
        self.qr = rot.rotate_queries(q.transpose(0, 1), k_rot).transpose(0, 1).contiguous()  # [H, nq, d]
        self.kr = rot.rotate_kv(k.transpose(0, 1), k_rot, k_mean).transpose(0, 1)  # [G, T, d]
        if k_scale is not None:  # key channel scales [G, d]: k' = k R s, q' = q R / s (same logits)
            self.rescale_keys(k_scale.float())
        self.vr = rot.rotate_kv(v.transpose(0, 1), v_rot).transpose(0, 1)
        t = k.shape[1]
        allowed = served.causal_mask(pos, t)
        self.exact = served.decode_exact_mask(pos, t, sink, recent)
        self.int2 = allowed & ~self.exact
        self.allowed = allowed
        self.scale = scale
        logits = torch.einsum("hsd,htd->hst", self.qr, self.kr.repeat_interleave(self.rep, 0)) * scale
        self.probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        self._reference = None  # output_error's exact output after W_O, for the (v_rot, w_o) it was made with
        # the error measures take each KV head's query heads side by side, [G, rep * n, ...]: one batched
        # matmul over a KV head's rows, without repeating them for every query head; and the queries in blocks of
        # QUERY_BLOCK positions, each against the keys it reads from INT2 only ([lo, hi): past the sink, before
        # its last query's recent window), not every key (at 64 / 256 windows over 1024-token sequences about a
        # third of all (query, key) pairs are INT2 ones)
        self._blocks = []
        for s0 in range(0, self.int2.shape[0], QUERY_BLOCK):
            s1 = min(self.int2.shape[0], s0 + QUERY_BLOCK)
            cols = self.int2[s0:s1].any(0).nonzero()
            if cols.numel():
                self._blocks.append((s0, s1, int(cols[0]), int(cols[-1]) + 1))
        p_int2 = (self.probs * self.int2).reshape(g, self.rep, -1, t)
        self._int2_blocks = [self.int2[s0:s1, lo:hi].float().repeat(self.rep, 1)    # [rep * n, hi - lo]
                             for s0, s1, lo, hi in self._blocks]
        self._p_int2_blocks = [p_int2[:, :, s0:s1, lo:hi].reshape(g, -1, hi - lo)    # [G, rep * n, hi - lo]
                               for s0, s1, lo, hi in self._blocks]
        self._q_blocks_of, self._q_blocks = None, []  # self.qr's blocks (rescale_keys replaces self.qr)

    def rescale_keys(self, k_scale: torch.Tensor) -> None:
        """Multiply the key channels by ``k_scale [G, d]`` and divide the queries' by it (logits unchanged)."""
        self.kr = self.kr * k_scale.unsqueeze(1)
        self.qr = self.qr / k_scale.repeat_interleave(self.rep, 0).unsqueeze(1)

    def _logit_square_sum(self, dk: torch.Tensor) -> torch.Tensor:
        """Per KV head: ``Σ (q'_i · dk_t)²`` over the INT2 pairs of its query heads, for rows ``dk [G, T, d]``."""
        g, d = dk.shape[0], dk.shape[-1]
        if self._q_blocks_of is not self.qr:
            q = self.qr.reshape(g, self.rep, -1, d)
            self._q_blocks = [q[:, :, s0:s1].reshape(g, -1, d) for s0, s1, _, _ in self._blocks]
            self._q_blocks_of = self.qr
        total = torch.zeros(g, dtype=dk.dtype, device=dk.device)
        for q, mask, (_, _, lo, hi) in zip(self._q_blocks, self._int2_blocks, self._blocks):
            total += torch.bmm(q, dk[:, lo:hi].transpose(1, 2)).square_().mul_(mask).sum(dim=(1, 2))
        return total

    def _output_square_sum(self, dv: torch.Tensor) -> torch.Tensor:
        """Per KV head: ``Σ_i ||Σ_t p_it dv_t||²`` over the INT2 rows of its query heads, for ``dv [G, T, d]``."""
        total = torch.zeros(dv.shape[0], dtype=dv.dtype, device=dv.device)
        for p, (_, _, lo, hi) in zip(self._p_int2_blocks, self._blocks):
            total += torch.bmm(p, dv[:, lo:hi]).square_().sum(dim=(1, 2))
        return total

    def key_error(self, kq: torch.Tensor) -> torch.Tensor:
        """Per KV head: squared logit error over the INT2 pairs."""
        return self._logit_square_sum(kq - self.kr)

    def value_error(self, vq: torch.Tensor) -> torch.Tensor:
        """Per KV head: squared attention-output error from INT2 values."""
        return self._output_square_sum(vq - self.vr)

    def output_error(self, kq: torch.Tensor | None, vq: torch.Tensor | None, v_rot: torch.Tensor,
                     w_o: torch.Tensor, scale: float) -> tuple[float, float]:
        """Squared error and energy of the attention output after ``W_O`` over the sampled decode queries.

        Keys read ``kq`` and values ``vq`` (rotated rows; None: exact) where
        serving reads INT2, the exact rows in the windows; the output is
        de-rotated (``o = o' R_V^T``) and projected by ``w_o [hidden, q_heads * d]``,
        so errors of keys and values, and of different layers, share one unit:
        the error the next layer receives.
        """
        exp = lambda x: x.repeat_interleave(self.rep, 0)  # noqa: E731
        vr = exp(self.vr)
        vq = vr if vq is None else exp(vq)
        if kq is None and scale == self.scale:  # exact keys: the sample's own probabilities, as computed here
            out = served.mixed_output(self.probs, self.exact, vr, vq)
        else:
            kr = exp(self.kr)
            out = served.mixed_attention(self.qr, kr, kr if kq is None else exp(kq), vr, vq, self.exact,
                                         self.allowed, scale)
        h, s, d = out.shape

        def project(o):
            return rot.derotate_output(o.transpose(0, 1), v_rot).reshape(s, h * d) @ w_o.T

        if self._reference is None or self._reference[0] is not v_rot or self._reference[1] is not w_o:
            base = project(torch.einsum("hst,htd->hsd", self.probs, vr))  # the same for every option measured
            self._reference = (v_rot, w_o, base, float(base.double().square().sum()))
        base, energy = self._reference[2:]
        return float((project(out) - base).double().square().sum()), energy

    def key_energy(self) -> torch.Tensor:
        return self._logit_square_sum(self.kr)

    def value_energy(self) -> torch.Tensor:
        return self._output_square_sum(self.vr)


# --- error curves over the clip grid, per held-out group -----------------------------------------

def clip_curves(rotated: list[RotatedSample], group: int, which: str, bits: int = 2,
                symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error per kept sequence and clip level ``[S, len(CLIP_GRID), kv_heads]`` and energy ``[S, kv_heads]``."""
    errs, energy = [], []
    for s in rotated:
        x = s.kr if which == "k" else s.vr
        measure = s.key_error if which == "k" else s.value_error
        clip = torch.empty(x.shape[0], 1, 1)
        row = []
        for c in CLIP_GRID:
            row.append(measure(fmt.fake_quantize(x, group, clip.fill_(float(c)), bits, symmetric)).double())
        errs.append(torch.stack(row))
        energy.append((s.key_energy() if which == "k" else s.value_energy()).double())
    return torch.stack(errs), torch.stack(energy)


def relative_by_group(err: torch.Tensor, energy: torch.Tensor, sample_groups: torch.Tensor, groups) -> torch.Tensor:
    """Relative squared error ``[n_clips, kv_heads]`` summed over ``groups``, each group weighing equally."""
    total = torch.zeros(err.shape[1:], dtype=torch.float64)
    for g in groups:
        m = sample_groups == g
        total += err[m].sum(0) / energy[m].sum(0).clamp_min(1e-30)
    return total


def fold_scores(err, energy, sample_groups, n_groups: int, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip chosen on the groups other than ``f``; ``f``'s relative error at that clip and at no clip."""
    rest = [g for g in range(n_groups) if g != f]
    chosen = relative_by_group(err, energy, sample_groups, rest).argmin(0)
    held = relative_by_group(err, energy, sample_groups, [f])
    heads = torch.arange(held.shape[1])
    return held[chosen, heads], held[0]  # CLIP_GRID[0] == 1.0: no clip


@torch.no_grad()
def search_clips(samples: list[RotatedSample], group_size: int, grid=CLIP_GRID) -> dict:
    """Best clip ratio per KV head for keys and values; returns ratios and relative errors."""
    from oscar_sglang import format as fmt

    kv_heads = samples[0].kr.shape[0]
    k_err = torch.zeros(len(grid), kv_heads, dtype=torch.float64)
    v_err = torch.zeros(len(grid), kv_heads, dtype=torch.float64)
    k_energy = sum(s.key_energy() for s in samples).double()
    v_energy = sum(s.value_energy() for s in samples).double()
    for ci, c in enumerate(grid):
        clip = torch.full((kv_heads, 1, 1), float(c))
        for s in samples:
            k_err[ci] += s.key_error(fmt.fake_quantize(s.kr, group_size, clip)).double()
            v_err[ci] += s.value_error(fmt.fake_quantize(s.vr, group_size, clip)).double()
    grid_t = torch.tensor(grid, dtype=torch.float32)
    kb, vb = k_err.argmin(0), v_err.argmin(0)
    heads = torch.arange(kv_heads)
    return {
        "k_clip": grid_t[kb],
        "v_clip": grid_t[vb],
        "k_rel_error": (k_err[kb, heads] / k_energy.clamp_min(1e-30)).sqrt(),
        "v_rel_error": (v_err[vb, heads] / v_energy.clamp_min(1e-30)).sqrt(),
        "k_rel_error_noclip": (k_err[0] / k_energy.clamp_min(1e-30)).sqrt(),
        "v_rel_error_noclip": (v_err[0] / v_energy.clamp_min(1e-30)).sqrt(),
    }
