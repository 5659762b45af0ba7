#!/usr/bin/env bash
# Create .venv (Python 3.11) and install tinkerflow with the given extras, e.g. `scripts/setup.sh test,parity`.
# Everything comes from the package registries; nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
# torch (parity extra) must be the CPU wheel: the local wheel index serves it; never a bare CUDA torch.
.venv/bin/python -m pip install --quiet -e "$spec"
# The cookbook extra: tinker-cookbook 0.6.1 itself without its declared dependencies (its tml-renderers>=0.4.1 pin
# is not in the registry); the extra lists what it really imports. See pyproject.toml.
case ",${extras}," in
  *,cookbook,*) .venv/bin/python -m pip install --quiet --no-deps "tinker-cookbook==0.6.1" ;;
esac
# pyright (and editors using it) cannot follow the mapped editable install: link tinkerflow.* into build/pyright.
.venv/bin/python scripts/pyright_paths.py
