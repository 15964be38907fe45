#!/usr/bin/env bash
# The GPU stage: vLLM's CUDA build (vllm==0.32.0 from PyPI) with kvtransfer's UcxConnector, a
# prefill and a decode server sharing one NVIDIA GPU, checked by vllm_stage/check_pd_gpu.py for
# FlashAttention and FlashInfer. Needs nvidia-smi, a driver new enough for the CUDA of vLLM's
# torch wheel, python3 >= 3.11 with venv, and a package index. Not run yet: no GPU was lent
# while it was written (docs/vllm.md lists what it would verify).
#
# Runs, each a prefill and a decode started one after the other (vLLM's memory profiling must
# not see the other server grow), each with --gpu-memory-utilization 0.35:
#   1. FLASH_ATTN, eager, vLLM's default layout (NHD)   4. FLASHINFER, eager
#   2. FLASH_ATTN, eager, VLLM_KV_CACHE_LAYOUT=HND        5. kv_buffer_device "cpu" refused
#   3. FLASH_ATTN, CUDA graphs (full and piecewise)
# and, only with two GPUs or more, PP 2 -> PP 1 and PP 1 -> PP 2 (FLASH_ATTN): vLLM's worker
# for PP rank 1 asks for a second device, so PP 2 cannot run on one GPU.
#
# Environment: VLLM_GPU_VENV (default .vllm-gpu-venv), VLLM_GPU_STAGE_DIR (.vllm-gpu-stage),
# PYTHON (python3), GPU_STAGE_DATA_PLANE (rma | tagged, default rma). Never skips a check: an
# install that fails, or FlashInfer missing from vLLM's dependencies, fails the stage.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VLLM_GPU_VENV:-$root/.vllm-gpu-venv}"
work="${VLLM_GPU_STAGE_DIR:-$root/.vllm-gpu-stage}"
py="${PYTHON:-python3}"
plane="${GPU_STAGE_DATA_PLANE:-rma}"

fail() { echo "[vllm-gpu-stage] FAILED: $*" >&2; exit 1; }
say() { echo "[vllm-gpu-stage] $*" >&2; }

command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: this stage needs an NVIDIA GPU"
gpus="$(nvidia-smi -L | grep -c '^GPU ' || true)"
[ "$gpus" -ge 1 ] || fail "nvidia-smi lists no GPU"
say "$gpus GPU(s): $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"

stamp="$venv/.installed"
if [ ! -f "$stamp" ] || [ "$stamp" -ot pyproject.toml ]; then
  say "installing vllm==0.32.0 (CUDA) and kvtransfer into $venv ..."
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || fail "cannot create $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2 || fail "cannot upgrade pip"
  "$venv/bin/python" -m pip install -q "vllm==0.32.0" >&2 \
    || fail "pip could not install vllm==0.32.0 (see above)"
  # kvtransfer without its torch requirement, so vLLM's CUDA torch stays; then its other
  # dependencies (ucxx-cu12 brings UCX with CUDA transports; nixl is not needed).
  "$venv/bin/python" -m pip install -q --no-deps -e . >&2 || fail "cannot install kvtransfer"
  "$venv/bin/python" - <<'PY' > "$venv/kvtransfer-requirements.txt" || fail "cannot read pyproject.toml"
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
PY
  "$venv/bin/python" -m pip install -q -r "$venv/kvtransfer-requirements.txt" >&2 \
    || fail "cannot install kvtransfer's dependencies next to vLLM"
  touch "$stamp"
fi
"$venv/bin/python" - <<'PY' || fail "vLLM's CUDA build, its torch or kvtransfer.integrations.vllm is unusable in $venv"
import torch
import vllm
import kvtransfer.integrations.vllm  # noqa: F401
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(0)}")
PY
"$venv/bin/python" -c "import flashinfer" \
  || fail "flashinfer does not import in $venv (vLLM's CUDA wheel is expected to bring it)"

mkdir -p "$work"
HF_HUB_OFFLINE=1 "$venv/bin/python" vllm_stage/make_tiny_llama.py "$work/tiny-llama" >/dev/null 2>&1 \
  || fail "cannot build the tiny Llama checkpoint"

check() {
  say "check_pd_gpu.py $*"
  "$venv/bin/python" vllm_stage/check_pd_gpu.py --model "$work/tiny-llama" \
    --logs "$work/logs" --data-plane "$plane" "$@" || fail "check_pd_gpu.py $* (logs: $work/logs)"
}
check --backend FLASH_ATTN
check --backend FLASH_ATTN --kv-cache-layout HND
check --backend FLASH_ATTN --cuda-graphs
check --backend FLASHINFER
check --host-staging-refused
if [ "$gpus" -ge 2 ]; then
  check --backend FLASH_ATTN --prefill-pp 2
  check --backend FLASH_ATTN --decode-pp 2
else
  say "PP 2 not run: one GPU (vLLM's PP rank 1 worker needs a second device)"
fi
say "passed"
