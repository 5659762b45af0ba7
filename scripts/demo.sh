#!/usr/bin/env bash
# Set up, bring the whole stack up on this machine and run the Pig Latin training loop against it; then train the
# model until its sampled translation is right, draw the loss curve and print the console URL (scripts/demo_learn.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
script="${PIG_LATIN:-../shared/acceptance/pig_latin.py}"
if [ ! -f "$script" ]; then
  echo "no Pig Latin script at $script (set PIG_LATIN=path/to/pig_latin.py)" >&2
  exit 2
fi
# The clients import transformers for the tokenizer only; without torch (not needed by a client) it warns on import
# that "PyTorch was not found". Its advisory warnings are off for the scripts below.
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1
# shellcheck disable=SC2016  # $1 is expanded by the inner bash, which gets the script path as its argument
exec .venv/bin/tinkerflow up "$@" -- bash -c '.venv/bin/python "$1" && .venv/bin/python scripts/demo_learn.py' \
  demo "$script"
