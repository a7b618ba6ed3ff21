#!/usr/bin/env bash
# Dry run, on this CPU machine, of what scripts/device_check.sh does on the GPU test machine:
#
#   bash scripts/device/dry_run.sh          # ~8 min (+3 min the first time, for the venv); results in out/dry_run/
#   TRITON_BUNDLE=none bash scripts/device/dry_run.sh   # the call without the Triton 3.8 bundle (the machine's 3.6)
#
# 1. A Python 3.12 venv like the GPU machine's: torch 2.11.0 (+ torchvision, torchaudio), triton 3.6.0,
#    transformers 5.17.0 and the machine's other packages (scripts/device/device_like_requirements.txt),
#    minus every package the bundle carries, so a wheel missing from the bundle fails here first.
#    Kept between runs (stamped). Beside it, numpy < 2.3 in a folder of its own, put first on the path of the
#    two steps that run Triton's interpreter here (INTERPRETER_PYTHONPATH): triton 3.6's interpreter fails on
#    numpy >= 2.4 (the device's is 2.5), which the GPU never meets, since it runs compiled kernels.
# 2. scripts/device_check.sh with that Python, exactly as on the device, with both bundles (built if missing):
#    Triton 3.8 unpacked and imported by every step, the SGLang bundle unpacked and installed into a fresh
#    folder, `import sglang` and the plugins checked, the kernel tests (under Triton's interpreter here), the
#    BF16 and oscar-int2 servers on a small dummy model of the GPU run's head shape benchmarked by
#    sglang.bench_serving (short prompts), the kernel benchmark's CPU smoke.
# 3. Every kernel compiled for sm_90 by the call's Triton, 3.8 (3.6 with TRITON_BUNDLE=none)
#    (out/dry_run/compile_check_sm90.txt).
# 4. scripts/device/record.py over the results, as a lent session runs it (out/dry_run/record/gpu_results.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
work=${DRY_RUN_DIR:-/tmp/oscar-dry-run}
out=$root/out/dry_run
mkdir -p "$work" "$out"
py312=
for candidate in ${PYTHON312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312=$candidate; break; fi
done
if [ -z "$py312" ]; then
  echo "the dry run needs Python 3.12 (set PYTHON312=/path/to/python3.12)" >&2
  exit 1
fi
venv=$work/venv
interp=$work/interpreter-numpy   # numpy < 2.3 for the interpreter steps (see 1. above)
base="torch==2.11.0 triton==3.6.0 torchvision==0.26.0 torchaudio==2.11.0"   # as on the GPU machine
stamp=$( { echo "$py312 $base"; cat scripts/device/device_like_requirements.txt; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "[dry-run] building a device-like Python 3.12 venv in $venv"
  rm -rf "$venv"
  "$py312" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" $base
  "${pip[@]}" -r scripts/device/device_like_requirements.txt
  echo "$stamp" > "$venv/.stamp"
  rm -rf "$interp"
fi
if [ ! -d "$interp/numpy" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --target "$interp" "numpy<2.3"
fi
# What the GPU machine lacks must come from the bundle: remove whatever the installs above pulled in
# (but not what the machine has too, marked "also on the device").
carried=$(grep -v -e '^#' -e 'also on the device' scripts/device/bundle_wheels.txt | sed 's/==.*//' | tr '\n' ' ')
carried="$carried jedi parso"   # on neither: IPython runs without them (bundle_wheels.txt)
"$venv/bin/python" -m pip uninstall --yes --quiet $carried 2>/dev/null || true
py=$venv/bin/python
"$py" -c 'import torch, triton, transformers; print(f"[dry-run] python 3.12 venv: torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")'

# Which call this mirrors: both bundles carried (default), or the SGLang bundle alone (TRITON_BUNDLE=none).
[ -f out/device_bundle/bundle.tar.xz ] || bash scripts/device/build_bundle.sh
bundle=$root/out/device_bundle
triton_bundle=${TRITON_BUNDLE:-out/triton_bundle}
if [ "$triton_bundle" != none ]; then
  [ -f "$triton_bundle/triton.tar.xz" ] || bash scripts/device/build_triton_bundle.sh
  triton_bundle=$(cd "$triton_bundle" && pwd)
fi
triton_dir=$work/triton
rm -rf "$out"
# The install's folder: a whole run starts without one, as on a fresh device machine; a rerun row (ONLY=...)
# finds the one the run before it filled, as on the warm machine (install_bundle.sh reuses it if its stamp fits).
device_site=$work/device-site
[ -n "${ONLY:-}" ] || rm -rf "$device_site" "$work/bundle" "$triton_dir" "$triton_dir.env"   # (and the unpacked bundles)
rc=0
OUT=$out PYTHON=$py OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} INTERPRETER_PYTHONPATH=$interp DEVICE_SITE=$device_site \
  BUNDLE=$bundle BUNDLE_DIR=$work/bundle TRITON_BUNDLE=$triton_bundle TRITON_DIR=$triton_dir \
  bash scripts/device_check.sh || rc=$?
# 3. Every kernel compiled for sm_90 by the call's Triton (3.8 from its bundle; the machine's 3.6 with
#    TRITON_BUNDLE=none) down to a cubin, with this machine's ptxas where it has one, as the device's: the GPU
#    runs compiled kernels, which the interpreter above does not exercise (kernels/compile_check.py; ~1 min).
site=$work/site
rm -rf "$site"
# (from the folder device_check.sh's unpack step filled, not unpacked a second time)
PYTHON=$py bash scripts/device/install_bundle.sh "$work/bundle" "$site" > "$out/compile_check_install.log" 2>&1
env_file=/dev/null
[ "$triton_bundle" != none ] && env_file=$triton_dir.env   # written by the triton step where its checks passed
if ! (cd / && source "$env_file" && PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
      "$py" -m oscar_sglang.kernels.compile_check --arch 90 && "$py" -c 'import triton; print("triton", triton.__version__)') \
      > "$out/compile_check_sm90.txt" 2>&1; then
  echo "[dry-run] compile_check for sm_90 failed"
  [ "$rc" = 0 ] && rc=1
fi
tail -n 3 "$out/compile_check_sm90.txt" | sed 's/^/[dry-run] sm_90 | /'
# 4. The page a lent session writes from the fetched files, here from this run's (out/dry_run/record/).
if ! "$py" scripts/device/record.py "$out" --out "$out/record" --command "bash scripts/device/dry_run.sh (CPU)" \
      > /dev/null; then
  echo "[dry-run] record.py failed"
  [ "$rc" = 0 ] && rc=1
fi
echo "[dry-run] done in $SECONDS s (rc $rc); results in $out"
exit "$rc"
