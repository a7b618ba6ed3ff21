"""Simulated INT2 KV cache inside a transformers model, exactly as serving reads it.

An attention function registered under :data:`ATTN_NAME` replaces attention
while :func:`simulated` is active.  Per layer it rotates queries, keys and
values with the artifact (``q' = q R_K``, ``k' = (k − μ) R_K``, ``v' = v R_V``),
quantizes ``k'``/``v'`` with the project's row format (the layer's K and V
formats from the artifact, bits and group, and its clip ratios), attends with each (query, key) pair reading the exact or the
INT2 row according to the serving windows (:mod:`.served`), and de-rotates the
output.  Quantization is a deterministic function of each row, so re-quantizing
the exact keys that transformers' cache holds gives the same rows the INT2 pool
would hold.

Modes:

* ``decode``: every query reads its history as a token-by-token decode would
  (only its sink and recent windows exact).  One forward pass gives the
  teacher-forced perplexity of decoding through the INT2 cache.
* ``serve``: the tokens of a forward call are exact among themselves and read
  the cached prefix through the windows (prefill, chunked prefill, decode).
  Use it with ``generate``.

With ``measure=True`` the function also computes exact attention, accumulates
the per-layer relative error of the attention output *after* ``W_O``, and
returns the exact output, so the errors of different layers do not compound.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot
from oscar_sglang.artifacts import RotationArtifacts

from . import served
from .capture import attention_swapped, register_attention

ATTN_NAME = "oscar_int2_sim"
MODES = ("decode", "serve")


@dataclass
class SimState:
    artifact: RotationArtifacts
    mode: str = "decode"
    sink: int | None = None  # None: the artifact's default
    recent: int | None = None
    quantize: bool = True
    measure: bool = False
    err_sq: dict[int, float] = field(default_factory=dict)
    ref_sq: dict[int, float] = field(default_factory=dict)
    _layers: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.sink = self.artifact.sink if self.sink is None else self.sink
        self.recent = self.artifact.recent if self.recent is None else self.recent

    def layer(self, i: int, device):
        if i not in self._layers:
            self._layers[i] = self.artifact.layers[i].to(device)
        return self._layers[i]

    def layer_errors(self) -> list[float]:
        """Relative attention-output error after ``W_O``, per layer (needs ``measure=True``)."""
        return [(self.err_sq[i] / max(self.ref_sq[i], 1e-30)) ** 0.5 for i in sorted(self.err_sq)]


_state: SimState | None = None


def _allowed(attention_mask, b, s, t, q_pos, device) -> torch.Tensor:
    causal = served.causal_mask(q_pos, t).reshape(1, 1, s, t)
    if attention_mask is None:
        return causal
    m = attention_mask[..., :t]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    return causal & m.reshape(m.shape[0], 1, s, t)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    st = _state
    if st is None:
        raise RuntimeError(f"attention {ATTN_NAME!r} used outside simulate.simulated()")
    b, h, s, d = query.shape
    g, t = key.shape[1], key.shape[2]
    if st.mode == "serve" and s == t and not st.measure:
        # A prefill with no cached prefix reads only its own tokens, all exact: plain attention, without
        # materialising two [s, t] logit tensors in float32 (the cost of a long pass-key prompt).
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = st.layer(module.layer_idx, query.device)
    rep = h // g
    scale = scaling if scaling is not None else d ** -0.5
    lf = st.artifact.layer_formats[module.layer_idx]

    qr = rot.rotate_queries(query.transpose(1, 2), layer.q_transform).transpose(1, 2)  # [b, H, s, d]
    kr = rot.rotate_kv(key.transpose(1, 2), layer.k_transform, layer.k_mean).transpose(1, 2)  # [b, G, T, d]
    vr = rot.rotate_kv(value.transpose(1, 2), layer.v_rotation).transpose(1, 2)
    if st.quantize:
        kq = lf.k.fake_quantize(kr, layer.k_clip.reshape(-1, 1, 1))
        vq = lf.v.fake_quantize(vr, layer.v_clip.reshape(-1, 1, 1))
    else:
        kq, vq = kr, vr
    q_pos = torch.arange(t - s, t, device=query.device)
    allowed = _allowed(attention_mask, b, s, t, q_pos, query.device)
    if st.mode == "decode":
        exact = served.decode_exact_mask(q_pos, t, st.sink, st.recent)
    else:
        exact = served.serve_exact_mask(s, t, st.sink, st.recent, device=query.device)
    exp = lambda x: x.repeat_interleave(rep, dim=1)  # noqa: E731  [b, G, T, d] -> [b, H, T, d]
    out_r = served.mixed_attention(qr, exp(kr), exp(kq), exp(vr), exp(vq), exact, allowed, scale)
    out = rot.derotate_output(out_r.transpose(1, 2), layer.v_rotation)  # [b, s, H, d]

    if st.measure:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        ref, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                        **kwargs)
        w_o = module.o_proj.weight.float()
        diff = (out.float() - ref.float()).reshape(b, s, h * d) @ w_o.T
        base = ref.float().reshape(b, s, h * d) @ w_o.T
        i = module.layer_idx
        st.err_sq[i] = st.err_sq.get(i, 0.0) + diff.square().sum().item()
        st.ref_sq[i] = st.ref_sq.get(i, 0.0) + base.square().sum().item()
        return ref, None
    return out.to(query.dtype), None


@contextmanager
def simulated(model, state: SimState):
    """Within the block, ``model`` attends through the simulated INT2 cache described by ``state``."""
    global _state
    register_attention(ATTN_NAME, _attention)
    if _state is not None:
        raise RuntimeError("a simulated cache is already active")
    _state = state
    try:
        with attention_swapped(model, ATTN_NAME):
            yield state
    finally:
        _state = None
