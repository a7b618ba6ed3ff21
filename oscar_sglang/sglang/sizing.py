"""Byte math of the INT2 pool: the per-token cost SGLang sizes the pool with, and the hot pool's rows.

Per token and layer the pool stores, for K and for V, one INT2 row per KV
head (``d / 4`` bytes of codes plus fp16 scale and zero per group).  The BF16
hot side pool holds ``ceil(hot_fraction * tokens)`` rows (at least one
sink + recent window), each ``2 * kv_heads * d`` bf16 values per layer; its
cost is charged per token at ``hot_fraction``, so the capacity SGLang derives
from a memory budget covers both.  Plain Python, no SGLang.
"""

from __future__ import annotations

import math

from oscar_sglang import format as fmt

BF16_BYTES = 2


def int2_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, group_size: int) -> int:
    """INT2 rows (codes, scale, zero) of K and V, all layers."""
    return num_layers * 2 * kv_heads * fmt.bytes_per_row(head_dim, group_size)


def hot_bytes_per_entry(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """One BF16 side-pool row of K and V, all layers."""
    return num_layers * 2 * kv_heads * head_dim * BF16_BYTES


def cell_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, group_size: int,
                         hot_fraction: float) -> int:
    """What one token of capacity costs: INT2 rows plus its share of the hot side pool."""
    hot = hot_fraction * hot_bytes_per_entry(num_layers, kv_heads, head_dim)
    return int2_bytes_per_token(num_layers, kv_heads, head_dim, group_size) + math.ceil(hot)


def hot_entries(tokens: int, sink: int, recent: int, hot_fraction: float) -> tuple[int, int]:
    """``(sink_entries, recent_entries)`` of the side pool for a pool of ``tokens`` slots.

    Total ``max(sink + recent, ceil(hot_fraction * tokens))`` (no more than
    ``tokens``), split in proportion ``sink : recent`` with every non-empty
    window getting at least its own size.
    """
    window = sink + recent
    if window == 0:
        return 0, 0
    total = min(max(window, math.ceil(hot_fraction * tokens)), max(tokens, window))
    sink_entries = max(sink, round(total * sink / window)) if sink else 0
    return sink_entries, max(total - sink_entries, recent)


def bf16_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """The dense BF16 pool's cost, for the capacity comparison in the startup log."""
    return hot_bytes_per_entry(num_layers, kv_heads, head_dim)
