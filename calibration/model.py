"""Load a transformers causal LM (a model folder, a GGUF file, a model hub id, or the embedded default)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from oscar_sglang import assets

# A model hub repository id, as ``--model-path`` takes it: OWNER/NAME (letters, digits, '-', '_', '.').
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
# What a causal LM needs from its repository: config, weights, tokenizer, chat template (no other framework's
# weights: Llama repositories also hold a consolidated .pth copy).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve(model: str | Path | None) -> Path:
    """A folder, a GGUF file, a name of ``assets.NAMED_MODELS`` (``None`` / ``"default"``: SmolLM2-135M), or a
    model hub id ``OWNER/NAME`` that is not a local path: its snapshot folder, downloaded by ``huggingface_hub``
    into its cache or found there (``HF_HUB_OFFLINE=1``: the cache only)."""
    if model is None:
        return assets.default_model_dir()
    if str(model) in assets.NAMED_MODELS:
        return assets.named_model_dir(str(model))
    path = Path(model)
    if path.exists():
        return path
    if not HUB_ID.fullmatch(str(model)):
        raise FileNotFoundError(f"{path}: no such model folder or GGUF file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo: one sentence, whichever
        raise FileNotFoundError(f"{model}: no such model folder or GGUF file here, and the model hub could not "
                                f"provide it ({type(e).__name__}: {str(e).splitlines()[0]})") from None


DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(name: str = "auto") -> str:
    """``auto``: CUDA when a GPU is visible, else the CPU; ``cuda`` without a GPU is an error."""
    if name not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA device is visible")
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX512-BF16 or AMX-BF16); elsewhere torch emulates it."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str, cpuinfo: str | None = None) -> torch.dtype:
    """``auto``: bf16 on a GPU and on CPUs with native bf16, float32 elsewhere (bf16 is emulated there and
    measured ~4x slower for the same capture on an AVX2-only CPU)."""
    if name == "auto":
        native = device != "cpu" or cpu_has_native_bf16(cpuinfo)
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load(model: str | Path | None = None, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """Returns ``(model, tokenizer, path)`` with the model in eval mode on ``device``.

    On CUDA the weights are placed by accelerate's ``device_map="auto"``, so a
    model larger than one GPU spreads over the visible GPUs (and the CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(model)
    kwargs = {}
    if path.is_file() and path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        path_dir = path.parent
    else:
        path_dir = path
    tokenizer = AutoTokenizer.from_pretrained(path_dir, **kwargs)
    if device == "cuda":
        kwargs["device_map"] = "auto"
    lm = AutoModelForCausalLM.from_pretrained(path_dir, dtype=dtype, **kwargs).eval()
    if device != "cuda":
        lm = lm.to(device)
    return lm, tokenizer, path
