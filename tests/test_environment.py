"""The environment the setup script builds, and the layering the architecture promises."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _run(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_sglang_imports_on_this_machine():
    # The CPU engine path: SGLang's server args and memory pool import (through the
    # sgl_kernel stand-in where CUDA is absent).
    r = _run("import sglang, sglang.srt.server_args, sglang.srt.mem_cache.memory_pool as m;"
             "print(sglang.__version__, m.MHATokenToKVPool.__name__)", SGLANG_USE_CPU_ENGINE="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["0.5.23", "MHATokenToKVPool"]


def test_numerics_and_calibration_never_import_sglang():
    r = _run("import sys, oscar_sglang, oscar_sglang.format, oscar_sglang.rotation, oscar_sglang.artifacts,"
             " oscar_sglang.assets, oscar_sglang.kernels, oscar_sglang.calibration.capture,"
             " oscar_sglang.calibration.roundtrip;"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'sgl_kernel')))")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


def test_no_generic_top_level_modules_installed():
    # kernels/ and calibration/ are mapped under oscar_sglang, never installed as top-level names.
    import importlib.util

    import oscar_sglang.calibration
    import oscar_sglang.kernels

    assert oscar_sglang.kernels.__name__ == "oscar_sglang.kernels"
    assert oscar_sglang.calibration.__file__.endswith("calibration/__init__.py")
    spec = importlib.util.find_spec("calibration")
    assert spec is None or "oscar" not in str(spec.origin)


def test_every_package_folder_is_listed_for_a_wheel():
    # pyproject lists the packages (kernels/ mapped under oscar_sglang): a folder missing there is missing from
    # a non-editable install, the GPU bundle's wheel among them, though every editable test passes.
    import tomllib

    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {name: root / folder for name, folder in cfg["package-dir"].items()}
    folders = set()
    for name, top in mapped.items():
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top).parts
            if "__pycache__" not in rel:
                folders.add(".".join((name, *rel)))
    assert folders == set(cfg["packages"])


def test_sgl_kernel_standin_raises_clearly_when_called():
    # Only where the stand-in (scripts/sgl_kernel_standin) is installed; tests/test_sgl_kernel_standin.py
    # checks what it implements.
    import importlib.metadata

    try:
        importlib.metadata.distribution("oscar-sgl-kernel-standin")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the sgl_kernel stand-in is not installed here (the real sgl_kernel may be)")
    import sgl_kernel

    with pytest.raises(NotImplementedError, match="sgl_kernel.moe_sum was called.*stand-in"):
        sgl_kernel.moe_sum()
    assert not hasattr(sgl_kernel, "__path_that_does_not_exist__")


def test_setup_refuses_a_fresh_venv_on_a_full_disk(tmp_path):
    # A full disk once failed CI half-way through pip ("No space left on device"); the setup
    # says it before creating anything. Run on a copy of its inputs, with a df that reports 300 MiB free.
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    for f in [root / "pyproject.toml", *root.glob("scripts/requirements-*.txt"), root / "scripts/setup_env.sh"]:
        shutil.copy(f, tmp_path / f.relative_to(root))
    shutil.copytree(root / "scripts/sgl_kernel_standin", tmp_path / "scripts/sgl_kernel_standin")
    fake_bin = tmp_path / "fake_bin"
    fake_bin.mkdir()
    (fake_bin / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted'\n"
                                 "echo '/dev/x 264241152 263934000 307200 100% /'\n")
    (fake_bin / "df").chmod(0o755)
    r = subprocess.run(["bash", "scripts/setup_env.sh", "--cpu"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}",
                                        "PYTHON": sys.executable})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "needs about 7 GiB free" in r.stderr and "only 300 MiB are free" in r.stderr
    assert not (tmp_path / ".venv").exists()
