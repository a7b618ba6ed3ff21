"""Synthetic pools for the kernel tests and the benchmark: rotations, paged slots, hot entries.

Slots are handed out in pages of ``page_size`` consecutive slots, pages in
random order (as SGLang's paged allocator may), slot 0 left unused (SGLang's
padding slot).  Hot entries follow the serving policy: the first ``sink``
and last ``recent`` tokens of every request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_sglang import windows

from .layout import DeviceRotation, LayerStore


def random_rotation(kv_heads: int, head_dim: int, seed: int = 0, identity: bool = False,
                    device: torch.device | str = "cpu", key_scale: bool = False) -> DeviceRotation:
    """Random orthogonal ``R_K``, ``R_V`` (or identities), a key mean and clip ratios in [0.85, 1].

    ``key_scale``: per-channel key scales ``s`` (log-normal, spread ~e^±1) folded in
    as the pool does (write matrix ``R_K diag(s)``, query matrix ``R_K diag(1/s)``).
    """
    g = torch.Generator().manual_seed(seed)
    h, d = kv_heads, head_dim

    def orth():
        if identity:
            return torch.eye(d).expand(h, d, d).contiguous()
        return torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()

    k_rot, v_rot = orth(), orth()
    mean = torch.randn(h, d, generator=g) + 2.0  # an offset, like a QKV bias
    k_clip = 0.85 + 0.15 * torch.rand(h, generator=g)
    v_clip = 0.85 + 0.15 * torch.rand(h, generator=g)
    k_clip[0] = 1.0  # one unclipped head
    q_rot = k_rot
    if key_scale:
        s = torch.exp(0.6 * torch.randn(h, 1, d, generator=g))
        k_rot, q_rot = k_rot * s, k_rot / s
    return DeviceRotation(*(t.contiguous().to(device) for t in (k_rot, v_rot, mean, k_clip, v_clip, q_rot)))


@dataclass
class Paged:
    """Token -> slot tables in SGLang's convention."""

    req_to_token: torch.Tensor  # int32 [max_reqs, max_context]
    req_pool_indices: torch.Tensor  # int64 [batch]
    seq_lens: torch.Tensor  # int64 [batch]
    num_slots: int

    def slots(self, b: int) -> torch.Tensor:
        """Slots of request ``b``'s tokens, in order (int64)."""
        return self.req_to_token[self.req_pool_indices[b], : self.seq_lens[b]].long()


def paged_layout(lens: list[int], page_size: int, seed: int = 0, spare_pages: int = 3,
                 device: torch.device | str = "cpu") -> Paged:
    """Requests of ``lens`` tokens on random pages of ``page_size`` consecutive slots."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages) + spare_pages
    order = torch.randperm(total, generator=g) + 1  # page 0 holds the padding slot
    max_context = max([1, *lens]) + page_size
    reqs = len(lens) + 2
    table = torch.zeros(reqs, max_context, dtype=torch.int32)
    rows = torch.randperm(reqs, generator=g)[: len(lens)]
    used = 0
    for b, n in enumerate(lens):
        mine = order[used: used + pages[b]]
        used += pages[b]
        slots = (mine[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        table[rows[b], :n] = slots.to(torch.int32)
    return Paged(table.to(device), rows.long().to(device), torch.tensor(lens, dtype=torch.int64, device=device),
                 (total + 1) * page_size)


def hot_positions(n: int, sink: int, recent: int) -> torch.Tensor:
    """Bool ``[n]``: the first ``sink`` and last ``recent`` positions of a sequence of ``n`` tokens."""
    pos = torch.arange(n)
    return windows.in_window(pos, n, sink, recent)


def assign_hot(store: LayerStore, paged: Paged, sink: int, recent: int) -> torch.Tensor:
    """Hot entry of each slot (``-1`` = cold) for the serving policy; sets ``store.hot_index`` and returns it."""
    hot_index = torch.full((store.num_slots,), -1, dtype=torch.int32, device=store.hot_index.device)
    nxt = 0
    for b in range(len(paged.seq_lens)):
        slots = paged.slots(b)
        mine = slots[hot_positions(len(slots), sink, recent).to(slots.device)]
        hot_index[mine] = torch.arange(nxt, nxt + len(mine), dtype=torch.int32, device=slots.device)
        nxt += len(mine)
    if nxt > store.k_hot.shape[0]:
        raise ValueError(f"{nxt} hot entries needed, the side pool has {store.k_hot.shape[0]}")
    store.hot_index.copy_(hot_index)
    return hot_index


def random_kv(n: int, kv_heads: int, head_dim: int, seed: int = 0, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with an offset and uneven channel ranges (outlier channels), values milder; ``[n, kv_heads, d]``."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.3, 3.0, head_dim)
    k = torch.randn(n, kv_heads, head_dim, generator=g) * spread + 1.5
    v = torch.randn(n, kv_heads, head_dim, generator=g)
    return k.to(device, dtype), v.to(device, dtype)


def capture_graph(record, pool=None):
    """``record()`` captured in a CUDA graph as SGLang's graph runner does: two warm-up calls on a side stream
    (they compile the kernels and settle the allocator), then the recording; returns ``(graph, its outputs)``.

    ``pool``: a graph memory pool shared with other graphs (``torch.cuda.graph_pool_handle()``).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        record(), record()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = record()
    return graph, outputs
