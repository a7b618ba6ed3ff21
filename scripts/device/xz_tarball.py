"""Solid xz tarballs of what travels to the GPU test machine, and their checked unpacking there.

Both carry bundles (``build_bundle.py``: SGLang's wheels, the tokenizer, the prompts; ``build_triton_bundle.py``:
Triton 3.8) travel as one solid xz tarball each, because the device tool's carry limit (64 MiB with the source
tree) holds the two together only that way.  Written with xz's strongest preset (``9e``), and for machine code
with its x86 branch filter in front (it turns relative call targets into absolute ones, which repeat), unpacked
with the standard library alone (the machine's Python 3.12), checked against the sha256 its manifest names, and
kept where an earlier run unpacked the same tarball (a rerun on the warm machine).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import lzma
import shutil
import tarfile
from pathlib import Path

STAMP = ".oscar-unpack-stamp"


def filters(machine_code: bool) -> list[dict]:
    lzma2 = {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}
    return ([{"id": lzma.FILTER_X86}] if machine_code else []) + [lzma2]


@contextlib.contextmanager
def writer(path: Path, machine_code: bool = False):
    """A ``tarfile.TarFile`` that writes ``path`` as one solid xz stream (see :func:`add`)."""
    with lzma.open(path, "wb", format=lzma.FORMAT_XZ, filters=filters(machine_code)) as xz, \
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        yield tar


def add(tar: tarfile.TarFile, name: str, data: bytes, executable: bool = False) -> None:
    """``data`` as the regular file ``name``; no owner, no time: the same inputs give the same tarball."""
    entry = tarfile.TarInfo(name)
    entry.size = len(data)
    entry.mode = 0o755 if executable else 0o644
    tar.addfile(entry, io.BytesIO(data))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpack_checked(tarball: Path, expected_sha256: str, dest: Path) -> bool:
    """Extract ``tarball`` into ``dest`` (emptied first) unless ``dest`` holds it already; True if kept as it was.

    Refuses (SystemExit) a tarball whose sha256 is not ``expected_sha256``, what its manifest says it is."""
    digest = sha256(tarball)
    if digest != expected_sha256:
        raise SystemExit(f"{tarball}: sha256 {digest} is not the manifest's {expected_sha256}")
    stamp = dest / STAMP
    if stamp.is_file() and stamp.read_text() == digest:
        return True
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(tarball, "r:xz") as tar:
        tar.extractall(dest, filter="data")  # no links or paths out of dest (Python >= 3.11.4, 3.12)
    stamp.write_text(digest)
    return False
