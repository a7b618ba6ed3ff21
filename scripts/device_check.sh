#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (H200: Python 3.12, torch 2.11, triton 3.6, transformers
# 5.17, nvcc; no sglang, no network). Build the carry bundles first, here: bash scripts/device/build_bundle.sh &&
# bash scripts/device/build_triton_bundle.sh (together with the source tree under the tool's 64 MiB)
#
#   device tool:  run  command="bash scripts/device_check.sh"  carry=["out/device_bundle", "out/triton_bundle"]
#                 timeout_s=600
#   (planned inside DEVICE_LIMIT_S, 590 s: the servers take what the steps before leave, less 170 s kept for the
#   kernel benchmark; the calibration step comes last with what is left)
#   on CPU:       bash scripts/device/dry_run.sh   (a device-like Python 3.12 venv, then this script)
#
# Steps (each logged, each with its own time limit; a failing step does not stop the others):
#   env            GPU, driver, glibc, Python packages
#   unpack         out/device_bundle's tarball (SGLang's wheels, the tokenizer, the prompts) into /tmp/oscar-bundle
#                  (BUNDLE_DIR), sha256-checked (scripts/device/unpack_bundle.py); kept on a warm machine
#   triton         only where out/triton_bundle is carried (scripts/device/build_triton_bundle.sh): Triton 3.8, a
#                  user's, unpacked (scripts/device/unpack_triton.py) and imported by every step after it, the
#                  servers too unless torch's own compiler (inductor) fails with it there
#   install        the bundle's wheels + this project + the sgl_kernel stand-in into a folder of their own
#                  (scripts/device/install_bundle.sh), SGLang's torch-fallback environment
#                  (scripts/device/server_env.sh); without a bundle: an import root from this checkout. Into
#                  /tmp/oscar-device-site (DEVICE_SITE), which a rerun on the warm machine reuses if nothing changed
#   kernel_tests   every Triton kernel (write, decode, extend, read) natively against its torch reference
#                  and the hot pool's update (its reference; recorded in a CUDA graph, replayed), and the
#                  INT2 backend's whole decode step recorded in real CUDA graphs vs eager (needs the install)
#   prefill_probe  the INT2 prefill's two paths on the last chunk of a 32k prompt: the sdpa path (the default
#                  on a GPU) stays the INT2 server's unless the Triton kernel is at least 1.2x as fast
#                  (OSCAR_SGLANG_EXTEND_KERNEL=sdpa or =kernel, scripts/device/prefill_probe.py); not when the
#                  knob is set
#   servers        the real SGLang servers, BF16 (triton backend, CUDA graphs) vs oscar-int2, dummy weights
#                  of Llama-3-8B geometry, same KV budget: capacity, then sglang.bench_serving at 32k
#                  input, concurrency 1 and the largest each capacity allows: output and decode tok/s, TTFT,
#                  ITL (scripts/device/serve_bench.py)
#   bench_kernels  INT2 decode vs the best BF16 decode (Triton split-K, SDPA flash, FlashInfer if there),
#                  bandwidth as a fraction of the measured copy bandwidth; prefill attention of a 32k prompt in
#                  SGLang's 8k chunks, INT2 vs SGLang's Triton extend and SDPA (scripts/bench_kernels.py)
#   calibration    oscar-calibrate's default pipeline's time and memory for that geometry's first 4 layers,
#                  random weights built on the GPU, 20k tokens of the bundle's text (scripts/device/calibrate_bench.py)
#   decode_variants  only when ONLY names it, before the kernel tests: the INT2 decode loop's variants and tiles
#                  side by side with the BF16 decode (scripts/device/decode_variants.py, after run 1 found the
#                  decode latency-bound)
#   decode_profile only when ONLY names it (GPU and ncu): Nsight Compute's counters of the decode split kernel,
#                  run 1's loop and the default (decode_variants.py --profile)
# Without CUDA (the dry run) the same steps run small: a 4-layer model of the GPU run's head shape (head_dim 128,
# GQA 4:1; scripts/dummy_models.py llama-d128-small), short prompts, the interpreter.
#
# ONLY="kernel_tests servers" runs just those steps (env always; install and models only for a step that needs
# them: install for servers and kernel_tests, models for servers and calibration): a rerun of what failed.
# Knobs for a short rerun on the warm machine (see docs/GPU.md):
#   DEVICE_LIMIT_S   the rerun's timeout_s less ~10 s (590 by default): the servers step plans inside it
#   SERVE_CACHES     the servers to run, of "bf16 oscar-int2" (e.g. only oscar-int2 when BF16's numbers are in)
#   SERVE_ARGS       more arguments of serve_bench.py, after the run's own (a later one wins), e.g.
#                    "--input-lens 32768 --largest-only --cuda-graph-max-bs 32": only the run the first one lacked
#   KERNEL_TEST_IDS  the kernel tests to run instead of all (paths under tests/, pytest ids allowed), e.g.
#                    "test_hot_plan.py test_kernels_decode.py::test_pipelined_decode_loops_match_the_reference"
#   VARIANTS_BUDGET_S  decode_variants' budget (70 s: no case is started after it)
#   BENCH_BUDGET_S   the kernel benchmark's decode budget (80 s; its step's limit is 70 s more: the write,
#                    hot-update and prefill sections after it, the prefill one capped at 20 s)
# Without CUDA only: INTERPRETER_PYTHONPATH goes first on the path of the two steps that run Triton's interpreter
# (kernel_tests, bench_kernels); the dry run puts numpy < 2.3 there, since triton 3.6's interpreter fails on
# numpy >= 2.4 (a loaded scalar is a 1-element array to it, and int() of one is an error since numpy 2.4).
# Results: $OUT/summary.txt, the reports (serve_bench.*, bench_kernels.*) and device_check.tar.gz with
# every log, refreshed after each step (the device tool brings back at most 8 files from $OUT).
# Exit code: the first failing step's.
set -u -o pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/out/device_check}"
PY="${PYTHON:-python3}"
BUNDLE="${BUNDLE:-$ROOT/out/device_bundle}"
[ -d "$BUNDLE" ] && BUNDLE="$(cd "$BUNDLE" && pwd)"   # absolute: the steps after the install run elsewhere
WORK="$(mktemp -d /tmp/oscar-device.XXXXXX)"
RES="$WORK/results"
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1
rc=0
T0=$SECONDS
DEVICE_LIMIT_S=${DEVICE_LIMIT_S:-590}   # the device tool's timeout_s (600) less a margin

publish() {  # the latest reports and a tarball of everything into $OUT
    cp "$RES"/summary.txt "$OUT"/ 2>/dev/null
    for f in serve_bench.md serve_bench.json serve_bench.png bench_kernels.md bench_kernels.json bench_kernels.png \
             bench_kernels_cpu_smoke.md decode_variants.md; do
        [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"
    done
    tar czf "$OUT/device_check.tar.gz" -C "$WORK" results 2>/dev/null
}
# The device tool stops the command at its timeout_s and returns what $OUT holds then: publish every 20 s too,
# so a step cut short still brings back its log and the reports written so far (serve_bench rewrites its own
# after every run).
( while sleep 20; do publish; done ) < /dev/null > /dev/null 2>&1 &   # holds no pipe of the caller's
PUBLISHER=$!
trap 'kill $PUBLISHER 2>/dev/null' EXIT
# SGLang servers a killed step left behind run in sessions of their own and would hold the GPU. Every SGLang
# server of the machine is stopped: on CPU (the dry run) do not run it beside tests that serve.
stop_servers() {
    command -v pkill > /dev/null && pkill -9 -f 'sglang\.launch_server|^sglang::' 2> /dev/null && sleep 3
    return 0
}
stop_servers  # a previous run cut short by the device tool's limit (the machine stays warm for a rerun)
only_with_needs() {  # ONLY with the steps that the chosen ones need (printed)
    local only="$1"
    [[ " $only " == *" servers "* ]] && only="install models prefill_probe $only"
    [[ " $only " == *" kernel_tests "* ]] && only="install $only"  # its CUDA-graph test serves through SGLang
    [[ " $only " == *" decode_variants "* || " $only " == *" decode_profile "* ]] && only="install $only"
    [[ " $only " == *" calibration "* ]] && only="models $only"
    echo "$only"
}
[ -n "${ONLY:-}" ] && ONLY="$(only_with_needs "$ONLY")"
wanted() { [ -z "${ONLY:-}" ] || [[ " env unpack triton $ONLY " == *" $1 "* ]]; }
step() {  # name, time limit (s), command...
    local name="$1" limit="$2"; shift 2
    if ! wanted "$name"; then echo "== $name: skipped (ONLY=$ONLY)" | tee -a "$RES/summary.txt"; return 0; fi
    echo "== $name (limit ${limit} s, at $((SECONDS - T0)) s): $*" | tee -a "$RES/summary.txt"
    local t0=$SECONDS
    timeout --kill-after=15 "$limit" "$@" > "$RES/$name.log" 2>&1
    local r=$?
    local note=""; [ $r -eq 124 ] || [ $r -eq 137 ] && note=" (TIMED OUT)"
    echo "   rc=$r$note in $((SECONDS - t0)) s; last lines:" | tee -a "$RES/summary.txt"
    tail -n 8 "$RES/$name.log" | sed 's/^/   | /' | tee -a "$RES/summary.txt"
    [ $r -ne 0 ] && [ $rc -eq 0 ] && rc=$r
    publish
    return $r
}

# Which INT2 prefill path is faster on this GPU, the Triton kernel or the sdpa path (the prefix dequantized once,
# then flash attention), timed on the last 8k chunk of a 32k prompt: the INT2 server's 32k waves are mostly
# prefill. The servers step inherits the choice. Not when the knob is set already or no INT2 server is to run;
# without CUDA it runs (tiny shapes, the interpreter) but never chooses.
probe_prefill() {  # time limit (s)
    [[ " ${SERVE_CACHES:-oscar-int2} " == *" oscar-int2 "* ]] || return 0
    if [ -n "${OSCAR_SGLANG_EXTEND_KERNEL:-}" ]; then
        echo "== prefill_probe: skipped (OSCAR_SGLANG_EXTEND_KERNEL=$OSCAR_SGLANG_EXTEND_KERNEL set for the servers)" \
            | tee -a "$RES/summary.txt"
        return 0
    fi
    step prefill_probe "$1" "${INTERP[@]}" "$PY" "$ROOT/scripts/device/prefill_probe.py" --out "$RES"
    if [ "$GPU" = 1 ] && grep -qx 'choice=sdpa' "$RES/prefill_probe.log" 2>/dev/null; then
        export OSCAR_SGLANG_EXTEND_KERNEL=sdpa
        echo "== the INT2 server prefills through the sdpa path (OSCAR_SGLANG_EXTEND_KERNEL=sdpa: prefill_probe)" \
            | tee -a "$RES/summary.txt"
    elif [ "$GPU" = 1 ] && grep -qx 'choice=kernel' "$RES/prefill_probe.log" 2>/dev/null; then
        export OSCAR_SGLANG_EXTEND_KERNEL=kernel
        echo "== the INT2 server prefills with the Triton extend kernel (OSCAR_SGLANG_EXTEND_KERNEL=kernel: prefill_probe)" \
            | tee -a "$RES/summary.txt"
    fi
    return 0
}

GPU=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
step env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1;
  ldd --version | head -1; nproc; free -g | head -2; df -h /tmp | tail -1;
  echo \"ninja: \$(command -v ninja || echo none), nvcc: \$(command -v nvcc || echo none)\";
  $PY -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
    triton.__version__, transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"NO CUDA\")'"

# The SGLang bundle travels as one xz tarball (so that it fits one call with the Triton bundle): unpacked into a
# folder of its own, which every step below reads as BUNDLE. A folder with wheels/ (unpacked already) is used as
# it is.
if [ -f "$BUNDLE/bundle.tar.xz" ] && step unpack 60 "$PY" "$ROOT/scripts/device/unpack_bundle.py" "$BUNDLE" \
        "${BUNDLE_DIR:-/tmp/oscar-bundle}"; then
    BUNDLE="${BUNDLE_DIR:-/tmp/oscar-bundle}"
fi

# Triton 3.8, what a user's SGLang 0.5.23 (torch 2.14.1) compiles the kernels with, where its bundle is carried
# (scripts/device/build_triton_bundle.sh; the machine's own is 3.6): every step below imports it, with the
# machine's ptxas; the servers too, unless its check found torch 2.11's own compiler (inductor, which SGLang
# uses for a few functions) failing with it (OSCAR_TRITON_INDUCTOR=0 in its environment file): then they run
# on the machine's Triton, and the summary says so.
TRITON_BUNDLE="${TRITON_BUNDLE:-$ROOT/out/triton_bundle}"
[ -d "$TRITON_BUNDLE" ] && TRITON_BUNDLE="$(cd "$TRITON_BUNDLE" && pwd)"
if [ -f "$TRITON_BUNDLE/triton.tar.xz" ] \
        && step triton 120 "$PY" "$ROOT/scripts/device/unpack_triton.py" "$TRITON_BUNDLE" "${TRITON_DIR:-/tmp/oscar-triton}"; then
    # shellcheck disable=SC1090
    source "${TRITON_DIR:-/tmp/oscar-triton}.env"
    echo "== the steps below import triton $("$PY" -c 'import triton; print(triton.__version__)' 2>&1) from the bundle" \
        | tee -a "$RES/summary.txt"
fi

HAVE_SGLANG=0
# Outside WORK, so a rerun on the warm machine finds it and skips pip when bundle and source are the same
# (install_bundle.sh's stamp).
SITE="${DEVICE_SITE:-/tmp/oscar-device-site}"
if [ -d "$BUNDLE/wheels" ] && wanted install && step install 240 env PYTHON="$PY" bash "$ROOT/scripts/device/install_bundle.sh" "$BUNDLE" "$SITE"; then
    # shellcheck source=scripts/device/server_env.sh
    source "$ROOT/scripts/device/server_env.sh" "$SITE"
    HAVE_SGLANG=1
else
    why="no bundle at $BUNDLE"; [ -f "$BUNDLE/bundle.tar.xz" ] && why="the unpack step failed"
    [ -d "$BUNDLE/wheels" ] && why="the install step failed"; wanted install || why="ONLY=$ONLY"
    echo "== SGLang not installed ($why): server steps skipped; kernels from an import root of this checkout" \
        | tee -a "$RES/summary.txt"
    PKG="$WORK/pkg"
    mkdir -p "$PKG"
    cp -r "$ROOT/oscar_sglang" "$PKG/oscar_sglang"
    for sub in kernels calibration configs; do ln -s "$ROOT/$sub" "$PKG/oscar_sglang/$sub"; done
    export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
fi
# Python puts the working directory first on sys.path (python -m): run from a neutral one, so the
# checkout's oscar_sglang/ folder never shadows the installed package (which maps kernels/ under it).
cd "$WORK"

# Compiling is most of this step's time on the GPU (~1-2 s per kernel specialization, one CPU thread each;
# the tests launch ~290 distinct specializations, counted under the interpreter on 2026-12-04, docs/GPU.md):
# spread the tests over one pytest-xdist worker per CPU core (16 on the H200 machine; at most 16), which the
# device image has.
XDIST=()
WORKERS=2
if [ "$GPU" = 1 ]; then WORKERS=$(nproc); [ "$WORKERS" -le 16 ] || WORKERS=16; fi
"$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n "$WORKERS")
# The steps that run Triton's interpreter where there is no GPU, with INTERPRETER_PYTHONPATH first (see the top).
INTERP=()
[ "$GPU" = 1 ] || [ -z "${INTERPRETER_PYTHONPATH:-}" ] || INTERP=(env "PYTHONPATH=$INTERPRETER_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}")
# -v: one line per finished test, so a step cut by its limit still names what passed and what failed;
# --durations: which tests' compiles take the time, for planning the next run.
kernel_test_paths() {  # what the kernel_tests step runs, one per line; the CUDA-graph test only with SGLang there
    local t                 # (pytest collects nothing at all, not even the rest, when a named test's module skips)
    if [ -n "${KERNEL_TEST_IDS:-}" ]; then
        for t in $KERNEL_TEST_IDS; do echo "$ROOT/tests/$t"; done
        return 0
    fi
    for t in kernels_write kernels_decode kernels_query_rotation kernels_extend kernels_read kernels_repin \
             kernels_hot_pass kernels_head_dim_256 hot_plan decode_autotune; do
        echo "$ROOT/tests/test_$t.py"
    done
    [ "$HAVE_SGLANG" = 1 ] && echo "$ROOT/tests/test_sglang_cuda_graph.py::test_real_cuda_graphs_match_eager_decode"
    return 0
}
serve_seconds() {  # the servers step's seconds from what is left of DEVICE_LIMIT_S and what later steps keep:
    local left=$1 reserve=$2 floor   # what is left less the reserve, but at least 150 s (or all that is left);
    floor=$(( left < 150 ? left : 150 ))   # no other cap: a servers-only call gives them everything (until
    local s=$(( left - reserve ))          # 2026-12-05 a 420 s cap took ~60 s from INT2's 32k wave there)
    echo $(( s < floor ? floor : s ))
}
servers_env() {  # env(1) and its arguments, one per line, for the server steps: the bundle's Triton off the path
    echo env      # where torch's compiler failed with it in the triton step (OSCAR_TRITON_INDUCTOR=0), else as is
    [ "${OSCAR_TRITON_INDUCTOR:-1}" = 0 ] && [ -n "${OSCAR_TRITON_DIR:-}" ] || return 0
    local tool
    for tool in PTXAS CUOBJDUMP NVDISASM; do echo -u; echo "TRITON_${tool}_PATH"; done   # (options first)
    echo "PYTHONPATH=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep -vxF "$OSCAR_TRITON_DIR" | paste -sd: -)"
}
if [[ " ${ONLY:-} " == *" decode_variants "* ]]; then  # opt-in: a diagnosis, not part of the whole run
    step decode_variants $([ "$GPU" = 1 ] && echo 120 || echo 300) "${INTERP[@]}" "$PY" \
        "$ROOT/scripts/device/decode_variants.py" --out "$RES" --budget-s "${VARIANTS_BUDGET_S:-70}"
fi
# Opt-in too: Nsight Compute's counters (speed of light, occupancy, warp stalls, memory) for the decode split
# kernel, run 1's loop and today's default (decode_variants.py --profile); GPU only, where ncu reads counters.
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
if [[ " ${ONLY:-} " == *" decode_profile "* ]] && [ "$GPU" = 1 ] && [ -n "$NCU" ]; then
    step decode_profile 240 "$NCU" --clock-control none --kernel-name regex:_decode_split_kernel --launch-count 4 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis "$PY" "$ROOT/scripts/device/decode_variants.py" --out "$RES" --profile
elif [[ " ${ONLY:-} " == *" decode_profile "* ]]; then
    echo "== decode_profile: skipped (needs a GPU and Nsight Compute's ncu)" | tee -a "$RES/summary.txt"
fi
mapfile -t KERNEL_TESTS < <(kernel_test_paths)
step kernel_tests $([ "$GPU" = 1 ] && echo 150 || echo 900) "${INTERP[@]}" "$PY" -m pytest -v -rfE --durations=15 \
    -p no:cacheprovider "${XDIST[@]}" --rootdir "$ROOT" "${KERNEL_TESTS[@]}"

# The model folder: dummy weights of the run's geometry and its Hadamard rotations (servers, calibration).
if [ "$GPU" = 1 ]; then
    # The servers get what is left of DEVICE_LIMIT_S (the device tool's timeout_s, less a margin), less what the
    # kernel benchmark after them needs (serve_seconds): at least 150 s in a whole run, never more than is left.
    # 32k input only: every goal is stated at 32k, and in the first H200 run (2026-12-04) the servers' 226 s
    # did not reach past 32k (each bench_serving call costs ~15 s before its first request).
    reserve=0; wanted bench_kernels && reserve=$(( ${BENCH_BUDGET_S:-80} + 90 ))
    GEOM=llama3-8b; SERVE=(--input-lens 32768 --output-len 256 --kv-budget-gib 16 --run-timeout 120
                           --max-concurrency-cap 256)
else
    GEOM=llama-d128-small; SERVE=(--input-lens 256 --output-len 8 --kv-budget-gib 1 --run-timeout 200
                                  --max-concurrency-cap 4)
fi
HAVE_MODELS=0
if [ -d "$BUNDLE/tokenizer" ] && wanted models; then
    step models 60 "$PY" "$ROOT/scripts/dummy_models.py" --tokenizer "$BUNDLE/tokenizer" --out "$WORK/models" \
        --geometry "$GEOM" --hadamard && HAVE_MODELS=1
fi
if [ "$HAVE_SGLANG" = 1 ] && [ "$HAVE_MODELS" = 1 ]; then
    probe_prefill $([ "$GPU" = 1 ] && echo 60 || echo 300)
    if [ "$GPU" = 1 ]; then
        serve_s=$(serve_seconds $(( DEVICE_LIMIT_S - (SECONDS - T0) - 30 )) "$reserve")
    else
        serve_s=400
    fi
    mapfile -t SERVER_ENV < <(servers_env)
    [ "${#SERVER_ENV[@]}" -gt 1 ] && echo "== the servers run on the machine's triton: torch's compiler (inductor)" \
        "failed with the bundle's in the triton step" | tee -a "$RES/summary.txt"
    # shellcheck disable=SC2086  # SERVE_CACHES and SERVE_ARGS are lists of words
    step servers $((serve_s + 30)) "${SERVER_ENV[@]}" "$PY" "$ROOT/scripts/device/serve_bench.py" --model "$WORK/models/$GEOM" \
        --rotations "$WORK/models/$GEOM-hadamard" --dummy --dataset-path "$BUNDLE/sharegpt_shakespeare.json" \
        --out "$RES" --time-limit "$serve_s" --caches ${SERVE_CACHES:-bf16 oscar-int2} "${SERVE[@]}" ${SERVE_ARGS:-}
    # Tensor parallelism on a machine with several GPUs: the INT2 server over 2 ranks (each rank serves the
    # rotations of its KV heads), 8k input only.
    if [ "$GPU" = 1 ] && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]; then
        step servers_tp2 $((serve_s + 30)) "${SERVER_ENV[@]}" "$PY" "$ROOT/scripts/device/serve_bench.py" --model "$WORK/models/$GEOM" \
            --rotations "$WORK/models/$GEOM-hadamard" --dummy --dataset-path "$BUNDLE/sharegpt_shakespeare.json" \
            --out "$RES" --caches oscar-int2 --tp 2 --tag _tp2 --input-lens 8192 --kv-budget-gib 16 --time-limit 240
    fi
    stop_servers  # whatever a timed-out servers step left: the kernel benchmark needs the GPU's memory
fi

if [ "$GPU" = 1 ]; then
    step bench_kernels $(( ${BENCH_BUDGET_S:-80} + 70 )) "$PY" "$ROOT/scripts/bench_kernels.py" --out "$RES" \
        --budget-s "${BENCH_BUDGET_S:-80}" --extend-budget-s 20
else
    step bench_kernels 450 "${INTERP[@]}" "$PY" "$ROOT/scripts/bench_kernels.py" --out "$RES" --cpu-smoke
fi
# The issue's four goals judged from the reports (measured value, goal, met or not): into the summary.
{ echo "== goals (scripts/device/goals.py)"; "$PY" "$ROOT/scripts/device/goals.py" "$RES" 2>&1; } | tee -a "$RES/summary.txt"
# The calibration pipeline's speed where the model runs: the models step's geometry with random weights
# built on the device, statistics captured there, the fit on the CPU (accuracy is not measured here).
# On the GPU it gets what is left of DEVICE_LIMIT_S (at most 180 s), so the script ends before the tool stops it.
cal_s=300; [ "$GPU" = 1 ] && cal_s=$(( DEVICE_LIMIT_S - (SECONDS - T0) )) && cal_s=$(( cal_s > 180 ? 180 : cal_s ))
if ! wanted calibration; then
    echo "== calibration: skipped (ONLY=$ONLY)" | tee -a "$RES/summary.txt"
elif [ "$HAVE_MODELS" = 1 ] && [ "$cal_s" -lt 30 ]; then
    echo "== calibration: skipped (${cal_s} s left of DEVICE_LIMIT_S)" | tee -a "$RES/summary.txt"
elif [ "$HAVE_MODELS" = 1 ]; then
    # oscar-calibrate's default pipeline (OptR and the precision policy) on the geometry's first layers: the fit
    # and the policy work layer by layer, so their seconds per layer scale to the whole model
    step calibration "$cal_s" "$PY" "$ROOT/scripts/device/calibrate_bench.py" \
        --model "$WORK/models/$GEOM" --text "$BUNDLE/sharegpt_shakespeare.json" --out "$RES" \
        $([ "$GPU" = 1 ] && echo "--layers 4" || echo "--layers 1 --tokens 2048")
fi
# The one rerun the warm machine allows, decided from this run's summary and reports (docs/GPU.md, "After the
# first run"): last in the output, so the device tool's reply shows it.
"$PY" "$ROOT/scripts/device/next_rerun.py" "$RES" 2>&1 | tee -a "$RES/summary.txt"
echo "== done in $((SECONDS - T0)) s, rc=$rc" | tee -a "$RES/summary.txt"
kill "$PUBLISHER" 2>/dev/null; wait "$PUBLISHER" 2>/dev/null
publish
rm -rf "$WORK"
exit $rc
