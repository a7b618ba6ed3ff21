"""Turn text into fixed-length token sequences for calibration and evaluation."""

from __future__ import annotations

import torch


def token_sequences(tokenizer, text: str, seq_len: int, max_tokens: int, skip_tokens: int = 0) -> list[torch.Tensor]:
    """Consecutive non-overlapping sequences of ``seq_len`` tokens from ``text``.

    Skips the first ``skip_tokens`` tokens (title pages, cast lists) and stops
    after ``max_tokens``.  Raises if the text is too short for one sequence.
    """
    if seq_len <= 0 or max_tokens < seq_len:
        raise ValueError(f"need 0 < seq_len <= max_tokens, got seq_len={seq_len}, max_tokens={max_tokens}")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    ids = ids[skip_tokens: skip_tokens + max_tokens]
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"text has {ids.numel()} usable tokens after skipping {skip_tokens}: "
                         f"too short for one sequence of {seq_len}")
    return list(ids[: n * seq_len].reshape(n, seq_len))
