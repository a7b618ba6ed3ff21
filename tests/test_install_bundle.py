"""scripts/device/install_bundle.sh keeps a folder it filled from the same bundle, source and Python (a rerun on the
warm GPU machine skips ~15 s of pip), and refills one filled from anything else.

Run in bash with a stand-in for Python that logs each ``-m pip install`` instead of installing (the real install is
proven by the dry run, ``scripts/device/dry_run.sh``): what is checked here is when pip runs and what is kept.
"""

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1" in
  -c) echo "3.12.3 (fake)" ;;
  -m) echo "pip ${*: -2}" >> "$PIP_LOG" ;;       # the last two arguments: what is installed
  -) cat > /dev/null ;;                           # the import check, read from stdin
  *.py) exec "$REAL_PYTHON" "$@" ;;               # a script of ours (unpack_bundle.py): really run
esac
"""


def _install(tmp_path: Path, bundle: Path, site: Path) -> tuple[list[str], str]:
    log = tmp_path / "pip.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, PYTHON=str(tmp_path / "python"), PIP_LOG=str(log), REAL_PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "scripts/device/install_bundle.sh"), str(bundle), str(site)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return (log.read_text().splitlines() if log.exists() else []), r.stdout


def _fake_python_and_bundle(tmp_path: Path) -> tuple[Path, Path, Path]:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    bundle, site = tmp_path / "bundle", tmp_path / "site"
    (bundle / "wheels").mkdir(parents=True)
    return python, bundle, site


def test_a_folder_filled_from_the_same_bundle_is_kept_and_any_other_refilled(tmp_path):
    python, bundle, site = _fake_python_and_bundle(tmp_path)
    (bundle / "wheels" / "a-1.0-py3-none-any.whl").write_text("not a real wheel")
    (bundle / "bundle.json").write_text(json.dumps({"files": {"a": "sha-1"}}))

    calls, out = _install(tmp_path, bundle, site)
    assert len(calls) == 2 and calls[0].endswith(".whl") and calls[1].endswith("sgl_kernel_standin")
    assert "reusing" not in out and (site / ".oscar-install-stamp").is_file()
    (site / "left_by_the_first").write_text("")

    calls, out = _install(tmp_path, bundle, site)      # the rerun on the warm machine
    assert calls == [] and f"reusing {site}" in out and (site / "left_by_the_first").exists()

    (bundle / "bundle.json").write_text(json.dumps({"files": {"a": "sha-2"}}))   # another bundle
    calls, out = _install(tmp_path, bundle, site)
    assert len(calls) == 2 and "reusing" not in out
    assert not (site / "left_by_the_first").exists()    # emptied before pip filled it again

    python.write_text(FAKE_PYTHON.replace("3.12.3", "3.12.4"))   # another Python
    calls, _ = _install(tmp_path, bundle, site)
    assert len(calls) == 2


def test_a_folder_without_the_stamp_is_installed_into_not_emptied(tmp_path):
    _, bundle, site = _fake_python_and_bundle(tmp_path)
    site.mkdir()
    (site / "someone_elses").write_text("")
    calls, _ = _install(tmp_path, bundle, site)
    assert len(calls) == 2 and (site / "someone_elses").exists()


def test_a_bundle_as_built_is_unpacked_beside_the_folder_and_installed_from_there(tmp_path):
    """As built, the bundle is a tarball and its manifest (scripts/device/build_bundle.py): install_bundle.sh
    unpacks it (scripts/device/unpack_bundle.py, checked) into SITE.bundle and installs those wheels."""
    _fake_python_and_bundle(tmp_path)
    staging, bundle, site = tmp_path / "staging", tmp_path / "packed", tmp_path / "site"
    (staging / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(staging / "wheels" / "a-1.0-py3-none-any.whl", "w") as z:
        z.writestr("a/__init__.py", "")
    bundle.mkdir()
    files = load_script("device/build_bundle.py").pack(staging, bundle / "bundle.tar.xz")
    (bundle / "bundle.json").write_text(json.dumps({"tarball": "bundle.tar.xz", "files": files, "sha256": hashlib
                                                    .sha256((bundle / "bundle.tar.xz").read_bytes()).hexdigest()}))
    calls, out = _install(tmp_path, bundle, site)
    assert f"unpacked {site}.bundle: 1 files" in out
    assert calls[0].endswith(f" {site}.bundle/wheels/a-1.0-py3-none-any.whl") and len(calls) == 2
    assert (site / ".oscar-install-stamp").is_file()
    calls, out = _install(tmp_path, bundle, site)     # the warm machine: neither unpacked nor installed again
    assert calls == [] and f"reusing {site}.bundle" in out and f"reusing {site}:" in out
