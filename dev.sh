#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh launch [digenrl launch args...]   set up, then run the main job (embedded default)
#   ./dev.sh test   [pytest args...]           set up, then ruff + mypy + the test suite (2 workers)
#   ./dev.sh lock                              refresh constraints.txt (see below)
# Set-up is idempotent: a venv in .venv (override with DIGENRL_VENV), torch first, then the
# package with its test and rewards extras. torch goes in first and explicitly so that pip never swaps a
# CPU build for a multi-GB CUDA build (or the reverse): on a machine with an NVIDIA driver
# the default PyPI wheel (CUDA) is taken, otherwise the CPU build (DIGENRL_TORCH overrides).
# Everything else is installed under constraints.txt, the lock: the exact versions the suite
# last ran green with, so CI tests what was tested and not last night's releases. `./dev.sh lock`
# rewrites it from a scratch venv with the newest releases pyproject.toml's ranges allow; run
# `./dev.sh test` after it and commit both if green.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DIGENRL_VENV:-.venv}
PY="$VENV/bin/python"
LOCK=constraints.txt
CPU_TORCH="torch==2.13.0"   # the CPU build this machine kind keeps on disk

torch_spec() {
  if [ -n "${DIGENRL_TORCH:-}" ]; then
    echo "$DIGENRL_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "torch>=2.4"              # PyPI's default Linux wheel is the CUDA build
  else
    echo "$CPU_TORCH"
  fi
}

# install torch, then the package with its test and rewards extras (the model-reward tests run
# the real code); $2 = pip constraints args (the lock or none)
install_into() {
  local py=$1; shift
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    local spec; spec=$(torch_spec)
    echo "dev.sh: installing $spec" >&2
    "$py" -m pip install -q "$spec"
  fi
  # editable installs need setuptools >= 64 (PEP 660); a fresh 3.11 venv may have older
  "$py" -m pip install -q "$@" "setuptools>=68"
  "$py" -m pip install -q "$@" --no-build-isolation -e ".[test,rewards]"
}

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  local stamp="$VENV/.digenrl-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$LOCK" -nt "$stamp" ]; then
    install_into "$PY" -c "$LOCK"
    touch "$stamp"
  fi
}

lock() {
  local scratch; scratch=$(mktemp -d)
  python3 -m venv "$scratch/venv"
  install_into "$scratch/venv/bin/python"
  {
    echo "# The lock: exact versions the suite last ran green with (Python 3.11, Linux x86_64, CPU torch)."
    echo "# Used as pip constraints by ./dev.sh (set-up and tests) and so by CI; users' \`pip install digenrl\`"
    echo "# keeps pyproject.toml's ranges. torch is not here: dev.sh installs it first (see dev.sh)."
    echo "# Refresh: ./dev.sh lock   (newest releases in pyproject's ranges), then ./dev.sh test, then commit."
    "$scratch/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -E '^(torch|pip)=='
  } > "$LOCK.new"
  mv "$LOCK.new" "$LOCK"
  rm -rf "$scratch"
  git --no-pager diff --stat -- "$LOCK" || true
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
    # two workers (CI has two cores): launched runs spend much of their time waiting on
    # processes and sockets; tests that share a run through an xdist_group stay on one worker.
    # A later -n wins: ./dev.sh test -n 0 runs in this process.
    exec "$PY" -m pytest -q -n 2 --dist loadgroup "$@" ;;
  setup)
    setup ;;
  lock)
    lock ;;
  *)
    echo "usage: ./dev.sh launch [args] | ./dev.sh test [pytest args] | ./dev.sh lock" >&2
    exit 2 ;;
esac
