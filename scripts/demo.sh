#!/usr/bin/env bash
# Set up, bring the whole stack up on this machine and run the Pig Latin training loop against it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
script="${PIG_LATIN:-../shared/acceptance/pig_latin.py}"
if [ ! -f "$script" ]; then
  echo "no Pig Latin script at $script (set PIG_LATIN=path/to/pig_latin.py)" >&2
  exit 2
fi
exec .venv/bin/tinkerflow up "$@" -- .venv/bin/python "$script"
