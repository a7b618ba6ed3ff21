"""Load a transformers causal LM (a model folder, a GGUF file, or the embedded default)."""

from __future__ import annotations

from pathlib import Path

import torch

from oscar_sglang import assets


def resolve(model: str | Path | None) -> Path:
    """``None`` or ``"default"`` means the embedded SmolLM2-135M folder (built on first use)."""
    if model is None or str(model) == "default":
        return assets.default_model_dir()
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model folder or GGUF file")
    return path


def load(model: str | Path | None = None, dtype: torch.dtype = torch.bfloat16):
    """Returns ``(model, tokenizer, path)`` with the model in eval mode on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(model)
    kwargs = {}
    if path.is_file() and path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        path_dir = path.parent
    else:
        path_dir = path
    tokenizer = AutoTokenizer.from_pretrained(path_dir, **kwargs)
    lm = AutoModelForCausalLM.from_pretrained(path_dir, dtype=dtype, **kwargs).eval()
    return lm, tokenizer, path
