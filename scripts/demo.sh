#!/usr/bin/env bash
# The first thing to run: set up quietly, bring the whole stack up on this machine (`tinkerflow up`) and teach its
# model Pig Latin with the unmodified tinker SDK (scripts/demo_learn.py), until it translates a phrase it was taught.
#
#   bash scripts/demo.sh [--keep-up] [tinkerflow up flags...]
#
# --keep-up keeps the stack up afterwards, to look at the run in the console (Ctrl-C stops it); without it the
# stack stops and the last lines say how to bring the run back. Other arguments go to `tinkerflow up` (see
# `.venv/bin/tinkerflow up --help`), e.g. --port 8100 or --state-dir /tmp/demo.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
up_flags=()
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "$0"
      exit 0
      ;;
    *) up_flags+=("$arg") ;;
  esac
done
echo "demo: 1/2 setting up .venv (quiet; pip's output goes to .tinkerflow/setup.log)"
scripts/setup.sh
echo "demo: 2/2 starting the stack and training its model with the tinker SDK (the first start compiles: ~1 min)"
# The SDK imports transformers for the tokenizer only; without torch (a client needs none) it warns on import that
# "PyTorch was not found". Its advisory warnings are off for the script.
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1
status=0
.venv/bin/tinkerflow up "${up_flags[@]}" -- .venv/bin/python scripts/demo_learn.py || status=$?
if [ "$status" = 0 ]; then
  echo "demo: the model learned; $((SECONDS - started)) s in all."
else
  echo "demo: the model did not learn (exit $status) after $((SECONDS - started)) s; the stack's logs are in" \
    ".tinkerflow/logs (or under the --state-dir given)." >&2
fi
exit "$status"
