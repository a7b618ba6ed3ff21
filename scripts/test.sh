#!/usr/bin/env bash
# README's test command (and what .ci/run calls): set up .venv (idempotent), then run the test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
