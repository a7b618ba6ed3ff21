"""Unpack the Triton 3.8 carry bundle on the GPU test machine and say how to use it.

    python3 scripts/device/unpack_triton.py out/triton_bundle /tmp/oscar-triton
    source /tmp/oscar-triton.env     # PYTHONPATH first, TRITON_{PTXAS,CUOBJDUMP,NVDISASM}_PATH

The bundle (``scripts/device/build_triton_bundle.py``) is Triton's package without the CUDA tools it ships;
this names the machine's own (``$CUDA_HOME/bin``, ``PATH``, ``/usr/local/cuda/bin``) through Triton's
environment variables.  A folder unpacked from the same tarball is kept (a rerun on the warm machine).  Then a
fresh Python with that environment must import this Triton, at the bundle's version, and, where CUDA is there,
find a ``ptxas`` that Triton reads a version from and compile, launch and check a small kernel; a failure is
the exit code, with the reason, and then no environment file is written (device_check.sh goes on with the
machine's own Triton).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

TOOLS = ("ptxas", "cuobjdump", "nvdisasm")
CHECK = """
import json, os, sys, triton
out = {"version": triton.__version__, "file": triton.__file__}
try:
    import torch
    cuda = torch.cuda.is_available()
except Exception:
    cuda = False
if os.environ.get("TRITON_PTXAS_PATH") or cuda:
    from triton import knobs
    tool = knobs.nvidia.ptxas  # the machine's, named by TRITON_PTXAS_PATH; the wheel's own is not in the bundle
    out["ptxas"] = {"path": tool.path, "cuda": tool.version}
if cuda:  # compiled, launched and right on the GPU: the path every kernel step takes
    import triton.language as tl

    @triton.jit
    def _plus_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    _plus_one[(8,)](x, 1000, BLOCK=128)
    assert torch.equal(x.cpu(), torch.arange(1, 1001, dtype=torch.float32)), "a launched kernel's result is wrong"
    out["launched"] = True
print(json.dumps(out))
"""


def cuda_tool(name: str) -> str | None:
    """The machine's ``name`` (a CUDA binary): ``$CUDA_HOME/bin``, then ``PATH``, then ``/usr/local/cuda/bin``."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for path in ([Path(home) / "bin" / name] if home else []) + [shutil.which(name), Path("/usr/local/cuda/bin") / name]:
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def unpack(bundle: Path, dest: Path) -> dict:
    """Extract ``bundle/triton.tar.xz`` into ``dest`` unless it already holds it (checked by sha256)."""
    manifest = json.loads((bundle / "triton_bundle.json").read_text())
    tarball = bundle / "triton.tar.xz"
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != manifest["sha256"]:
        raise SystemExit(f"{tarball}: sha256 {digest} is not the manifest's {manifest['sha256']}")
    stamp = dest / ".oscar-triton-stamp"
    if stamp.is_file() and stamp.read_text() == digest:
        print(f"[triton] reusing {dest} (unpacked from the same tarball)")
        return manifest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(tarball, "r:xz") as tar:
        tar.extractall(dest, filter="data")  # no links or paths out of dest (Python >= 3.11.4, 3.12)
    stamp.write_text(digest)
    print(f"[triton] unpacked triton {manifest['triton']} ({manifest['files']} files) into {dest}")
    return manifest


def tool_environment() -> dict[str, str]:
    """Triton's variables naming the machine's CUDA tools (those found)."""
    return {f"TRITON_{name.upper()}_PATH": path for name in TOOLS if (path := cuda_tool(name))}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    bundle, dest = Path(args[0]), Path(args[1])
    manifest = unpack(bundle, dest)
    tools = tool_environment()
    missing = [t for t in TOOLS if f"TRITON_{t.upper()}_PATH" not in tools]
    if missing:
        print(f"[triton] not found on this machine: {', '.join(missing)} (needed to compile for a GPU)")
    path = str(dest) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    check = dest / ".oscar_triton_check.py"  # a file: triton.jit reads its kernel's source
    check.write_text(CHECK)
    r = subprocess.run([sys.executable, str(check)], env={**os.environ, **tools, "PYTHONPATH": path},
                       capture_output=True, text=True, cwd="/")
    if r.returncode != 0:
        print(f"[triton] the unpacked Triton does not load:\n{r.stderr[-2000:]}", file=sys.stderr)
        return 1
    found = json.loads(r.stdout.strip().splitlines()[-1])
    if found["version"] != manifest["triton"] or not found["file"].startswith(str(dest)):
        print(f"[triton] a fresh Python imports triton {found['version']} from {found['file']}, not the bundle's "
              f"{manifest['triton']} from {dest}", file=sys.stderr)
        return 1
    print(f"[triton] triton {found['version']} from {found['file']}"
          + (f"; ptxas {found['ptxas']['path']} (CUDA {found['ptxas']['cuda']})" if "ptxas" in found else "")
          + ("; a kernel compiled, launched and checked on the GPU" if found.get("launched") else ""))
    env_file = dest.with_name(dest.name + ".env")
    env_file.write_text(f"export PYTHONPATH={shlex.quote(str(dest))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                        + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in tools.items()))
    print(f"[triton] environment: {env_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
