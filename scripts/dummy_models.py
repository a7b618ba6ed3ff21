"""Config-only model folders for SGLang's ``--load-format dummy`` (random weights): capacity and speed, not accuracy.

    python scripts/dummy_models.py --tokenizer DIR --out DIR [--geometry NAME ...] [--hadamard]

Each folder holds a ``config.json`` with a named geometry and the tokenizer
files of ``--tokenizer`` (the default model's: SmolLM2's vocabulary of 49152),
so a server built from it has the memory footprint, KV cache size and speed
of a model of that geometry; its text is noise.  ``--hadamard`` also writes a
Hadamard rotations directory per model (``<out>/<name>-hadamard``), enough to
serve ``--kv-cache-dtype oscar-int2`` for speed: those artifacts are made
where they are used because the 8B geometry's one is 33 MiB.

Used by ``scripts/bench_capacity.py`` and the GPU device scripts
(``scripts/device/``); benchmark support, not part of the served package.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "dtype": "bfloat16",
    "attention_bias": False, "mlp_bias": False,
}

GEOMETRIES = {
    # Llama-3-8B's attention and MLP shapes (32 layers, 32 query / 8 KV heads, head_dim 128), SmolLM2's vocab.
    "llama3-8b": {**_LLAMA_COMMON, "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
                  "max_position_embeddings": 131072, "tie_word_embeddings": False,
                  "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
    # SmolLM2-135M-Instruct's geometry (the default model): 30 layers, 9 query / 3 KV heads, head_dim 64.
    "smollm2-135m": {**_LLAMA_COMMON, "hidden_size": 576, "head_dim": 64, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "num_hidden_layers": 30, "intermediate_size": 1536,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True,
                     "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}},
    # A small head_dim-128 Llama (4 layers, 8 query / 2 KV heads) for quick CPU capacity runs.
    "llama-d128-small": {**_LLAMA_COMMON, "hidden_size": 1024, "head_dim": 128, "num_attention_heads": 8,
                         "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 2816,
                         "max_position_embeddings": 8192, "tie_word_embeddings": True,
                         "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
}


def write_model(name: str, folder: Path, tokenizer_from: Path) -> Path:
    """A config-only folder of geometry ``name`` with the tokenizer files of ``tokenizer_from``."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; known: {', '.join(GEOMETRIES)}")
    if not (Path(tokenizer_from) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_from}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(GEOMETRIES[name], indent=2))
    for file in TOKENIZER_FILES:
        if (Path(tokenizer_from) / file).exists():
            shutil.copy(Path(tokenizer_from) / file, folder / file)
    return folder


def write_hadamard(model: Path, out: Path) -> Path:
    """A validated Hadamard rotations directory for the model folder ``model``."""
    from transformers import AutoConfig

    from oscar_sglang import artifacts

    fp = artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model))
    return artifacts.save(artifacts.hadamard(fp), out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json (and its companions)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--geometry", nargs="+", default=["llama3-8b", "smollm2-135m"], choices=sorted(GEOMETRIES))
    p.add_argument("--hadamard", action="store_true", help="also write <out>/<name>-hadamard rotations")
    args = p.parse_args(argv)
    for name in args.geometry:
        folder = write_model(name, args.out / name, args.tokenizer)
        line = f"{folder}"
        if args.hadamard:
            line += f"  rotations: {write_hadamard(folder, args.out / f'{name}-hadamard')}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
