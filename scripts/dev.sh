#!/usr/bin/env bash
# One entry point for newcomers and CI: `scripts/dev.sh demo` runs the main job,
# `scripts/dev.sh test` runs the test suite. Each first makes sure .venv is installed (idempotent).
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

cmd="${1:-}"
shift || true
case "$cmd" in
  demo)
    ensure_venv
    exec "$venv/bin/kvtransfer" demo "$@"
    ;;
  test)
    ensure_venv
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    exec "$venv/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: scripts/dev.sh demo|test [args...]" >&2
    exit 2
    ;;
esac
