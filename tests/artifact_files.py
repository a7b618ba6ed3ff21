"""Test helper: rewrite a rotations directory's tensors as a crafted artifact would, its manifest's
``tensors_sha256`` recorded again, so that a test reaches the check it is about (shapes, orthogonality, ...)
rather than the digest's."""

import hashlib
import json
from pathlib import Path

from safetensors.torch import save_file

from oscar_sglang import artifacts as art


def rewrite_tensors(d: Path, tensors: dict) -> None:
    path = Path(d) / art.TENSORS
    save_file(tensors, str(path))
    manifest_path = Path(d) / art.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["tensors_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
