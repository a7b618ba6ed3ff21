"""Build the carry bundle for the GPU test machine (H200, Python 3.12, torch 2.11, no sglang, no network).

    bash scripts/device/build_bundle.sh          # -> out/device_bundle/ (ignored by git), size printed

What travels to that machine must fit 64 MiB with the source tree, and this bundle travels with the Triton 3.8
one (``build_triton_bundle.py``, ~37 MiB); it holds only what the machine lacks and the checkout does not carry:

* ``wheels/``: the cp312 wheels of SGLang 0.5.23's server path that the
  machine lacks (``scripts/device/bundle_wheels.txt``) and SGLang itself,
  slimmed to a pure-Python wheel: without its Rust extension modules (the
  Python radix tree is used instead: ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``)
  and without ``multimodal_gen/`` (diffusion serving), 39 MiB -> ~14 MiB;
* ``tokenizer/``: the default model's tokenizer files, for the config-only
  dummy-weight models ``scripts/dummy_models.py`` writes there (Llama-3-8B
  and SmolLM2 geometry) together with their Hadamard rotations (the 8B one
  is 33 MiB, so it is made where it is used, in seconds);
* ``sharegpt_shakespeare.json``: real text in ShareGPT's format, so
  ``python -m sglang.bench_serving --dataset-name random --dataset-path ...``
  needs no download (its random dataset cuts/repeats real prompts' tokens).

They travel as one solid xz tarball, ``bundle.tar.xz`` (the wheels re-zipped without compression first, so
that xz compresses them as one text: 28.5 MiB of wheels as downloaded, 17.7 MiB for the whole tarball), with
``bundle.json``: the tarball's sha256 and every file in it with its size and sha256.  On the machine
``scripts/device/unpack_bundle.py`` unpacks and checks it (``device_check.sh``'s ``unpack`` step).

Not in the bundle, because the checkout carries them: this project and the
``sgl_kernel`` stand-in (``scripts/sgl_kernel_standin``), both pure Python,
installed from source on the machine by ``scripts/device/install_bundle.sh``.
Downloads are cached in ``out/device_bundle_cache/``.
"""

from __future__ import annotations

import argparse
import base64
import csv
import datetime
import hashlib
import io
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dummy_models  # noqa: E402
import xz_tarball  # noqa: E402

from oscar_sglang import assets  # noqa: E402

SGLANG = "sglang==0.5.23"
TARBALL = "bundle.tar.xz"
LIMIT_MIB = 60         # one bundle with the source tree (the limit)
CARRY_LIMIT_MIB = 64   # what one device call carries: the source tree and both bundles
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)] + ["manylinux2014_x86_64"]
# Dropped from the SGLang wheel: compiled Rust extensions (cp312 binaries needing glibc >= 2.34; the
# server falls back to Python for the radix tree) and the diffusion-serving package.
SLIM_DROP = re.compile(r"(\.so$)|(^sglang/multimodal_gen/)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "out" / "device_bundle")
    p.add_argument("--cache", type=Path, default=ROOT / "out" / "device_bundle_cache")
    p.add_argument("--prompts", type=int, default=200, help="conversations in the ShareGPT-format prompt file")
    return p.parse_args(argv)


def requirements(path: Path = Path(__file__).with_name("bundle_wheels.txt")) -> list[str]:
    return [ln.split("#")[0].strip() for ln in path.read_text().splitlines() if ln.split("#")[0].strip()]


def download(specs: list[str], dest: Path) -> list[Path]:
    """cp312 manylinux (or pure) wheels for ``specs``, without dependencies; returns their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
           "--abi", "none", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + specs, check=True)
    found = []
    for spec in specs:
        name, version = spec.split("==")
        stem = re.sub(r"[-_.]+", "_", name).lower()
        hits = [w for w in dest.glob("*.whl")
                if re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower() == stem and w.name.split("-")[1] == version]
        if len(hits) != 1:
            raise SystemExit(f"expected one wheel for {spec} in {dest}, found {[h.name for h in hits]}")
        found.append(hits[0])
    return found


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_sglang(wheel: Path, dest_dir: Path) -> Path:
    """A pure-Python ``py3-none-any`` copy of the SGLang wheel without :data:`SLIM_DROP` files."""
    name, version = wheel.name.split("-")[:2]
    out = dest_dir / f"{name}-{version}-py3-none-any.whl"
    dist_info = f"{name}-{version}.dist-info/"
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            path = info.filename
            if SLIM_DROP.search(path) or path == dist_info + "RECORD":
                continue
            data = src.read(info)
            if path == dist_info + "WHEEL":
                data = re.sub(rb"Root-Is-Purelib: \w+", b"Root-Is-Purelib: true", data)
                data = re.sub(rb"Tag: .*", b"Tag: py3-none-any", data)
            dst.writestr(path, data)
            records.append((path, _record_hash(data), len(data)))
        records.append((dist_info + "RECORD", "", ""))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(records)  # quotes paths that hold commas
        dst.writestr(dist_info + "RECORD", text.getvalue())
    return out


def sharegpt_prompts(n: int, seed: int = 0, chars: int = 3000) -> list[dict]:
    """``n`` two-turn conversations cut from the Shakespeare texts (prompt: a passage; answer: the next one)."""
    texts = assets.read_texts()
    rng = random.Random(seed)
    names = sorted(texts)
    rows = []
    for i in range(n):
        text = texts[names[i % len(names)]]
        start = rng.randrange(0, max(1, len(text) - 2 * chars))
        rows.append({"id": f"shakespeare-{i}", "conversations": [
            {"from": "human", "value": text[start:start + chars]},
            {"from": "gpt", "value": text[start + chars:start + 2 * chars]}]})
    return rows


def tree_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def source_tree_bytes() -> int:
    """What the device tool sends besides carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    return tree_bytes(ROOT / p for p in out.split("\0") if p)


def check_size(tag: str, what: str, bundle_bytes: int, other: Path | None = None) -> int:
    """Print ``what`` (the bundle's description) with the source tree's size and the two together against
    :data:`LIMIT_MIB`, and, where the ``other`` bundle's folder exists, all three against :data:`CARRY_LIMIT_MIB`
    (what one device call carries); 1 if over either, else 0."""
    source = source_tree_bytes()
    total = (bundle_bytes + source) / 2**20
    print(f"[{tag}] {what}; source tree {source / 2**20:.1f} MiB; together {total:.1f} MiB (limit {LIMIT_MIB} MiB)",
          flush=True)
    if total > LIMIT_MIB:
        print(f"[{tag}] too large: {total:.1f} MiB > {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    if other is None or not other.is_dir():
        return 0
    both = total + tree_bytes(other.iterdir()) / 2**20
    print(f"[{tag}] with {other} as well (one call carries both): {both:.1f} MiB (limit {CARRY_LIMIT_MIB} MiB, "
          f"{CARRY_LIMIT_MIB - both:.1f} MiB to spare)", flush=True)
    if both > CARRY_LIMIT_MIB:
        print(f"[{tag}] the two bundles and the source tree are too large for one call: {both:.1f} MiB > "
              f"{CARRY_LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


def stored_wheel(data: bytes) -> bytes:
    """The wheel ``data`` re-zipped without compression: the same files, names, times and modes (pip checks the
    files against RECORD, not the zip's compression), so that xz compresses all wheels as one text."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)            # (read with the entry's own compression, then stored)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out.getvalue()


def pack(staging: Path, tarball: Path) -> dict[str, dict]:
    """Every file under ``staging`` into ``tarball`` (one solid xz; wheels stored, :func:`stored_wheel`): the
    manifest's ``files``, each with the size and sha256 it has when unpacked."""
    files = {}
    with xz_tarball.writer(tarball) as tar:
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            name, data = path.relative_to(staging).as_posix(), path.read_bytes()
            if path.suffix == ".whl":
                data = stored_wheel(data)
            xz_tarball.add(tar, name, data)
            files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return files


def stage(out: Path, cache: Path, prompts: int) -> None:
    """What the bundle holds, as files under ``out``: ``wheels/``, ``tokenizer/``, the prompts."""
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    print(f"[bundle] downloading {len(requirements())} wheels + {SGLANG} (cached in {cache})", flush=True)
    for whl in download(requirements(), cache / "wheels"):
        shutil.copy(whl, wheels / whl.name)
    (sgl,) = download([SGLANG], cache / "sglang")
    slim = slim_sglang(sgl, wheels)
    print(f"[bundle] {sgl.name} {sgl.stat().st_size / 2**20:.1f} MiB -> {slim.name} "
          f"{slim.stat().st_size / 2**20:.1f} MiB", flush=True)
    tok = out / "tokenizer"
    tok.mkdir()
    model = assets.default_model_dir()
    for name in dummy_models.TOKENIZER_FILES:
        if (model / name).exists():
            shutil.copy(model / name, tok / name)
    (out / "sharegpt_shakespeare.json").write_text(json.dumps(sharegpt_prompts(prompts)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        stage(staging, args.cache, args.prompts)
        wheel_bytes = tree_bytes((staging / "wheels").iterdir())
        print(f"[bundle] packing {len(list(staging.rglob('*.whl')))} wheels ({wheel_bytes / 2**20:.1f} MiB), the "
              f"tokenizer and the prompts into {TARBALL} (xz -9e, ~1-2 min)", flush=True)
        tarball = args.out / TARBALL
        files = pack(staging, tarball)
    manifest = {"date": datetime.date.today().isoformat(), "sglang": SGLANG, "tarball": TARBALL,
                "tarball_bytes": tarball.stat().st_size, "sha256": xz_tarball.sha256(tarball), "files": files}
    (args.out / "bundle.json").write_text(json.dumps(manifest, indent=1))
    unpacked = sum(f["bytes"] for f in files.values())
    return check_size("bundle", f"{args.out}: {len(files)} files, {unpacked / 2**20:.1f} MiB unpacked (wheels "
                                f"{wheel_bytes / 2**20:.1f} MiB as downloaded), {TARBALL} "
                                f"{tarball.stat().st_size / 2**20:.1f} MiB", tree_bytes(args.out.iterdir()),
                      ROOT / "out" / "triton_bundle")


if __name__ == "__main__":
    raise SystemExit(main())
