"""Per-layer checkpoints of a calibration, so that an interrupted ``oscar-calibrate`` resumes where it stopped.

The fit (OptR above all) and the precision policy's measure work layer by layer, each layer from its own
statistics and its own seed, so a layer's result does not depend on the layers before it.  Each finished layer is
written to ``DIR/STAGE-LAYER.safetensors`` (its tensors) and ``.json`` (its report row), and a run with the same
inputs (:func:`run_key`: the configuration, the model, the token ids) reads them back instead of computing them
again: the same artifact, bit for bit, as an uninterrupted run on the same machine.  A run with other inputs
empties the folder first; ``oscar-calibrate`` removes it once the rotations are saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

KEY = "key.json"


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_key(cfg, model, sequences, extra: dict | None = None) -> dict:
    """What a calibration's per-layer results depend on: ``cfg`` (a dataclass), the model (its config and the
    first and last layers' output projections, a cheap check that the weights are the same), the token ids of
    ``sequences`` (lists of 1-D tensors, or None), and ``extra`` (JSON-able)."""
    from .calibrate import attention_modules

    mods = attention_modules(model)
    weights = [mods[0].o_proj.weight, mods[-1].o_proj.weight] if mods else []
    return {
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
        "model": json.loads(model.config.to_json_string()),
        "weights": _digest(weights),
        "dtype": str(next(model.parameters()).dtype),
        "tokens": [None if s is None else _digest(list(s)) for s in sequences],
        **(extra or {}),
    }


class LayerCheckpoint:
    """Finished layers of each stage in ``directory``, valid for the run ``key`` (:func:`run_key`)."""

    def __init__(self, directory: str | os.PathLike, key: dict):
        self.directory = Path(directory)
        self.key = json.loads(json.dumps(key))
        self.resumed: dict[str, int] = {}   # stage -> layers read back
        key_path = self.directory / KEY
        try:
            same = json.loads(key_path.read_text()) == self.key
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory.mkdir(parents=True)
            key_path.write_text(json.dumps(self.key))

    def _paths(self, stage: str, layer: int) -> tuple[Path, Path]:
        base = self.directory / f"{stage}-{layer}"
        return base.with_suffix(".safetensors"), base.with_suffix(".json")

    def get(self, stage: str, layer: int) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The layer's tensors and row, or None if not finished (or unreadable: then it is computed again)."""
        from safetensors.torch import load_file

        tensors_path, row_path = self._paths(stage, layer)
        try:
            row = json.loads(row_path.read_text())
            tensors = load_file(str(tensors_path))
        except Exception:  # noqa: BLE001 - a half-written or damaged entry is recomputed, never trusted
            return None
        self.resumed[stage] = self.resumed.get(stage, 0) + 1
        return tensors, row

    def put(self, stage: str, layer: int, tensors: dict[str, torch.Tensor], row: dict) -> None:
        """Record a finished layer: the tensors first, then the row (written last, it marks the entry whole)."""
        from safetensors.torch import save_file

        tensors_path, row_path = self._paths(stage, layer)
        tmp = tensors_path.with_suffix(".tmp")
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, tensors_path)
        tmp = row_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row))
        os.replace(tmp, row_path)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
