"""The Triton 3.8 carry bundle (scripts/device/build_triton_bundle.py) and its unpacking on the GPU machine
(scripts/device/unpack_triton.py), on stand-in wheels: what is left out, what is kept byte for byte, and what
the unpacking checks before it hands the environment to device_check.sh.

The real wheel (~190 MB download) and a Python 3.12 that imports it are exercised by
``TRITON_BUNDLE=out/triton_bundle bash scripts/device/dry_run.sh``, not here: CI must not need them.
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

from script_modules import SCRIPTS, load_script

build = load_script("device/build_triton_bundle.py")
unpack = load_script("device/unpack_triton.py")

WHEEL_FILES = {
    "triton/__init__.py": b'__version__ = "3.8.0"\n',
    "triton/knobs.py": b"x = 1\n",
    "triton/_C/libtriton.so": b"\x7fELF" + b"debug" * 50,
    "triton/_C/libproton.so": b"\x7fELF proton",
    "triton/backends/nvidia/bin/ptxas": b"\x7fELF ptxas",
    "triton/backends/nvidia/bin/cuobjdump": b"\x7fELF cuobjdump",
    "triton/backends/nvidia/lib/cupti/libcupti.so.13": b"\x7fELF cupti",
    "triton/backends/nvidia/lib/libdevice.10.bc": b"BC libdevice",
    "triton/backends/nvidia/include/cuda.h": b"/* cuda.h */",
    "triton/backends/nvidia/driver.c": b"int main;",
    "triton/instrumentation/libGPUInstrumentationTestLib.so": b"\x7fELF test",
    "triton/plugins/libTritonPluginsTestLib.so": b"\x7fELF test",
    "triton/profiler/__init__.py": b"import libproton\n",
    "triton-3.8.0.dist-info/METADATA": b"Name: triton\nVersion: 3.8.0\n",
}
KEPT = {"triton/__init__.py", "triton/knobs.py", "triton/_C/libtriton.so", "triton/backends/nvidia/lib/libdevice.10.bc",
        "triton/backends/nvidia/include/cuda.h", "triton/backends/nvidia/driver.c", "triton-3.8.0.dist-info/METADATA"}


def _wheel(tmp_path):
    path = tmp_path / "triton-3.8.0-cp312-cp312-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in WHEEL_FILES.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name.endswith((".so", "ptxas", "cuobjdump")) else 0o644) << 16
            z.writestr(info, data)
    return path


def test_the_slim_tarball_keeps_what_kernels_need_and_strips_libtriton(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "stripped", lambda data: data.replace(b"debug", b""))  # strip(1) stands in
    out = tmp_path / "triton.tar.xz"
    slim = build.slim_tarball(_wheel(tmp_path), out)
    assert set(slim["left_out"]) == set(WHEEL_FILES) - KEPT and slim["files"] == len(KEPT)
    assert slim["left_out"]["triton/backends/nvidia/bin/ptxas"] == len(WHEEL_FILES["triton/backends/nvidia/bin/ptxas"])
    with tarfile.open(out, "r:xz") as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == KEPT
        for name in KEPT - {"triton/_C/libtriton.so"}:
            assert tar.extractfile(name).read() == WHEEL_FILES[name]
        assert tar.extractfile("triton/_C/libtriton.so").read() == b"\x7fELF"   # the stripped copy
        assert members["triton/_C/libtriton.so"].mode == 0o755 and members["triton/knobs.py"].mode == 0o644


def _bundle(tmp_path, version="3.8.0", knobs=True):
    """A bundle whose 'triton' is a stand-in package of ``version``, with a ``knobs.nvidia.ptxas`` that reports
    the TRITON_PTXAS_PATH it was given (as Triton's does)."""
    files = {"triton/__init__.py": f'__version__ = "{version}"\n'.encode()}
    if knobs:
        files["triton/knobs.py"] = (b"import os, types\n"
                                    b"nvidia = types.SimpleNamespace(ptxas=types.SimpleNamespace("
                                    b"path=os.environ['TRITON_PTXAS_PATH'], version='13.0'))\n")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    tarball = bundle / "triton.tar.xz"
    with tarfile.open(tarball, "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (bundle / "triton_bundle.json").write_text(json.dumps(
        {"triton": "3.8.0", "files": len(files), "sha256": hashlib.sha256(tarball.read_bytes()).hexdigest()}))
    return bundle


def _run(bundle, dest, tmp_path, ptxas=True):
    tools = tmp_path / "cuda" / "bin"
    tools.mkdir(parents=True, exist_ok=True)
    if ptxas:
        (tools / "ptxas").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
        (tools / "ptxas").chmod(0o755)
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "cuda"), "PATH": "/usr/bin:/bin"}
    env.pop("PYTHONPATH", None)
    env.pop("TRITON_PTXAS_PATH", None)
    return subprocess.run([sys.executable, str(SCRIPTS / "device" / "unpack_triton.py"), str(bundle), str(dest)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_unpacking_names_the_machine_s_ptxas_and_is_reused(tmp_path):
    bundle, dest = _bundle(tmp_path), tmp_path / "oscar-triton"
    r = _run(bundle, dest, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"triton 3.8.0 from {dest}/triton/__init__.py; ptxas {tmp_path}/cuda/bin/ptxas (CUDA 13.0)" in r.stdout
    env_file = tmp_path / "oscar-triton.env"
    lines = env_file.read_text().splitlines()
    assert lines[1] == f"export PYTHONPATH={dest}${{PYTHONPATH:+:$PYTHONPATH}}"   # first on the path, the rest kept
    assert f"export TRITON_PTXAS_PATH={tmp_path}/cuda/bin/ptxas" in lines
    assert f"export OSCAR_TRITON_DIR={dest}" in lines                          # what the servers' fallback drops
    assert not any("OSCAR_TRITON_INDUCTOR" in ln for ln in lines)            # tried only where CUDA is
    sourced = subprocess.run(["bash", "-c", f"PYTHONPATH=/elsewhere; source {env_file}; echo $PYTHONPATH"],
                             capture_output=True, text=True).stdout.strip()
    assert sourced == f"{dest}:/elsewhere"
    r = _run(bundle, dest, tmp_path)   # the warm machine's rerun: the same tarball is not unpacked again,
    assert r.returncode == 0 and f"reusing {dest}" in r.stdout   # nor checked again
    assert f"reusing {env_file}" in r.stdout and "; ptxas" not in r.stdout and env_file.read_text() == "\n".join(lines) + "\n"
    env_file.write_text(env_file.read_text().replace(lines[0], "# checked: another tarball"))
    r = _run(bundle, dest, tmp_path)   # an environment file the checks did not write for this tarball: checked again
    assert r.returncode == 0 and "; ptxas" in r.stdout and env_file.read_text().splitlines() == lines


def test_unpacking_refuses_another_version_a_changed_tarball_and_says_what_is_missing(tmp_path):
    for case in "abc":
        (tmp_path / case).mkdir()
    (tmp_path / "a" / "t.env").write_text("export PYTHONPATH=/an/earlier/run\n")   # a warm machine's
    r = _run(_bundle(tmp_path / "a", version="3.6.0"), tmp_path / "a" / "t", tmp_path / "a")
    assert r.returncode == 1 and "imports triton 3.6.0" in r.stderr        # not the manifest's version
    assert not (tmp_path / "a" / "t.env").exists()                          # no stale environment left to source
    bundle = _bundle(tmp_path / "b")
    with open(bundle / "triton.tar.xz", "ab") as f:                         # a tarball the manifest does not name
        f.write(b"\0")
    r = _run(bundle, tmp_path / "b" / "t", tmp_path / "b")
    assert r.returncode != 0 and "is not the manifest's" in r.stderr
    if not os.path.exists("/usr/local/cuda/bin/ptxas"):                    # the last place it looks
        r = _run(_bundle(tmp_path / "c"), tmp_path / "c" / "t", tmp_path / "c", ptxas=False)
        # said; fatal only where a GPU needs it (no CUDA here: the interpreter compiles nothing)
        assert r.returncode == 0 and "not found on this machine: ptxas, cuobjdump, nvdisasm" in r.stdout
        assert "; ptxas" not in r.stdout


def test_the_inductor_check_passes_with_torch_s_own_triton_and_reports_a_failure_or_a_hang(tmp_path):
    """What decides whether the servers run on the bundle's Triton (``OSCAR_TRITON_INDUCTOR``): torch's compiler
    tried in a process of its own. Here on the CPU (inductor's C++ code, ~20 s): the check itself is right, so a
    failure on the GPU is the compiler's; then stand-in torch packages that fail and that hang."""
    assert unpack.inductor_check(dict(os.environ), device="cpu", timeout_s=300) is True
    for name, body in [("fails", "def compile(*a, **k):\n    raise RuntimeError('triton 3.8 lacks what I import')\n"),
                       ("hangs", "import time\ndef compile(*a, **k):\n    time.sleep(60)\n")]:
        (tmp_path / name / "torch").mkdir(parents=True)
        (tmp_path / name / "torch" / "__init__.py").write_text(body)
        env = {**os.environ, "PYTHONPATH": str(tmp_path / name)}
        got = unpack.inductor_check(env, device="cpu", timeout_s=5)
        assert got == ("RuntimeError: triton 3.8 lacks what I import" if name == "fails" else "no answer in 5 s")
