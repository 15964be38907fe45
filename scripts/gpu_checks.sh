#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine with no network (what CI cannot do):
#
#   1. wheels carried in .whl/ (what the machine's Python lacks: ucxx, pydantic, grpcio...)
#      installed into /tmp/site; the repository itself on PYTHONPATH, with its entry points
#      (the connector registry reads them) written as a dist-info from pyproject.toml;
#   2. the machine: nvidia-smi, torch/CUDA, UCX's version and transports (cuda_copy/cuda_ipc);
#   3. benchmarks/transfer_gpu.py (tagged and RMA pulls, and pushes, between processes on the
#      GPU, checked bitwise, beside UCX's own get and put limits), three ways: through the
#      peers' CUDA IPC handles (kvtransfer's default), through UCX's cuda_ipc per run
#      (--no-cuda-ipc) with gets on (kvtransfer's UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on), and so
#      with UCX's own default (GET_AUTO below: gets off without NVLink);
#   4. the GPU tier: pytest -m gpu (tests/test_transport_cuda_ipc.py, tests/test_pd_gpu.py);
#      if it fails, its CPU twin (tests/test_daemons.py, the 1-to-1 equality test) runs as a
#      control in the same environment;
#   5. benchmarks/pd_latency.py --quick with the daemons on CUDA (KVTRANSFER_DEVICE=cuda), then
#      on CPU for comparison if time is left.
#
# Everything lands in $OUT (default /tmp/gpu_checks), 8 files: info.txt (with the protocol UCX
# picks for a GPU get), pytest.log, bench.log, transfer_gpu.json, transfer_gpu_ucx.json,
# transfer_gpu_get_auto.json, results.tar.gz (pd_latency's JSON and pictures, the daemons'
# logs) and summary.txt (each step's exit status and seconds). Steps share one deadline
# (GPU_CHECKS_DEADLINE_S, default 400 s from the start): a step that would run past it is cut
# short or skipped, and says so in summary.txt.
#
# Wheels (here, once; .whl/ is ignored through .git/info/exclude and travels with `carry`):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME==VERSION
# GPU_CHECKS_WHEELS names another folder of wheels; GPU_CHECKS_NO_WHEELS=1 skips step 1 (an
# environment that has the project installed).
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEADLINE=${GPU_CHECKS_DEADLINE_S:-400}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d /tmp/gpu-checks.XXXXXX)
export TMPDIR=$WORK/tmp
mkdir -p "$TMPDIR"

# step NAME CAP_S LOG COMMAND...: runs COMMAND with at most CAP_S seconds, fewer if the
# deadline is nearer; output appended to LOG; status and duration to the summary.
step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((DEADLINE - SECONDS - 5))
    local limit=$((cap < left ? cap : left))
    if ((limit < 20)); then
        echo "$name: skipped (deadline: ${left}s left)" | tee -a "$SUMMARY"
        return 99
    fi
    local start=$SECONDS
    echo "===== $name (limit ${limit}s): $*" >>"$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - start))s (limit ${limit}s)" | tee -a "$SUMMARY"
    return $rc
}

if [ -z "${GPU_CHECKS_NO_WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${GPU_CHECKS_WHEELS:-$ROOT/.whl}"/*.whl >"$OUT/info.txt" 2>&1 || {
        echo "wheel install failed" | tee -a "$SUMMARY"
        exit 1
    }
    # The connector registry finds UcxConnector through the distribution's entry points.
    "$PY" - <<'EOF' >>"$OUT/info.txt" 2>&1
import tomllib
from pathlib import Path

project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path("/tmp/site") / f"kvtransfer-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: kvtransfer\nVersion: {project['version']}\n"
)
lines = ["[console_scripts]", *(f"{k} = {v}" for k, v in project["scripts"].items()), ""]
for group, entries in project["entry-points"].items():
    lines += [f"[{group}]", *(f"{k} = {v}" for k, v in entries.items()), ""]
(info / "entry_points.txt").write_text("\n".join(lines))
EOF
    export PYTHONPATH=$ROOT:/tmp/site
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

(
    echo "===== nvidia-smi"
    nvidia-smi 2>&1 || echo "(no nvidia-smi)"
    echo "===== python, torch, packages"
    "$PY" - <<'EOF' 2>&1
import importlib.metadata as md
import platform

import torch

print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for name in ("grpcio", "protobuf", "pydantic", "pyzmq", "ucxx-cu12", "libucx-cu12", "pytest",
             "numpy", "aiohttp", "kvtransfer"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
import kvtransfer.router.__main__  # noqa: F401
import kvtransfer.serve.daemon  # noqa: F401
from kvtransfer.connector.factory import KVConnectorFactory

print("connectors", sorted(KVConnectorFactory.discover()))
EOF
    echo "===== UCX"
    UCX_ROOT=$("$PY" -c "import libucx, os; print(os.path.dirname(libucx.__file__))" 2>/dev/null)
    if [ -n "$UCX_ROOT" ]; then
        export LD_LIBRARY_PATH=$UCX_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        "$UCX_ROOT/bin/ucx_info" -v 2>&1
        "$UCX_ROOT/bin/ucx_info" -d 2>&1 | grep -E "Memory domain|Transport|memory types|Device:" \
            | head -60
    else
        echo "(libucx not importable)"
    fi
) >>"$OUT/info.txt" 2>&1

# UCX turns cuda_ipc gets off where it finds no NVLink ("cuda-ipc get zcopy disabled as no
# nvlinks detected"): one-sided reads of GPU memory then run as software emulation through
# shared memory (0.5-0.8 GB/s on an H200 VM, 2026-11). kvtransfer sets the variable to "on"
# unless it is set; "auto" here is the operator choosing UCX's default, for the A/B.
GET_AUTO=(env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto)

# Which protocol UCX picks for a cross-process get of GPU memory, both ways.
(
    UCX_ROOT=$("$PY" -c "import libucx, os; print(os.path.dirname(libucx.__file__))" 2>/dev/null)
    [ -n "$UCX_ROOT" ] || exit 0
    export LD_LIBRARY_PATH=$UCX_ROOT/lib UCX_WARN_UNUSED_ENV_VARS=n UCX_PROTO_INFO=y
    for setting in auto on; do
        port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
        echo "===== ucx_perftest ucp_get -m cuda, CUDA_IPC_ENABLE_GET_ZCOPY=$setting"
        UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$setting "$UCX_ROOT/bin/ucx_perftest" -p "$port" >/dev/null 2>&1 &
        server=$!
        for _ in $(seq 50); do
            out=$(UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$setting timeout 60 "$UCX_ROOT/bin/ucx_perftest" \
                127.0.0.1 -p "$port" -t ucp_get -m cuda -s 16777216 -n 20 -w 2 2>&1)
            grep -q "Connection refused" <<<"$out" || break
            sleep 0.2 # the server is still starting: retry (not synchronisation)
        done
        grep -A2 "remote memory read" <<<"$out"
        grep -E "Final:|ERROR" <<<"$out"
        kill "$server" 2>/dev/null
        wait "$server" 2>/dev/null
    done
) >>"$OUT/info.txt" 2>&1

# transfer_gpu: through the peers' CUDA IPC handles (kvtransfer's default), then UCX's
# cuda_ipc per run (--no-cuda-ipc) with gets on, then with UCX's default.
step "transfer_gpu" 120 "$OUT/bench.log" \
    "$PY" benchmarks/transfer_gpu.py --json "$OUT/transfer_gpu.json"
step "transfer_gpu, UCX" 100 "$OUT/bench.log" \
    "$PY" benchmarks/transfer_gpu.py --no-cuda-ipc --no-perftest --json "$OUT/transfer_gpu_ucx.json"
step "transfer_gpu, UCX, GET auto" 100 "$OUT/bench.log" \
    "${GET_AUTO[@]}" "$PY" benchmarks/transfer_gpu.py --no-cuda-ipc --no-perftest \
    --json "$OUT/transfer_gpu_get_auto.json"

PYTEST=("$PY" -m pytest -p no:cacheprovider -v -rA)
GPU_TESTS=(tests/test_transport_cuda_ipc.py tests/test_pd_gpu.py)
step "pytest -m gpu" 150 "$OUT/pytest.log" \
    "${PYTEST[@]}" -m gpu --basetemp="$WORK/pt-gpu" "${GPU_TESTS[@]}"
if [ $? -ne 0 ]; then
    step "control: CPU twin" 90 "$OUT/pytest.log" "${PYTEST[@]}" --basetemp="$WORK/pt-cpu" \
        "tests/test_daemons.py::test_disaggregated_equals_colocated_and_counters_show_the_transfer"
fi

# pd_latency writes a picture next to its JSON: both go into results.tar.gz ($OUT takes 8 files).
RESULTS=$WORK/results
mkdir -p "$RESULTS"
step "pd_latency cuda" 100 "$OUT/bench.log" \
    env KVTRANSFER_DEVICE=cuda "$PY" benchmarks/pd_latency.py --quick \
    --json "$RESULTS/pd_latency_cuda.json"
step "pd_latency cpu" 90 "$OUT/bench.log" \
    "$PY" benchmarks/pd_latency.py --quick --json "$RESULTS/pd_latency_cpu.json"

# Results and the daemons' logs (pytest's tmp_path, pd_latency's kept log folders).
tar -czf "$OUT/results.tar.gz" -C "$WORK" . 2>/dev/null
echo "total ${SECONDS}s" | tee -a "$SUMMARY"
