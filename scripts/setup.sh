#!/usr/bin/env bash
# Create .venv (Python 3.11) and install tinkerflow with the given extras, e.g. `scripts/setup.sh test,parity`.
# Everything comes from the package registries; nothing is downloaded at run time.
#
# Quiet by design: one line per stage with its time; pip's own output goes to the log ($TINKERFLOW_SETUP_LOG,
# default .tinkerflow/setup.log), whose path and last lines are printed when a stage fails. A second run with the
# same pyproject.toml and extras already installed skips the installs (TINKERFLOW_SETUP_FORCE=1 redoes them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
extras="${1:-}"
log="${TINKERFLOW_SETUP_LOG:-.tinkerflow/setup.log}"
mkdir -p "$(dirname "$log")"
: >"$log"
# setuptools' note on every mapped editable install ("be careful with folders named like your package") asks
# nothing of us: filtered by its text so that the log holds only what needs reading.
export PYTHONWARNINGS="ignore:Editable installation"

# stage NAME CMD...: run CMD with its output appended to the log; one line saying how long it took, or the log.
stage() {
  local name="$1" start=$SECONDS
  shift
  printf 'setup: %-34s' "$name" >&2
  echo "=== $name: $*" >>"$log"
  if "$@" >>"$log" 2>&1; then
    printf ' %4d s\n' $((SECONDS - start)) >&2
  else
    local rc=$?
    printf ' failed (exit %d after %d s)\n' "$rc" $((SECONDS - start)) >&2
    echo "setup: the whole output is in $log; it ends with:" >&2
    tail -n 25 "$log" | sed 's/^/  | /' >&2
    exit "$rc"
  fi
}

# What is installed: the hash of pyproject.toml and the extras, so an unchanged checkout is not reinstalled.
stamp=.venv/.tinkerflow-setup
project_hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
stamped() { [ -f "$stamp" ] && sed -n "s/^$1=//p" "$stamp"; }
up_to_date() {
  [ "${TINKERFLOW_SETUP_FORCE:-0}" = "0" ] && [ -x .venv/bin/tinkerflow ] || return 1
  [ "$(stamped pyproject || true)" = "$project_hash" ] || return 1
  local have want
  have=",$(stamped extras || true),"
  for want in ${extras//,/ }; do
    case "$have" in *",$want,"*) ;; *) return 1 ;; esac
  done
}

if up_to_date; then
  echo "setup: .venv is up to date (pyproject.toml unchanged${extras:+, extras $extras installed})" >&2
else
  previous=$(stamped extras || true)
  rm -f "$stamp"
  [ -x .venv/bin/python ] || stage "virtualenv (.venv, $("$PYTHON" --version 2>&1))" "$PYTHON" -m venv .venv
  stage "pip" .venv/bin/python -m pip install --upgrade pip
  # Extras installed before stay installed: the union is recorded, so a later run asking for either skips.
  all=$(echo "${previous},${extras}" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
  spec="."
  [ -n "$all" ] && spec=".[${all}]"
  # torch (parity extra) must be the CPU wheel: the local wheel index serves it; never a bare CUDA torch.
  stage "tinkerflow${all:+ [$all]}" .venv/bin/python -m pip install -e "$spec"
  # The cookbook extra: tinker-cookbook 0.6.1 itself without its declared dependencies (its tml-renderers>=0.4.1
  # pin is not in the registry); the extra lists what it really imports. See pyproject.toml.
  case ",${all}," in
    *,cookbook,*) stage "tinker-cookbook (no deps)" .venv/bin/python -m pip install --no-deps "tinker-cookbook==0.6.1" ;;
  esac
  printf 'pyproject=%s\nextras=%s\n' "$project_hash" "$all" >"$stamp"
fi
# pyright (and editors using it) cannot follow the mapped editable install: link tinkerflow.* into build/pyright.
stage "type checker's import paths" .venv/bin/python scripts/pyright_paths.py
