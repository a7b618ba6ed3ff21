"""The serving read path, restated in differentiable torch for calibration and simulation.

Which keys a query reads exactly (BF16) and which from INT2 (DESIGN.md
invariant 2): the first ``sink`` positions of a sequence and the last
``recent`` tokens written are hot; everything else is read from INT2.

* **Decode** (one token at a time, the worst case): the query at position
  ``i`` has written tokens ``0..i``; key ``t`` is exact iff ``t < sink`` or
  ``t > i - recent``.
* **Serve** (a chunk of ``s`` new tokens on a prefix of ``T - s``): new tokens
  are exact among themselves; prefix token ``t`` is exact iff ``t < sink`` or
  ``t >= T - recent`` (the recent window after the chunk is written).

Attention over the mix is done in rotated space (``q' = q R_K``,
``k' = (k - μ) R_K``, ``v' = v R_V``); the output is de-rotated once.
"""

from __future__ import annotations

import torch

from oscar_sglang import format as fmt
from oscar_sglang import windows


def decode_exact_mask(q_pos: torch.Tensor, k_len: int, sink: int, recent: int) -> torch.Tensor:
    """``[len(q_pos), k_len]`` bool: key read in BF16 by a decoding query at each position."""
    t = torch.arange(k_len, device=q_pos.device)
    return windows.in_window(t.unsqueeze(0), q_pos.unsqueeze(1) + 1, sink, recent)   # length i + 1 at query i


def serve_exact_mask(s_new: int, k_len: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """``[s_new, k_len]`` bool for a chunk of ``s_new`` new tokens at the end of ``k_len`` keys."""
    t = torch.arange(k_len, device=device)
    exact = windows.in_window(t, k_len, sink, recent) | (t >= k_len - s_new)
    return exact.unsqueeze(0).expand(s_new, k_len)


def causal_mask(q_pos: torch.Tensor, k_len: int) -> torch.Tensor:
    """``[len(q_pos), k_len]`` bool: key position ``<=`` query position."""
    return torch.arange(k_len, device=q_pos.device).unsqueeze(0) <= q_pos.unsqueeze(1)


def _ste(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Forward ``value``, backward as identity through ``like``."""
    return like + (value - like).detach()


def fake_quantize_ste(x: torch.Tensor, group_size: int | None = None,
                      clip_ratio: torch.Tensor | float | None = None) -> torch.Tensor:
    """The INT2 round trip of :mod:`oscar_sglang.format` in float32, differentiable.

    Forward values equal ``format.fake_quantize(x.float(), ...)`` exactly.  The
    clip and the min/max pass gradients as usual; the fp16 storage of scale and
    zero and the rounding of codes pass them straight through.
    """
    d = x.shape[-1]
    g = fmt.clip_groups(x, clip_ratio, group_size or d)
    lo = g.amin(dim=-1, keepdim=True)
    hi = g.amax(dim=-1, keepdim=True)
    zero = _ste(lo.to(torch.float16).float(), lo)
    scale = _ste(((hi - zero) / (fmt.LEVELS - 1)).clamp_min(0).to(torch.float16).float(), (hi - zero) / (fmt.LEVELS - 1))
    inv = torch.where(scale.detach() > 0, 1.0 / scale.detach().clamp_min(1e-30), torch.zeros_like(scale))
    u = (g - zero) * inv
    codes = _ste(torch.round(u).clamp(0, fmt.LEVELS - 1), u.clamp(0, fmt.LEVELS - 1))
    return (zero + codes * scale).reshape(x.shape)


def mixed_attention(qr: torch.Tensor, kr: torch.Tensor, kq: torch.Tensor, vr: torch.Tensor, vq: torch.Tensor,
                    exact: torch.Tensor, allowed: torch.Tensor, scale: float,
                    return_probs: bool = False):
    """Attention where each (query, key) pair reads the exact or the quantized row.

    ``qr[..., H, s, d]``; ``kr, kq, vr, vq[..., H, T, d]`` (already repeated to
    the query heads); ``exact`` and ``allowed`` bool ``[s, T]`` (or broadcastable).
    Returns ``o'[..., H, s, d]`` (rotated space), and the probabilities if asked.
    """
    logits_x = torch.einsum("...hsd,...htd->...hst", qr, kr)
    logits_q = torch.einsum("...hsd,...htd->...hst", qr, kq)
    logits = torch.where(exact, logits_x, logits_q) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    out = mixed_output(p, exact, vr, vq)
    return (out, p) if return_probs else out


def mixed_output(p: torch.Tensor, exact: torch.Tensor, vr: torch.Tensor, vq: torch.Tensor) -> torch.Tensor:
    """:func:`mixed_attention`'s output from its probabilities ``p[..., H, s, T]``: the exact value rows where
    ``exact``, the quantized ones elsewhere."""
    px = p * exact
    return torch.einsum("...hst,...htd->...hsd", px, vr) + torch.einsum("...hst,...htd->...hsd", p - px, vq)
