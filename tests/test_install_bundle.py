"""scripts/device/install_bundle.sh keeps a folder it filled from the same bundle, source and Python (a rerun on the
warm GPU machine skips ~15 s of pip), and refills one filled from anything else.

Run in bash with a stand-in for Python that logs each ``-m pip install`` instead of installing (the real install is
proven by the dry run, ``scripts/device/dry_run.sh``): what is checked here is when pip runs and what is kept.
"""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1" in
  -c) echo "3.12.3 (fake)" ;;
  -m) echo "pip ${*: -2}" >> "$PIP_LOG" ;;       # the last two arguments: what is installed
  -) cat > /dev/null ;;                           # the import check, read from stdin
esac
"""


def _install(tmp_path: Path, bundle: Path, site: Path) -> tuple[list[str], str]:
    log = tmp_path / "pip.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, PYTHON=str(tmp_path / "python"), PIP_LOG=str(log))
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
