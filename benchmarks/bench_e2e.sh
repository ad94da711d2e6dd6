#!/usr/bin/env bash
# Device wrapper for benchmarks/bench_e2e.py (GPU host, after shared/gpu/receive.sh printed READY, same device
# call; plugin wheel in .gpuwork/whl as for gpu_vllm_fidelity.sh, see NOTES.md):
#
#   bash benchmarks/bench_e2e.sh BUDGET_S [more bench_e2e.py args, e.g. --enforce-eager | --only ours]
#
# Installs the wheel into /root/gpu-env/plugin, sources shared/gpu/env.sh, then runs ours and in-tree one after
# the other, each limited to half of what is left of BUDGET_S. Everything goes to $OUT/bench_e2e.
set -u
BUDGET=${1:-560}; shift || true
T0=$SECONDS
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT/bench_e2e"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -m pip install -q --upgrade --no-index --no-deps --target /root/gpu-env/plugin .gpuwork/whl/*.whl && echo plugin installed
} >>"$OUT/bench_e2e/setup.log" 2>&1
source shared/gpu/env.sh || { echo "env.sh: stack not READY"; exit 1; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_DEEP_GEMM_WARMUP=skip
python3 -c "import torch, vllm, vllm_deepinfer; print('torch', torch.__version__, 'vllm', vllm.__version__, vllm_deepinfer.__file__)" >>"$OUT/bench_e2e/setup.log" 2>&1
tail -3 "$OUT/bench_e2e/setup.log"
LEFT=$((BUDGET - (SECONDS - T0) - 15))
N=2; case " $* " in *" --only "*) N=1;; esac
timeout -k 5 $LEFT python3 benchmarks/bench_e2e.py --out "$OUT/bench_e2e" --timeout $((LEFT / N - 5)) "$@"
echo "done t=$((SECONDS - T0)) s"
