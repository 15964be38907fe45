#!/usr/bin/env bash
# One entry point for newcomers and CI: `scripts/dev.sh demo` runs the main job,
# `scripts/dev.sh test` runs the test suite. Each first makes sure .venv is installed (idempotent);
# `test` also the system tools the suite drives (ip and ss, chromium, promtool: apt-get, as root
# or through sudo -n) and .aiperf-venv (`scripts/dev.sh aiperf` alone).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"

# pip, its output kept in a log and shown only when it fails: a newcomer's first screen is then
# the demo, not pip's and setuptools' notices (or warnings a machine's own pip config causes).
install_log="$root/.dev-install.log"
quiet_pip() {
  local python="$1" log="$install_log"
  shift
  if ! "$python" -m pip "$@" >>"$log" 2>&1; then
    echo "[dev] FAILED: pip $* (its output, from $log:)" >&2
    tail -n 60 "$log" >&2
    exit 1
  fi
}

ensure_venv() {
  local stamp="$venv/.installed"
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    return
  fi
  echo "[dev] installing kvtransfer into $venv (first run only)..." >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  quiet_pip "$venv/bin/python" install -q --upgrade pip
  # The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
  quiet_pip "$venv/bin/python" install -q "torch==2.13.0"
  quiet_pip "$venv/bin/python" install -q -e ".[test]"
  touch "$stamp"
}

# The system tools the suite drives, from Debian/Ubuntu packages: ip and ss (iproute2; the
# namespace tier, -m netns, builds test hosts with `ip netns` and veth pairs), chromium with a font
# (tests/test_router_dashboard.py drives the router's fleet page in it, headless) and promtool
# (prometheus; tests/test_deploy_dashboards.py checks and tests deploy/prometheus/'s rules).
# Installed with apt-get when missing, as root or through `sudo -n`; never skipped: without them
# those tests fail, so this stops first, naming what is missing.
ensure_system_tools() {
  local cmds=() pkgs=()
  if ! command -v ip >/dev/null 2>&1 || ! command -v ss >/dev/null 2>&1; then
    cmds+=(ip ss)
    pkgs+=(iproute2)
  fi
  command -v chromium >/dev/null 2>&1 || { cmds+=(chromium); pkgs+=(chromium fonts-dejavu-core); }
  command -v promtool >/dev/null 2>&1 || { cmds+=(promtool); pkgs+=(prometheus); }
  [ "${#pkgs[@]}" -gt 0 ] || return 0
  local sudo=() why=""
  if ! command -v apt-get >/dev/null 2>&1; then
    why="no apt-get here"
  elif [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
      sudo=(sudo -n)
    else
      why="not root, and sudo -n is not allowed"
    fi
  fi
  if [ -z "$why" ]; then
    echo "[dev] installing ${pkgs[*]} with apt-get (missing: ${cmds[*]})..." >&2
    if ! { ${sudo[@]+"${sudo[@]}"} apt-get update -qq >&2 \
      && ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null; }; then
      why="apt-get failed (see above)"
    fi
  fi
  local still=() cmd
  for cmd in "${cmds[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || still+=("$cmd")
  done
  if [ "${#still[@]}" -gt 0 ]; then
    echo "[dev] FAILED: the test suite needs ${still[*]} (packages: ${pkgs[*]}), and they could" \
      "not be installed: ${why:-apt-get installed the packages, but the commands are still missing}." \
      "Install them (e.g. sudo apt-get install ${pkgs[*]}) and run again." >&2
    exit 1
  fi
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
  quiet_pip "$aiperf/bin/python" install -q --upgrade pip
  quiet_pip "$aiperf/bin/python" install -q "aiperf==0.13.0"
  touch "$aiperf/.installed"
}

# aiperf's install beside the others (`test`): it shares no files with them, writes a log of
# its own, and is mostly downloads and unpacking, so the suite starts a minute or two sooner.
aiperf_pid=""
start_aiperf_install() {
  (install_log="$root/.dev-install-aiperf.log" && ensure_aiperf) &
  aiperf_pid=$!
  # Stopping early (a system tool missing, a failed install) stops it too.
  trap 'kill "$aiperf_pid" 2>/dev/null || true' EXIT
}
finish_aiperf_install() {
  if ! wait "$aiperf_pid"; then
    echo "[dev] FAILED: installing aiperf (see above)" >&2
    exit 1
  fi
  trap - EXIT
}

cmd="${1:-}"
shift || true
case "$cmd" in
  demo)
    ensure_venv
    exec "$venv/bin/kvtransfer" demo "$@"
    ;;
  test)
    start_aiperf_install
    ensure_system_tools
    ensure_venv
    finish_aiperf_install
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    # The package and the tests compiled once: this environment may set PYTHONDONTWRITEBYTECODE,
    # and then every daemon a test starts compiled kvtransfer again (0.6 s of CPU each).
    "$venv/bin/python" -m compileall -q kvtransfer tests >/dev/null
    # Two workers, a test module each (pytest-xdist): a test spends about 40% of its time
    # waiting on its daemons, so a second module's fill the cores meanwhile. Arguments after
    # `test` come later and win (`-n 0`: one process). KVTRANSFER_TEST_WORKERS sets the count.
    exec "$venv/bin/python" -m pytest -n "${KVTRANSFER_TEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
  aiperf)
    ensure_aiperf
    ;;
  *)
    echo "usage: scripts/dev.sh demo|test|aiperf [args...]" >&2
    exit 2
    ;;
esac
