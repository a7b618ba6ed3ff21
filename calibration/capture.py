"""See inside attention through transformers' attention interface.

One attention function, registered with ``AttentionInterface`` under
:data:`ATTN_NAME`, receives the post-RoPE queries, keys and values of every
layer of every architecture that transformers implements with the functional
attention interface.  It hands them to the active *taps* (callbacks), then
computes attention exactly as ``sdpa`` would.  No per-architecture hooks.

Tensors reach a tap as transformers passes them: ``query[b, q_heads, s, d]``,
``key``/``value[b, kv_heads, s_kv, d]`` (before GQA repetition), and the
attention output ``out[b, s, q_heads, d]`` (before ``W_O``), which for causal
attention is ``S V`` with ``S`` the attention probabilities.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable

import torch

ATTN_NAME = "oscar_capture"
Tap = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_taps: list[Tap] = []
_registered: set[str] = set()


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    for tap in list(_taps):
        tap(module.layer_idx, query, key, value, out)
    return out, weights


def register_attention(name: str, fn) -> None:
    """Register ``fn`` as transformers attention ``name``, with sdpa's mask format (once per process)."""
    if name in _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    _registered.add(name)


@contextmanager
def attention_swapped(model, name: str):
    """Within the block, ``model`` uses the registered attention ``name``; restored afterwards."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def tapped(model, tap: Tap):
    """Within the block, every attention call of ``model`` calls ``tap(layer, q, k, v, out)``."""
    register_attention(ATTN_NAME, _attention)
    _taps.append(tap)
    try:
        with attention_swapped(model, ATTN_NAME):
            yield model
    finally:
        _taps.remove(tap)


def run_layers(model, ids: torch.Tensor) -> None:
    """One sequence (1-D token ids) through the model's decoder layers, for what the taps see: the base model's
    forward, without the LM head, whose logits nobody reads here (on SmolLM2 the 49152-word head costs 15% of
    a 1024-token forward pass on CPU)."""
    model.base_model(ids.reshape(1, -1).to(model.device), use_cache=False)


@torch.no_grad()
def capture_kv(model, sequences: Iterable[torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE keys and values of every layer, token-major ``[tokens, kv_heads, d]`` float32.

    ``sequences`` are 1-D token id tensors, each run as its own forward pass
    without a KV cache (so the tap sees exactly that sequence's keys).
    """
    keys: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}

    def tap(layer, q, k, v, out):
        keys.setdefault(layer, []).append(k[0].transpose(0, 1).float().cpu())
        values.setdefault(layer, []).append(v[0].transpose(0, 1).float().cpu())

    with tapped(model, tap):
        for ids in sequences:
            run_layers(model, ids)
    return {layer: (torch.cat(keys[layer]), torch.cat(values[layer])) for layer in sorted(keys)}
