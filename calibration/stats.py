"""Streaming calibration statistics (METHOD.md, "The objective", step 2).

Per layer and KV head ``g``, accumulated in float64 over every calibration token:

* ``C_Q[g] = Σ_{h in group(g)} Q_hᵀ Q_h / N``: the query covariance (post-RoPE).
* ``C_S[g] = Σ_{h in group(g)} (S_h V_g)ᵀ (S_h V_g) / N`` with ``S_h`` the exact
  causal attention probabilities.  ``S_h V_g`` is the attention output of head
  ``h`` (before ``W_O``), so the exact form costs nothing beyond the forward
  pass.  The cheaper *proxy* instead weights each value token ``t`` by
  ``k_t C_Q k_tᵀ`` (normalised to mean 1 within its batch), with ``C_Q`` the
  running estimate up to and including that batch.
* ``μ[g] = mean_t k_t``: the key channel means for centering.

Memory is constant in the number of calibration tokens.  Optionally the
first ``keep_sequences`` sequences' q, k, v are kept (bf16) for the clip
search and OptR, whose cost is bounded by that number, not by ``N``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VALUE_WEIGHTINGS = ("exact", "proxy")


@dataclass
class LayerSample:
    """One sequence's post-RoPE tensors of one layer: q ``[q_heads, s, d]``, k/v ``[kv_heads, s, d]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class LayerStats:
    c_q: torch.Tensor  # [kv_heads, d, d] float64, sum over tokens
    c_s: torch.Tensor  # [kv_heads, d, d] float64, sum over tokens
    k_sum: torch.Tensor  # [kv_heads, d] float64
    tokens: int = 0
    samples: list[LayerSample] = field(default_factory=list)

    @property
    def query_cov(self) -> torch.Tensor:
        return self.c_q / max(self.tokens, 1)

    @property
    def value_cov(self) -> torch.Tensor:
        return self.c_s / max(self.tokens, 1)

    @property
    def key_mean(self) -> torch.Tensor:
        return self.k_sum / max(self.tokens, 1)

    def to(self, device) -> None:
        """Move the float64 sums (the kept samples stay on the CPU in bf16)."""
        self.c_q, self.c_s, self.k_sum = (t.to(device) for t in (self.c_q, self.c_s, self.k_sum))


class StatsCollector:
    """A capture tap (see :mod:`.capture`) that accumulates :class:`LayerStats` per layer."""

    def __init__(self, num_layers: int, q_heads: int, kv_heads: int, head_dim: int,
                 value_weighting: str = "exact", keep_sequences: int = 0):
        if value_weighting not in VALUE_WEIGHTINGS:
            raise ValueError(f"value_weighting must be one of {VALUE_WEIGHTINGS}, got {value_weighting!r}")
        if q_heads % kv_heads:
            raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} KV heads")
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.value_weighting = value_weighting
        self.keep_sequences = keep_sequences
        d = head_dim
        self.layers = [
            LayerStats(torch.zeros(kv_heads, d, d, dtype=torch.float64), torch.zeros(kv_heads, d, d, dtype=torch.float64),
                       torch.zeros(kv_heads, d, dtype=torch.float64))
            for _ in range(num_layers)
        ]

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, q_heads, s, d]`` -> ``[b, kv_heads, rep, s, d]``."""
        b, h, s, d = x.shape
        return x.reshape(b, self.kv_heads, h // self.kv_heads, s, d)

    @torch.no_grad()
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        st = self.layers[layer]
        b, _, s, _ = q.shape
        if k.shape[2] != s:
            raise ValueError("statistics need whole sequences without a KV cache (use_cache=False)")
        if st.c_q.device != q.device:  # the sums live where the model runs (float64 there), from the first batch
            st.to(q.device)
        qd = self._grouped(q.double())
        st.c_q += torch.einsum("bgrsd,bgrse->gde", qd, qd)
        kd, vd = k.double(), v.double()
        st.k_sum += kd.sum(dim=(0, 2))
        st.tokens += b * s
        if self.value_weighting == "exact":
            o = out.double().transpose(1, 2)  # [b, q_heads, s, d] = S_h V
            og = self._grouped(o)
            st.c_s += torch.einsum("bgrsd,bgrse->gde", og, og)
        else:
            cq = st.c_q / st.tokens
            w = torch.einsum("bgsd,gde,bgse->bgs", kd, cq, kd)
            w = w / w.mean(dim=(0, 2), keepdim=True).clamp_min(1e-30)
            st.c_s += torch.einsum("bgs,bgsd,bgse->gde", w, vd, vd)
        for i in range(b):
            if len(st.samples) < self.keep_sequences:
                st.samples.append(LayerSample(q[i].to("cpu", torch.bfloat16), k[i].to("cpu", torch.bfloat16),
                                              v[i].to("cpu", torch.bfloat16)))
