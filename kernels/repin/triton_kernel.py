"""Re-pin of the live windows in one launch (the math: ``reference.py``).

Grid ``(rows,)``: a program reads its row's length and last pass; for a row
without a request (most of SGLang's 2048-4096 rows) every other access is
masked off.  Otherwise each of the ``sink + recent`` window
columns loads its slot from ``req_to_token`` and the slot's entry from
``hot_index``, and an ``atomic_max`` raises the entry's stamp to the pass.
One launch instead of the reference's 19 tensor ops over
``rows x (sink + recent)`` elements (1.3 M int64, 10 MiB per tensor, at 4096
rows, sink 64, recent 256: on the order of 200 MiB of traffic per pass).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _repin_kernel(stamp_ptr, hot_index_ptr, req_len_ptr, req_pass_ptr, req_to_token_ptr, stride_row, width,
                  SINK: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(req_len_ptr + row)
    last = tl.load(req_pass_ptr + row)
    col = tl.arange(0, BLOCK)
    pos = tl.where(col >= SINK, col + tl.maximum(length - W, 0), col)
    live = (col < W) & (pos < length) & (pos < width)     # none where the row has no request (length 0)
    slot = tl.load(req_to_token_ptr + row * stride_row + pos, mask=live, other=0)
    entry = tl.load(hot_index_ptr + slot.to(tl.int64), mask=live, other=-1)
    hit = live & (entry >= 0)
    tl.atomic_max(stamp_ptr + entry.to(tl.int64), last, mask=hit)


def repin_windows(stamp: torch.Tensor, hot_index: torch.Tensor, req_len: torch.Tensor, req_pass: torch.Tensor,
                  req_to_token: torch.Tensor, sink: int, recent: int, spread: torch.Tensor | None = None) -> None:
    """As ``reference.repin_windows`` (``spread`` unused: no-op updates are not issued here)."""
    w = sink + recent
    rows, width = req_to_token.shape
    if w == 0 or rows == 0 or width == 0:
        return
    for name, t, dtype in (("stamp", stamp, torch.int64), ("hot_index", hot_index, torch.int32),
                           ("req_len", req_len, torch.int64), ("req_pass", req_pass, torch.int64),
                           ("req_to_token", req_to_token, torch.int32)):
        if t.dtype != dtype:
            raise TypeError(f"repin_windows: {name} must be {dtype}, got {t.dtype}")
    if req_to_token.stride(1) != 1 or not (req_len.is_contiguous() and req_pass.is_contiguous()):
        raise ValueError("repin_windows: req_to_token rows, req_len and req_pass must be contiguous")
    if req_len.shape[0] != rows or req_pass.shape[0] != rows:
        raise ValueError(f"repin_windows: {rows} rows of req_to_token but req_len/req_pass have "
                         f"{req_len.shape[0]}/{req_pass.shape[0]}")
    _repin_kernel[(rows,)](stamp, hot_index, req_len, req_pass, req_to_token, req_to_token.stride(0), width,
                           SINK=sink, W=w, BLOCK=triton.next_power_of_2(w), num_warps=4,
                           enable_fp_fusion=True)
