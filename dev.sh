#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh launch [digenrl launch args...]   set up, then run the main job (embedded default)
#   ./dev.sh test   [pytest args...]           set up, then ruff + mypy + the test suite
# Set-up is idempotent: a venv in .venv (override with DIGENRL_VENV), torch first, then the
# package with its test extra. torch goes in first and explicitly so that pip never swaps a
# CPU build for a multi-GB CUDA build (or the reverse): on a machine with an NVIDIA driver
# the default PyPI wheel (CUDA) is taken, otherwise the CPU build (DIGENRL_TORCH overrides).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DIGENRL_VENV:-.venv}
PY="$VENV/bin/python"

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    local spec=${DIGENRL_TORCH:-}
    if [ -z "$spec" ]; then
      if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        spec="torch>=2.4"          # PyPI's default Linux wheel is the CUDA build
      else
        spec="torch==2.13.0"       # the CPU build this machine kind keeps on disk
      fi
    fi
    echo "dev.sh: installing $spec" >&2
    "$PY" -m pip install -q "$spec"
  fi
  local stamp="$VENV/.digenrl-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # editable installs need setuptools >= 64 (PEP 660); a fresh 3.11 venv may have older
    "$PY" -m pip install -q "setuptools>=68"
    "$PY" -m pip install -q --no-build-isolation -e ".[test]"
    touch "$stamp"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  launch)
    setup
    exec "$VENV/bin/digenrl" launch "$@" ;;
  test)
    setup
    "$VENV/bin/ruff" check digenrl tests bench
    "$VENV/bin/mypy"
    exec "$PY" -m pytest -q "$@" ;;
  setup)
    setup ;;
  *)
    echo "usage: ./dev.sh launch [args] | ./dev.sh test [pytest args]" >&2
    exit 2 ;;
esac
