"""OptR: output-aware refinement of per-KV-head rotations (METHOD.md, "Output-aware refinement").

Per layer, starting from ``R_0`` (OSCAR or Hadamard) with the key means
subtracted, learn ``R = R_0 · exp(A − Aᵀ)`` per KV head:

1. **Keys** (values exact): ``KL(p_fp || p_q) + λ ||(p_q − p_fp) V W_Oʰ||² / ||p_fp V W_Oʰ||²``
   per query head ``h``, with ``p_q`` the attention of the served read path
   (INT2 keys outside the sink/recent windows, exact inside).
2. **Values** (key rotation fixed): ``||p_q ΔV W_Oʰ||² / ||p_q V W_Oʰ||²`` with
   ``ΔV`` the INT2 value error de-rotated to model space, INT2 pairs only.

Rounding passes gradients straight through (:func:`.served.fake_quantize_ste`).
A KV head keeps its learned rotation only if its loss on held-out sequences
improves on ``R_0``'s; otherwise it is reverted.  Deterministic under a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_sglang import rotation as rot

from . import served
from .fit import query_positions
from .stats import LayerSample


@dataclass
class OptRConfig:
    steps: int = 30
    lr: float = 1e-3
    kl_weight: float = 1.0
    output_weight: float = 1.0  # λ
    max_queries: int = 96
    heldout: int = 1  # sequences held out for the keep/revert decision


def output_factors(w_o: torch.Tensor, heads: int) -> torch.Tensor:
    """Per query head ``h``, ``Lʰ [d, d]`` with ``Lʰ Lʰᵀ = W_Oʰ W_Oʰᵀ``, ``W_Oʰ = o_proj.weight[:, h d:(h+1) d]ᵀ``.

    So ``||x W_Oʰ|| = ||x Lʰ||`` for any row ``x``: the output error after the
    projection, at ``d/hidden`` of the cost.
    """
    w = w_o.double().reshape(w_o.shape[0], heads, -1).permute(1, 2, 0)  # [H, d, hidden]
    vals, vecs = torch.linalg.eigh(w @ w.transpose(1, 2))
    return (vecs * vals.clamp_min(0).sqrt().unsqueeze(-2)).float()


class _Prepared:
    """One sequence's tensors that do not depend on the rotation being learned."""

    def __init__(self, s: LayerSample, k_mean, w_o, sink, recent, scale, pos):
        self.q = s.q.float()[:, pos].transpose(0, 1)  # [nq, H, d]
        self.k = s.k.float().transpose(0, 1)  # [T, G, d]
        self.v = s.v.float().transpose(0, 1)
        self.k_mean = k_mean
        h, g = self.q.shape[1], self.k.shape[1]
        self.rep = h // g
        t = self.k.shape[0]
        self.allowed = served.causal_mask(pos, t)
        self.exact = served.decode_exact_mask(pos, t, sink, recent)
        self.int2 = self.allowed & ~self.exact
        self.scale = scale
        kc = (self.k - k_mean).repeat_interleave(self.rep, 1)  # [T, H, d]
        logits = torch.einsum("shd,thd->hst", self.q, kc) * scale
        self.logits_fp = logits.masked_fill(~self.allowed, float("-inf"))
        self.logp_fp = torch.log_softmax(self.logits_fp, -1)
        self.p_fp = self.logp_fp.exp()
        # the losses take each KV head's query heads side by side, [G, rep * nq, ...]: one batched matmul per KV
        # head's rows, without repeating them for every query head (nor summing their gradients back)
        nq = self.q.shape[0]
        self.q_by_kv = self.q.transpose(0, 1).reshape(g, self.rep * nq, -1).contiguous()   # [G, rep * nq, d]
        # the logits outside INT2 (exact, or -inf where not allowed), and Σ_t p_fp log p_fp of the KL divergence
        self.logits_kept = self.logits_fp.masked_fill(self.int2, float("-inf"))
        self.p_logp_fp = (self.p_fp * self.logp_fp).nan_to_num(0.0).sum(-1)                # [H, nq]
        # ||x W_Oʰ||² = ||x Lʰ||² with Lʰ Lʰᵀ = W_Oʰ W_Oʰᵀ: a d x d factor instead of d x hidden.
        self.w_o = output_factors(w_o, h)  # [H, d, d]
        self.vw = torch.einsum("thd,hdo->hto", self.v.repeat_interleave(self.rep, 1), self.w_o)
        self.ref_out = torch.einsum("hst,hto->hso", self.p_fp, self.vw).square().sum(dim=(1, 2)).clamp_min(1e-30)

    def probs_q(self, r_k, clip, group):
        """Attention probabilities of the served read path with key rotation ``r_k``."""
        qr = torch.bmm(self.q_by_kv, r_k)  # [G, rep * nq, d]
        kr = rot.rotate_kv(self.k, r_k, self.k_mean)  # [T, G, d]
        kq = served.fake_quantize_ste(kr, group, clip)
        lq = torch.bmm(qr, kq.permute(1, 2, 0)).reshape(self.logits_fp.shape) * self.scale  # [H, nq, T]
        return torch.log_softmax(torch.where(self.int2, lq, self.logits_kept), -1)

    def key_loss(self, r_k, clip, group, cfg: OptRConfig) -> torch.Tensor:
        logp_q = self.probs_q(r_k, clip, group)
        p_q = logp_q.exp()
        kl = (self.p_logp_fp - (self.p_fp * logp_q.masked_fill(~self.allowed, 0.0)).sum(-1)).mean(-1)  # [H]
        out = torch.einsum("hst,hto->hso", p_q - self.p_fp, self.vw).square().sum(dim=(1, 2)) / self.ref_out
        per_head = cfg.kl_weight * kl + cfg.output_weight * out
        return per_head.reshape(-1, self.rep).sum(-1)  # [G]

    def read_values_with(self, p_q: torch.Tensor) -> None:
        """Fix the attention probabilities the value loss weighs with (those of the learned key rotation): their
        INT2 part and the output energy they give the exact values, constant while the values are trained."""
        g, t = self.k.shape[1], self.k.shape[0]
        self.p_q_int2 = (p_q * self.int2).reshape(g, -1, t)  # [G, rep * nq, T]
        self.v_ref = torch.einsum("hst,hto->hso", p_q, self.vw).square().sum(dim=(1, 2)).clamp_min(1e-30)

    def value_loss(self, r_v, clip, group) -> torch.Tensor:
        """Per KV head: the output error of INT2 values under :meth:`read_values_with`'s probabilities.

        ``||P ΔV R_Vᵀ Lʰ||²`` per query head, multiplied from the left: the INT2 weights times the rotated error
        first (one batched matmul per KV head), then ``R_Vᵀ Lʰ`` (d x d) on those few rows, instead of the
        error de-rotated and projected for every token and query head."""
        vr = rot.rotate_kv(self.v, r_v)  # [T, G, d]
        dv = served.fake_quantize_ste(vr, group, clip) - vr
        g, d = dv.shape[1], dv.shape[2]
        y = torch.bmm(self.p_q_int2, dv.transpose(0, 1)).reshape(g, self.rep, -1, d)   # [G, rep, nq, e]
        back = torch.einsum("gde,grdo->greo", r_v, self.w_o.reshape(g, self.rep, d, d))  # R_Vᵀ Lʰ: [G, rep, e, o]
        err = torch.einsum("grse,greo->grso", y, back).square().sum(dim=(2, 3)).reshape(-1)  # [H]
        return (err / self.v_ref).reshape(-1, self.rep).sum(-1)


def _learned(r0: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return r0 @ torch.matrix_exp(a - a.transpose(-1, -2))


def _train(loss_fn, r0: torch.Tensor, train, heldout, cfg: OptRConfig):
    """Adam on the skew generator with a cosine learning rate.

    Rounding makes the loss jumpy, so each KV head keeps the generator of its
    best *training* loss seen; that candidate then has to beat ``R_0`` on the
    held-out sequences, or the head is reverted.  Returns (rotations,
    held-out loss of ``R_0``, held-out loss of the candidate, kept mask).
    """
    a = torch.zeros_like(r0, requires_grad=True)
    best_a = torch.zeros_like(r0)
    best = torch.full((r0.shape[0],), float("inf"))
    opt = torch.optim.Adam([a], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(cfg.steps, 1))
    for _ in range(cfg.steps):
        opt.zero_grad()
        r = _learned(r0, a)  # one matrix exponential per step, shared by the sequences' losses
        per_head = sum(loss_fn(p, r) for p in train)
        with torch.no_grad():
            better = per_head.detach() < best
            best = torch.where(better, per_head.detach(), best)
            best_a[better] = a.detach()[better]
        per_head.sum().backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        learned = _learned(r0, best_a)
        before = sum(loss_fn(p, r0) for p in heldout)
        after = sum(loss_fn(p, learned) for p in heldout)
        keep = after < before
        final = torch.where(keep.reshape(-1, 1, 1), learned, r0)
    return final, before, after, keep


def refine_layer(samples: list[LayerSample], r0_k: torch.Tensor, r0_v: torch.Tensor, k_mean: torch.Tensor,
                 k_clip: torch.Tensor, v_clip: torch.Tensor, w_o: torch.Tensor, *, sink: int, recent: int,
                 group: int, scale: float, cfg: OptRConfig, seed: int) -> dict:
    """Learn one layer's key and value rotations; returns rotations and held-out losses per KV head."""
    if len(samples) <= cfg.heldout:
        raise ValueError(f"OptR needs more than {cfg.heldout} kept sequences, got {len(samples)}")
    gen = torch.Generator().manual_seed(seed)
    prepared = []
    for s in samples:
        pos = query_positions(s.q.shape[1], sink, recent, cfg.max_queries, gen)
        prepared.append(_Prepared(s, k_mean.float(), w_o, sink, recent, scale, pos))
    train, heldout = prepared[: -cfg.heldout], prepared[-cfg.heldout:]
    kc = k_clip.float().reshape(-1, 1)
    vc = v_clip.float().reshape(-1, 1)

    r_k, k_before, k_after, k_keep = _train(lambda p, r: p.key_loss(r, kc, group, cfg), r0_k.float(), train,
                                            heldout, cfg)
    with torch.no_grad():
        for p in prepared:
            p.read_values_with(p.probs_q(r_k, kc, group).exp())
    r_v, v_before, v_after, v_keep = _train(lambda p, r: p.value_loss(r, vc, group), r0_v.float(), train, heldout,
                                            cfg)
    return {
        # matrix_exp in float32 drifts from orthogonal by ~1e-6: snap back in float64.
        "k_rotation": rot.nearest_orthogonal(r_k), "v_rotation": rot.nearest_orthogonal(r_v),
        "k_heldout_before": k_before, "k_heldout_after": k_after, "k_kept": k_keep,
        "v_heldout_before": v_before, "v_heldout_after": v_after, "v_kept": v_keep,
    }
