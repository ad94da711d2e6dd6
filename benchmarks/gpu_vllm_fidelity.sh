#!/usr/bin/env bash
# GPU host, after shared/gpu/receive.sh printed READY (same device call; see NOTES-gpu-vllm.md):
#
#   bash benchmarks/gpu_vllm_fidelity.sh BUDGET_S ["v41 v4"]
#
# Installs the plugin wheel (.gpuwork/whl) into /root/gpu-env/plugin, then for each arch runs vLLM's in-tree
# model (DEEPINFER_DISABLE=1, background: its cold JIT start is the long pole) and, in parallel, the plugin
# (bf16; for v41 also fp32) on .gpuwork/ckpt-ARCH with .gpuwork/prompts.json. Every engine: eager, fixed
# 4 GiB KV (no device-global memory profiling, so the two engines can share the GPU), JIT warm-up off.
# Results (rewritten after every prompt) and logs go to $OUT; everything stops before BUDGET_S.
set -u
BUDGET=${1:-540}
ARCHS=${2:-v41 v4}
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
W=.gpuwork
LOCAL=${FIDELITY_LOCAL:-0}   # 1: smoke test of this script on a CPU machine with vLLM + plugin installed
[ "$LOCAL" = 1 ] || {
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -m pip install -q --upgrade --no-index --no-deps --target /root/gpu-env/plugin $W/whl/*.whl && echo plugin installed
} >>"$OUT/setup.log" 2>&1
[ "$LOCAL" = 1 ] || source shared/gpu/env.sh || { echo "env.sh: stack not READY"; exit 1; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_DEEP_GEMM_WARMUP=skip
python3 -c "import torch, vllm, vllm_deepinfer, kernels_nvidia; print('torch', torch.__version__, 'vllm', vllm.__version__, vllm_deepinfer.__file__, 'kernels_nvidia', kernels_nvidia.available())" >>"$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"
F="python3 benchmarks/gpu_vllm_fidelity.py run --prompts $W/prompts.json --kv-bytes 4 --no-jit-warmup --gpu-mem 0.15"

start_intree() {  # arch
  echo "== $(date +%T) t=$((SECONDS - T0)) intree $1 start (limit $(($(left) - 12)) s)" | tee -a "$OUT/intree.log"
  # V4.1: text-only, since vLLM's in-tree multimodal path hard-codes the release image id 129264.
  local extra=""; [ "$1" = v41 ] && extra="--text-only"
  timeout -k 5 $(($(left) - 12)) $F --impl intree $extra --ckpt $W/ckpt-$1 --out "$OUT/intree_$1.json" >>"$OUT/intree.log" 2>&1 &
}
run_ours() {  # arch dtype name
  [ "$(left)" -lt 60 ] && { echo "skip ours $1 $2: $(left) s left"; return; }
  echo "== $(date +%T) t=$((SECONDS - T0)) ours $1 $2 start" | tee -a "$OUT/ours.log"
  timeout -k 5 $(($(left) - 12)) $F --impl ours --dtype "$2" --ckpt $W/ckpt-$1 --out "$OUT/$3.json" >>"$OUT/ours.log" 2>&1
  echo "== t=$((SECONDS - T0)) ours $1 $2 rc=$?" | tee -a "$OUT/ours.log"
  grep -E "^\[ours\]" "$OUT/ours.log" | tail -5
}

# in-tree of the first arch starts at once; the second arch's in-tree starts after our first bf16 run
set -- $ARCHS
PIDS=()
start_intree "$1"; PIDS+=($!)
run_ours "$1" bfloat16 "ours_$1"
if [ $# -gt 1 ]; then
  if [ "$(left)" -gt 150 ]; then start_intree "$2"; PIDS+=($!); else echo "skip intree $2: $(left) s left"; fi
fi
[ "$1" = v41 ] && run_ours "$1" float32 "ours32_$1"
[ $# -gt 1 ] && run_ours "$2" bfloat16 "ours_$2"
for p in "${PIDS[@]}"; do wait "$p"; echo "== t=$((SECONDS - T0)) intree pid $p rc=$?" | tee -a "$OUT/intree.log"; done
grep -E "^\[intree\]|^== |Error|Exception" "$OUT/intree.log" | tail -25
for arch in $ARCHS; do
  [ -f "$OUT/intree_$arch.json" ] && [ -f "$OUT/ours_$arch.json" ] &&
    python3 benchmarks/gpu_vllm_fidelity.py compare "$OUT/ours_$arch.json" "$OUT/intree_$arch.json" 2>&1 | head -8
done
echo "done t=$((SECONDS - T0)) s"
