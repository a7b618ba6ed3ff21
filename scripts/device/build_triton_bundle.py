"""Build a carry bundle of Triton 3.8 for the GPU test machine, whose own Triton is 3.6.

    bash scripts/device/build_triton_bundle.sh     # -> out/triton_bundle/ (ignored by git), size printed

Why: a user's SGLang 0.5.23 installs torch 2.14.1 and with it Triton 3.8, while the lent machine has torch
2.11 and Triton 3.6, and the two compile the INT2 decode very differently (docs/KERNELS.md, "What the decode
loop issues": the default loop 1797 instructions per block with 3.6, 959 with 3.8).  So the kernels' GPU
numbers so far are those of a compiler users do not get.  The Triton 3.8 wheel is 236.5 MiB (cp312), over the
device tool's 64 MiB carry limit; what the kernels need of it is much less:

* ``triton/_C/libtriton.so`` without its debug information (``strip --strip-unneeded``: 482 -> 183 MiB);
* not the CUDA tools it bundles (``backends/nvidia/bin``: ``ptxas``, ``cuobjdump``, ``nvdisasm``, 85 MB):
  the machine has CUDA 13.0's, which ``scripts/device/unpack_triton.py`` names through Triton's
  ``TRITON_PTXAS_PATH`` and the like (so the device compiles with ptxas 13.0, where this machine's counts
  used the wheel's 12.9);
* not the profiler's and the tests' libraries (CUPTI, proton, the instrumentation and plugin test libraries).

The rest goes into one ``triton.tar.xz`` (solid xz at ``9e`` behind xz's x86 filter: ~37 MiB, 2-3 min), with
``triton_bundle.json`` (version, what was left out, sizes, sha256).  It travels with ``out/device_bundle`` (the
two and the source tree fit the 64 MiB, which the builders check), so the servers run on it as well.
Downloads are cached in ``out/device_bundle_cache/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import xz_tarball  # noqa: E402
from build_bundle import ROOT, check_size, download  # noqa: E402

TRITON = "triton==3.8.0"
# Left out of the package (paths inside the wheel): the bundled CUDA tools, the profilers' libraries, test libraries
DROP = re.compile(r"^triton/(backends/nvidia/bin/|backends/nvidia/lib/cupti|_C/libproton\.so|instrumentation/.*\.so"
                  r"|plugins/.*\.so|profiler/)")
STRIP = "triton/_C/libtriton.so"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "out" / "triton_bundle")
    p.add_argument("--cache", type=Path, default=ROOT / "out" / "device_bundle_cache")
    return p.parse_args(argv)


def stripped(data: bytes) -> bytes:
    """``data`` (an ELF shared library) through ``strip --strip-unneeded``."""
    strip = shutil.which("strip")
    if strip is None:
        raise SystemExit("`strip` (binutils) is needed to drop libtriton.so's debug information")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lib.so"
        path.write_bytes(data)
        subprocess.run([strip, "--strip-unneeded", str(path)], check=True)
        return path.read_bytes()


def slim_tarball(wheel: Path, out: Path) -> dict:
    """The wheel's files less :data:`DROP`, ``libtriton.so`` stripped, as ``out`` (tar, xz): what was left out."""
    left_out, kept = {}, 0
    with zipfile.ZipFile(wheel) as src, xz_tarball.writer(out, machine_code=True) as tar:
        for info in src.infolist():
            if info.is_dir():
                continue
            if DROP.search(info.filename):
                left_out[info.filename] = info.file_size
                continue
            data = src.read(info)
            if info.filename == STRIP:
                size = len(data)
                data = stripped(data)
                print(f"[triton] {STRIP}: {size / 2**20:.0f} MiB -> {len(data) / 2**20:.0f} MiB stripped", flush=True)
            xz_tarball.add(tar, info.filename, data, executable=bool((info.external_attr >> 16) & 0o111))
            kept += 1
    return {"files": kept, "left_out": left_out}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    print(f"[triton] downloading {TRITON} (cp312; cached in {args.cache})", flush=True)
    (wheel,) = download([TRITON], args.cache / "triton")
    tarball = args.out / "triton.tar.xz"
    slim = slim_tarball(wheel, tarball)
    manifest = {"date": datetime.date.today().isoformat(), "triton": TRITON.split("==")[1], "wheel": wheel.name,
                "wheel_bytes": wheel.stat().st_size, "files": slim["files"],
                "left_out": slim["left_out"], "tarball_bytes": tarball.stat().st_size,
                "sha256": xz_tarball.sha256(tarball)}
    (args.out / "triton_bundle.json").write_text(json.dumps(manifest, indent=1))
    return check_size("triton", f"{args.out}: {wheel.name} {wheel.stat().st_size / 2**20:.1f} MiB -> triton.tar.xz "
                                f"{tarball.stat().st_size / 2**20:.1f} MiB ({slim['files']} files; left out "
                                f"{sum(slim['left_out'].values()) / 2**20:.0f} MiB unpacked)",
                      sum(p.stat().st_size for p in args.out.iterdir()), ROOT / "out" / "device_bundle")


if __name__ == "__main__":
    raise SystemExit(main())
