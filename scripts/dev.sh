#!/usr/bin/env bash
# One entry point for newcomers and CI: `scripts/dev.sh demo` runs the main job,
# `scripts/dev.sh test` runs the test suite. Each first makes sure .venv is installed (idempotent);
# `test` also .aiperf-venv (`scripts/dev.sh aiperf` alone).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"

ensure_venv() {
  local stamp="$venv/.installed"
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    return
  fi
  echo "[dev] installing kvtransfer into $venv (first run only)..." >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  # The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
  "$venv/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$venv/bin/python" -m pip install -q -e ".[test]" >&2
  touch "$stamp"
}

# aiperf (a standard OpenAI load generator) in a virtual environment of its own: about 1.2 GB
# of dependencies kvtransfer does not need. tests/test_load_generator.py and
# benchmarks/load.py drive it against the router.
ensure_aiperf() {
  local aiperf="$root/.aiperf-venv"
  if [ -x "$aiperf/bin/aiperf" ] && [ -f "$aiperf/.installed" ]; then
    return
  fi
  echo "[dev] installing aiperf into $aiperf (first run only)..." >&2
  [ -x "$aiperf/bin/python" ] || "$py" -m venv "$aiperf"
  "$aiperf/bin/python" -m pip install -q --upgrade pip >&2
  if ! "$aiperf/bin/python" -m pip install -q "aiperf==0.13.0" >&2; then
    echo "[dev] FAILED to install aiperf==0.13.0 into $aiperf" >&2
    exit 1
  fi
  touch "$aiperf/.installed"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  demo)
    ensure_venv
    exec "$venv/bin/kvtransfer" demo "$@"
    ;;
  test)
    ensure_venv
    ensure_aiperf
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    exec "$venv/bin/python" -m pytest "$@"
    ;;
  aiperf)
    ensure_aiperf
    ;;
  *)
    echo "usage: scripts/dev.sh demo|test|aiperf [args...]" >&2
    exit 2
    ;;
esac
