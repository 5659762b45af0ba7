#!/usr/bin/env bash
# Set up (with the test and reference-numerics extras) and run every test: unit, workflow, engine parity, end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,parity
export HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
