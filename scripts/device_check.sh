#!/usr/bin/env bash
# GPU check for a lent device machine (torch, triton, transformers, pytest; no sglang, no network).
#
#   run (device tool):  bash scripts/device_check.sh        results under $OUT (default out/device_check)
#
# 1. Makes the import root oscar_sglang (with kernels/, calibration/, configs/ mapped under it, as the
#    installed package has them) from this checkout in a temp folder: no pip, no install.
# 2. The kernel tests natively on CUDA: every Triton kernel (write, decode, extend) against its
#    plain-torch reference, i.e. the decode path the server uses on a GPU vs the CPU path's numerics.
# 3. The kernel benchmark (INT2 vs BF16 decode, bandwidth, write throughput) into $OUT.
# Each step logs to $OUT; a failing step does not stop the later ones; the exit code is the first failure.
set -u -o pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/out/device_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PKG="$(mktemp -d)"
cp -r "$ROOT/oscar_sglang" "$PKG/oscar_sglang"
for sub in kernels calibration configs; do ln -s "$ROOT/$sub" "$PKG/oscar_sglang/$sub"; done
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
rc=0
step() {  # name, command...
    local name="$1"; shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    local r=$?
    echo "   rc=$r in $((SECONDS - t0)) s; last lines:" | tee -a "$OUT/summary.txt"
    tail -n 5 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
    [ $r -ne 0 ] && [ $rc -eq 0 ] && rc=$r
    return 0
}
step env "$PY" -c "import torch, triton, oscar_sglang.kernels.api as a; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA', a.__file__)"
step kernel_tests "$PY" -m pytest -q -p no:cacheprovider "$ROOT"/tests/test_kernels_write.py \
    "$ROOT"/tests/test_kernels_decode.py "$ROOT"/tests/test_kernels_extend.py
step bench_kernels "$PY" "$ROOT/scripts/bench_kernels.py" --out "$OUT"
rm -rf "$PKG"
exit $rc
