#!/usr/bin/env bash
# One device call of the Hopper work (issue 3). Run from the repository root on the GPU host:
#
#   bash benchmarks/gpu_session.sh kernels          # host torch/triton: kernel tests + microbenchmarks
#   bash benchmarks/gpu_session.sh stage DIR        # one vLLM 0.32 chunk (../shared/gpu/receive.sh), see NOTES-gpu.md
#   (not yet: e2e fidelity plugin vs in-tree V4.1 and the serving benchmark; see NOTES-gpu.md)
#
# Logs and JSON go to $OUT (the device tool brings them back); the last lines printed are a summary.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/root/.triton/cache}
REPO=$(pwd)
mode=${1:-kernels}

kernels() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  # the leaf package must import without vllm / vllm_deepinfer
  python3 -c "import sys, kernels_nvidia; kernels_nvidia.load_ops(); assert 'vllm' not in sys.modules and 'vllm_deepinfer' not in sys.modules; print('kernels_nvidia leaf import ok, available =', kernels_nvidia.available())"
  local t0=$SECONDS
  PYTHONPATH=$REPO python3 -m pytest -q -s -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/kernel_tests.log" | grep -E "rel err|passed|failed|Error|error" | tail -60
  echo "kernel tests: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s"
  t0=$SECONDS
  PYTHONPATH=$REPO python3 benchmarks/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
  echo "kernel bench: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s"
  if [ "${EAGER:-0}" = 1 ]; then
    PYTHONPATH=$REPO python3 benchmarks/bench_kernels.py --eager --quick 2>&1 | grep -v "^  T=" > "$OUT/bench_kernels_eager.log"
  fi
}

case "$mode" in
  kernels) kernels ;;
  stage) bash "$REPO/shared/gpu/receive.sh" "$2" ;;
  *) echo "usage: $0 kernels|stage DIR" >&2; exit 2 ;;
esac
