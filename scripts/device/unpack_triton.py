"""Unpack the Triton 3.8 carry bundle on the GPU test machine and say how to use it.

    python3 scripts/device/unpack_triton.py out/triton_bundle /tmp/oscar-triton
    source /tmp/oscar-triton.env     # PYTHONPATH first, TRITON_{PTXAS,CUOBJDUMP,NVDISASM}_PATH, OSCAR_TRITON_*

The bundle (``scripts/device/build_triton_bundle.py``) is Triton's package without the CUDA tools it ships;
this names the machine's own (``$CUDA_HOME/bin``, ``PATH``, ``/usr/local/cuda/bin``) through Triton's
environment variables.  A folder unpacked from the same tarball is kept (a rerun on the warm machine).  Then a
fresh Python with that environment must import this Triton, at the bundle's version, and, where CUDA is there,
find a ``ptxas`` that Triton reads a version from and compile, launch and check a small kernel; a failure is
the exit code, with the reason, and then no environment file is written (device_check.sh goes on with the
machine's own Triton).  On the GPU it also tries torch's own compiler (inductor) with this Triton and writes
the answer (``OSCAR_TRITON_INDUCTOR``): device_check.sh runs the servers on the machine's Triton where it fails.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import xz_tarball  # noqa: E402

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
# torch's own compiler (inductor) generates Triton code for the Triton it was built with (3.6 for the machine's
# torch 2.11), and SGLang compiles a few functions with it: whether that works with this Triton decides whether
# the servers run on it (device_check.sh). Its own process and time limit: a failure or a hang is an answer.
INDUCTOR_CHECK = """
import sys, torch
device = sys.argv[1]
fn = torch.compile(lambda a, b: torch.relu(a * b + 1.0), dynamic=True)
a, b = torch.randn(4099, device=device), torch.randn(4099, device=device)
torch.testing.assert_close(fn(a, b), torch.relu(a * b + 1.0))
print("inductor ok")
"""
INDUCTOR_TIMEOUT_S = 90


def inductor_check(env: dict[str, str], device: str = "cuda", timeout_s: float = INDUCTOR_TIMEOUT_S) -> bool | str:
    """True where ``torch.compile`` compiles and runs a small function on ``device`` under ``env``, else why not."""
    # One compile thread (no pool of compile workers to start, or to outlive a failure), and a cache of its own,
    # so that the compiler is what answers: with SGLang imported, TORCHINDUCTOR_CACHE_DIR is SGLang's shared
    # ~/.cache/sglang/inductor, and an entry written there under another ISA made the check crash or answer
    # wrongly (2026-12-06, torch 2.14.1 on an AVX-512 CPU: one run with ATEN_CPU_CAPABILITY=avx2 into a cache,
    # then one without: "double free or corruption (out)", rc -6; the cache's key misses the ISA)
    with tempfile.TemporaryDirectory(prefix="oscar-inductor-check-") as cache:
        try:
            r = subprocess.run([sys.executable, "-c", INDUCTOR_CHECK, device], capture_output=True, text=True,
                               cwd="/", env={**env, "TORCHINDUCTOR_COMPILE_THREADS": "1",
                                             "TORCHINDUCTOR_CACHE_DIR": cache}, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"no answer in {timeout_s:.0f} s"
    if r.returncode == 0 and r.stdout.strip().endswith("inductor ok"):
        return True
    return (r.stderr.strip().splitlines() or ["no output"])[-1][:400]


def cuda_tool(name: str) -> str | None:
    """The machine's ``name`` (a CUDA binary): ``$CUDA_HOME/bin``, then ``PATH``, then ``/usr/local/cuda/bin``."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for path in ([Path(home) / "bin" / name] if home else []) + [shutil.which(name), Path("/usr/local/cuda/bin") / name]:
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def unpack(bundle: Path, dest: Path) -> tuple[dict, bool]:
    """Extract ``bundle/triton.tar.xz`` into ``dest`` unless it already holds it (checked by sha256): the
    manifest, and whether ``dest`` was kept as it was."""
    manifest = json.loads((bundle / "triton_bundle.json").read_text())
    reused = xz_tarball.unpack_checked(bundle / "triton.tar.xz", manifest["sha256"], dest)
    if reused:
        print(f"[triton] reusing {dest} (unpacked from the same tarball)")
    else:
        print(f"[triton] unpacked triton {manifest['triton']} ({manifest['files']} files) into {dest}")
    return manifest, reused


def tool_environment() -> dict[str, str]:
    """Triton's variables naming the machine's CUDA tools (those found)."""
    return {f"TRITON_{name.upper()}_PATH": path for name in TOOLS if (path := cuda_tool(name))}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    bundle, dest = Path(args[0]), Path(args[1])
    env_file = dest.with_name(dest.name + ".env")
    manifest, reused = unpack(bundle, dest)
    checked = f"# checked: {manifest['sha256']} {sys.executable}\n"   # what the checks below passed for
    if reused and env_file.is_file() and env_file.read_text().startswith(checked):
        print(f"[triton] reusing {env_file}: an earlier run on this machine checked the same tarball")
        return 0   # (the warm machine's rerun: the checks, inductor's compile among them, take 10-20 s there)
    env_file.unlink(missing_ok=True)  # an earlier run's: written again below only if every check passes
    tools = tool_environment()
    missing = [t for t in TOOLS if f"TRITON_{t.upper()}_PATH" not in tools]
    if missing:
        print(f"[triton] not found on this machine: {', '.join(missing)} (needed to compile for a GPU)")
    path = str(dest) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    check = dest / ".oscar_triton_check.py"  # a file: triton.jit reads its kernel's source
    check.write_text(CHECK)
    env = {**os.environ, **tools, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, str(check)], env=env, capture_output=True, text=True, cwd="/")
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
    if found.get("launched"):
        found["inductor"] = inductor_check(env)
        print("[triton] torch's compiler (inductor) " + ("compiles and runs with it" if found["inductor"] is True else
              f"fails with it, so the servers will run on the machine's Triton: {found['inductor']}"))
    env_file.write_text(checked + f"export PYTHONPATH={shlex.quote(str(dest))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                        + f"export OSCAR_TRITON_DIR={shlex.quote(str(dest))}\n"
                        + (f"export OSCAR_TRITON_INDUCTOR={int(found['inductor'] is True)}\n" if "inductor" in found
                           else "")
                        + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in tools.items()))
    print(f"[triton] environment: {env_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
