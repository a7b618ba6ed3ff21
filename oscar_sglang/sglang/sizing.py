"""Byte math of the INT2 pool and of its BF16 hot side pool.  Plain Python, no SGLang.

Per token and layer the pool stores, for K and for V, one quantized row per
KV head in the layer's format (``d * bits / 8`` bytes of codes plus fp16
scale and zero per group; INT2 everywhere unless the artifact carries a
precision policy): that is the per-token cell SGLang divides its memory
budget by.

The BF16 hot side pool is a fixed allocation sized by the requests it serves,
not by the token capacity (DESIGN.md invariant 2): ``hot_requests`` sink
windows in the sink region and ``hot_requests`` recent windows in the recent
region, each plus a quarter more (at least one window) for newly admitted
requests and prefill bursts.  Its bytes are taken
off the budget before SGLang divides, so the capacity SGLang reports is what
really fits.  More running requests than ``hot_requests`` still work: once
no free or out-of-window entry is left, the regions hand out in-window entries
least recently used first (those tokens are then read from INT2, and counted;
see ``hot.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


BF16_BYTES = 2
BURST_SHARE = 4  # each region holds hot_requests windows + 1/4 of that (at least one) for bursts


def rows_bytes_per_token(formats, kv_heads: int, head_dim: int) -> int:
    """Rows of K and V in each layer's formats (``artifacts.LayerFormat`` per layer): the cell size of the pool."""
    return sum(kv_heads * (f.k.bytes_per_row(head_dim) + f.v.bytes_per_row(head_dim)) for f in formats)


def hot_bytes_per_entry(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """One BF16 side-pool row of K and V, all layers."""
    return num_layers * 2 * kv_heads * head_dim * BF16_BYTES


def bf16_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """The dense BF16 pool's cost per token, for capacity comparisons."""
    return hot_bytes_per_entry(num_layers, kv_heads, head_dim)


@dataclass(frozen=True)
class HotPlan:
    """Entries of the two regions of the side pool."""

    sink_entries: int
    recent_entries: int

    @property
    def entries(self) -> int:
        return self.sink_entries + self.recent_entries

    def nbytes(self, num_layers: int, kv_heads: int, head_dim: int) -> int:
        return self.entries * hot_bytes_per_entry(num_layers, kv_heads, head_dim)


def hot_plan(hot_requests: int, sink: int, recent: int, max_tokens: int | None = None) -> HotPlan:
    """Side-pool regions for ``hot_requests`` concurrent requests with windows ``sink`` and ``recent``.

    Each region: one window per request plus ``1/BURST_SHARE`` of that (at
    least one window) for newly admitted requests and prefill bursts.  Neither region is larger than ``max_tokens`` (the pool
    cannot hold more live tokens than that).
    """
    if min(hot_requests, sink, recent) < 0:
        raise ValueError("hot requests and windows must be >= 0")
    def with_bursts(window):
        if not (hot_requests and window):
            return 0
        return hot_requests * window + max(window, -(-hot_requests * window // BURST_SHARE))

    sink_entries, recent_entries = with_bursts(sink), with_bursts(recent)
    if max_tokens is not None:
        sink_entries, recent_entries = min(sink_entries, max_tokens), min(recent_entries, max_tokens)
    return HotPlan(sink_entries, recent_entries)


def capacity_tokens(budget_bytes: int, cell_bytes: int, fixed_bytes: int = 0, page_size: int = 1) -> int:
    """Tokens that fit in ``budget_bytes`` after ``fixed_bytes``, rounded down to whole pages (SGLang's rule)."""
    tokens = max(budget_bytes - fixed_bytes, 0) // cell_bytes
    return tokens // page_size * page_size
