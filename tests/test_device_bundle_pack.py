"""The SGLang carry bundle as one solid xz tarball (scripts/device/build_bundle.py's ``pack``) and its checked
unpacking on the GPU machine (scripts/device/unpack_bundle.py), on small stand-in files: the wheels come out
stored but installable by pip with the same files, everything else byte for byte, and a tarball or file that is
not the manifest's is refused.  The real bundle is built and installed by ``scripts/device/dry_run.sh``.
"""

import base64
import hashlib
import json
import subprocess
import sys
import zipfile

import pytest

from script_modules import load_script

build = load_script("device/build_bundle.py")
unpack = load_script("device/unpack_bundle.py")

MODULE = b"VALUE = 'from the wheel'\n" * 40   # compressible, so a deflated entry differs from a stored one


def _record(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _wheel(path):
    files = {"tiny_pkg/__init__.py": MODULE,
             "tiny_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.0\n",
             "tiny_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "\n".join([_record(n, d) for n, d in files.items()] + ["tiny_pkg-1.0.dist-info/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in {**files, "tiny_pkg-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return path


def _staging(tmp_path):
    staging = tmp_path / "staging"
    (staging / "wheels").mkdir(parents=True)
    (staging / "tokenizer").mkdir()
    _wheel(staging / "wheels" / "tiny_pkg-1.0-py3-none-any.whl")
    (staging / "tokenizer" / "tokenizer.json").write_text(json.dumps({"vocab": list(range(50))}))
    (staging / "sharegpt_shakespeare.json").write_text('[{"id": "x"}]')
    return staging


def _packed(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    files = build.pack(_staging(tmp_path), bundle / build.TARBALL)
    (bundle / "bundle.json").write_text(json.dumps({"tarball": build.TARBALL, "files": files,
                                                    "sha256": hashlib.sha256((bundle / build.TARBALL).read_bytes())
                                                    .hexdigest()}))
    return bundle, files


def test_a_stored_wheel_holds_the_same_files_and_pip_installs_it(tmp_path):
    original = _wheel(tmp_path / "tiny_pkg-1.0-py3-none-any.whl").read_bytes()
    stored = tmp_path / "stored" / "tiny_pkg-1.0-py3-none-any.whl"
    stored.parent.mkdir()
    stored.write_bytes(build.stored_wheel(original))
    with zipfile.ZipFile(tmp_path / "tiny_pkg-1.0-py3-none-any.whl") as a, zipfile.ZipFile(stored) as b:
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        assert all(a.read(i.filename) == b.read(i.filename) for i in a.infolist())
        assert {i.compress_type for i in a.infolist()} == {zipfile.ZIP_DEFLATED}
        assert {i.compress_type for i in b.infolist()} == {zipfile.ZIP_STORED}
    # pip checks every file against RECORD: the stored wheel installs, as the device's install step does it
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                        "--no-deps", "--no-compile", "--target", str(tmp_path / "site"), str(stored)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "tiny_pkg" / "__init__.py").read_bytes() == MODULE


def test_the_unpacked_bundle_is_the_staged_one_and_is_reused(tmp_path):
    bundle, files = _packed(tmp_path)
    staging = tmp_path / "staging"
    assert set(files) == {"wheels/tiny_pkg-1.0-py3-none-any.whl", "tokenizer/tokenizer.json",
                          "sharegpt_shakespeare.json"}
    dest = tmp_path / "oscar-bundle"
    unpack.unpack(bundle, dest)
    for name in files:
        if name.endswith(".whl"):   # stored, with the staged wheel's files
            with zipfile.ZipFile(dest / name) as a, zipfile.ZipFile(staging / name) as b:
                assert {i.filename: a.read(i) for i in a.infolist()} == {i.filename: b.read(i) for i in b.infolist()}
        else:
            assert (dest / name).read_bytes() == (staging / name).read_bytes()
    assert json.loads((dest / "bundle.json").read_text())["files"] == files   # what install_bundle.sh stamps with
    first = (dest / "tokenizer" / "tokenizer.json").stat().st_mtime_ns
    r = subprocess.run([sys.executable, str(unpack.__file__), str(bundle), str(dest)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and f"reusing {dest}: 3 files" in r.stdout, r.stderr   # the warm machine's rerun
    assert (dest / "tokenizer" / "tokenizer.json").stat().st_mtime_ns == first      # not extracted again


def test_a_tarball_or_a_file_that_is_not_the_manifest_s_is_refused(tmp_path):
    bundle, _ = _packed(tmp_path)
    dest = tmp_path / "oscar-bundle"
    unpack.unpack(bundle, dest)
    (dest / "sharegpt_shakespeare.json").write_text("[]")          # changed after the unpacking
    with pytest.raises(SystemExit, match="not the file the manifest names"):
        unpack.unpack(bundle, dest)
    (dest / "sharegpt_shakespeare.json").unlink()
    with pytest.raises(SystemExit, match="differ from the manifest's"):
        unpack.unpack(bundle, dest)
    with open(bundle / build.TARBALL, "ab") as f:                   # a tarball the manifest does not name
        f.write(b"\0")
    with pytest.raises(SystemExit, match="is not the manifest's"):
        unpack.unpack(bundle, tmp_path / "elsewhere")


@pytest.mark.parametrize("mib, other_mib, rc", [(20, None, 0), (56, None, 1), (20, 38, 0), (20, 42, 1)])
def test_the_size_check_counts_the_other_bundle_that_travels_in_the_same_call(tmp_path, monkeypatch, mib, other_mib,
                                                                              rc):
    monkeypatch.setattr(build, "source_tree_bytes", lambda: 5 * 2**20)
    other = tmp_path / "triton_bundle"
    if other_mib is not None:
        other.mkdir()
        with open(other / "triton.tar.xz", "wb") as f:
            f.truncate(other_mib * 2**20)
    assert build.check_size("bundle", "test", mib * 2**20, other) == rc   # limits: 60 alone, 64 with the other
