#!/usr/bin/env bash
# A lent device's one call, prepared: the engine alone (benchmarks/device_check.py), then the whole stack on a random
# Qwen3-8B (benchmarks/device_stack.py, through benchmarks/device_bootstrap.sh: carry .whl, built here by
# `python -m benchmarks.device_bundle`). Each part's JSON lines and log land under $OUT (the device tool's folder
# that comes back), whatever the other part did.
#
#   bash benchmarks/device_session.sh [check|stack|both] [CHECK_BUDGET_S]
#
# `both` with the default 300 s budget for the check is planned to end inside 9 minutes on an H100/H200: the
# check's phases skip themselves past their budget, and the stack part is cut at STACK_LIMIT_S (default 330).
set -uo pipefail
part=${1:-both}
budget=${2:-300}
out=${OUT:-/tmp/device-session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
if [ "$part" != stack ]; then
  timeout $((budget + 90)) python3 -m benchmarks.device_check --budget-s "$budget" --out "$out/check.jsonl" \
    > "$out/check.log" 2>&1
  echo "device_check: rc=$? ($(wc -l < "$out/check.jsonl" 2>/dev/null || echo 0) lines)"
fi
if [ "$part" != check ]; then
  timeout "${STACK_LIMIT_S:-330}" bash benchmarks/device_bootstrap.sh python3 -m benchmarks.device_stack \
    --shape qwen3-8b --concurrency 64 > "$out/stack.jsonl" 2> "$out/stack.log"
  echo "device_stack: rc=$? ($(grep -c '^{' "$out/stack.jsonl" 2>/dev/null || echo 0) lines)"
fi
tail -n 5 "$out"/*.log
