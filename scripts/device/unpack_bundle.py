"""Unpack the SGLang carry bundle (``scripts/device/build_bundle.py``) into a folder the device script reads.

    python3 scripts/device/unpack_bundle.py out/device_bundle /tmp/oscar-bundle

The bundle travels as one solid xz tarball (``bundle.tar.xz``) with its manifest (``bundle.json``), so that it
and the Triton 3.8 bundle fit one call; unpacked, the folder holds what ``install_bundle.sh`` and
``device_check.sh`` read: ``wheels/``, ``tokenizer/``, ``sharegpt_shakespeare.json`` and ``bundle.json``.  The
tarball is checked against the manifest's sha256 and every unpacked file against its own; a folder unpacked
from the same tarball is kept (a rerun on the warm machine).  Standard library only (the machine's Python).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import xz_tarball  # noqa: E402


def unpack(bundle: Path, dest: Path) -> dict:
    """``bundle``'s tarball into ``dest`` (see the module's text); its manifest. SystemExit on a mismatch."""
    manifest = json.loads((bundle / "bundle.json").read_text())
    reused = xz_tarball.unpack_checked(bundle / manifest["tarball"], manifest["sha256"], dest)
    found = {p.relative_to(dest).as_posix() for p in dest.rglob("*")
             if p.is_file() and p.name not in (xz_tarball.STAMP, "bundle.json")}
    if found != set(manifest["files"]):
        raise SystemExit(f"{dest}: files {sorted(found ^ set(manifest['files']))[:5]} differ from the manifest's")
    for name, entry in manifest["files"].items():
        if xz_tarball.sha256(dest / name) != entry["sha256"]:
            raise SystemExit(f"{dest / name}: not the file the manifest names (sha256)")
    shutil.copy(bundle / "bundle.json", dest / "bundle.json")
    size = sum(e["bytes"] for e in manifest["files"].values()) / 2**20
    print(f"[bundle] {'reusing' if reused else 'unpacked'} {dest}: {len(manifest['files'])} files, {size:.1f} MiB, "
          f"from {bundle / manifest['tarball']} (sha256 checked)")
    return manifest


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    unpack(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
