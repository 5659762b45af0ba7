#!/usr/bin/env bash
# Set up (with the test and reference-numerics extras) and run every test: unit, workflow, engine parity, end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,parity,cookbook,ray
# checkov checks infra/ offline; it gets its own venv because its pins would downgrade packages of ours.
if [ ! -x .venv-checkov/bin/checkov ]; then
  "${PYTHON:-python3}" -m venv .venv-checkov
  .venv-checkov/bin/python -m pip install --quiet "checkov==3.3.30"
fi
export CHECKOV="$PWD/.venv-checkov/bin/checkov"
export HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
# Lint, format and types first (scripts/lint.sh); TINKERFLOW_LINT=0 skips them for a quick run of a few tests.
if [ "${TINKERFLOW_LINT:-1}" != "0" ]; then
  bash scripts/lint.sh
fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
