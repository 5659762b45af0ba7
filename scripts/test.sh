#!/usr/bin/env bash
# Set up (with the test and reference-numerics extras) and run every test: unit, workflow, engine parity, end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
# Playwright (test extra) drives Debian's chromium for the console's browser test; its own browser download cannot
# be fetched here, so it must not try.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
scripts/setup.sh test,parity,cookbook,ray
# The console's browser test (tests/e2e/test_console.py) needs /usr/bin/chromium: install Debian's package when it is
# missing and we may (root, apt); otherwise that test skips and says why.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing chromium (apt) for the console's browser test" >&2
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
    || echo "chromium could not be installed: tests/e2e/test_console.py will skip" >&2
fi
# checkov checks infra/ offline; it gets its own venv because its pins would downgrade packages of ours.
if [ ! -x .venv-checkov/bin/checkov ]; then
  echo "setup: checkov in .venv-checkov (pip's output: .tinkerflow/setup-checkov.log)" >&2
  mkdir -p .tinkerflow
  { "${PYTHON:-python3}" -m venv .venv-checkov \
      && .venv-checkov/bin/python -m pip install "checkov==3.3.30"; } >.tinkerflow/setup-checkov.log 2>&1 \
    || { echo "setup: checkov failed to install; see .tinkerflow/setup-checkov.log" >&2; exit 1; }
fi
export CHECKOV="$PWD/.venv-checkov/bin/checkov"
export HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
# Lint, format and types first (scripts/lint.sh); TINKERFLOW_LINT=0 skips them for a quick run of a few tests.
if [ "${TINKERFLOW_LINT:-1}" != "0" ]; then
  bash scripts/lint.sh
fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
