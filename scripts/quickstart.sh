#!/usr/bin/env bash
# README's main command: set up .venv (idempotent), then run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/quickstart.py "$@"
