#!/usr/bin/env bash
# One command: build the Triton 3.8 carry bundle for the GPU test machine into out/triton_bundle/ (prints its size).
# What it holds and why: scripts/device/build_triton_bundle.py; how it is used: docs/GPU.md.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
bash scripts/setup_env.sh >/dev/null
exec .venv/bin/python scripts/device/build_triton_bundle.py "$@"
