#!/usr/bin/env bash
# One device call of the Hopper work (issue 3). Run from the repository root on the GPU host:
#
#   bash benchmarks/gpu_session.sh kernels          # host torch/triton: kernel tests + microbenchmarks
#   bash benchmarks/gpu_session.sh kernel-ab        # host torch, ~10 min on a fresh H100 (run it with a 600 s
#       limit): the invariant-mode GEMM A/B (FP8 SPLIT_FILL / SWAP_AB, fp32 output) and the MoE rows (tiles, stages,
#       routing glue), then the MoE / GEMM / attention / record kernel tests
#   bash benchmarks/gpu_session.sh linears          # after READY: FP8 linears, vLLM Marlin vs Triton vs bf16
#   bash benchmarks/gpu_session.sh stage DIR        # one vLLM 0.32 chunk (../shared/gpu/receive.sh), see NOTES-gpu.md
#   bash benchmarks/gpu_session.sh vllm BUDGET_S    # after READY: plugin wheel + tiny-gpu checkpoints, then
#       in-tree full-width benchmark (foreground) || the plugin's fidelity runs with CUDA graphs (background)
#   bash benchmarks/gpu_session.sh ours-bench BUDGET_S   # the plugin's full-width benchmark (+ profile), same --out
#   bash benchmarks/gpu_session.sh intree-bench BUDGET_S # vLLM in-tree full-width benchmark alone (the baseline column)
#   bash benchmarks/gpu_session.sh memo BUDGET_S    # fidelity on the memorised-head checkpoints (token identity
#       test): in-tree V4.1 + V4 (eager) || the plugin with CUDA graphs, exact and parity numerics
#       (needs .gpuwork/head-{v41,v4}.safetensors from benchmarks/memorize_head.py, see NOTES.md); also V4.1 with
#       Engram tables on the GPU vs the default host tables, and tests/gpu/test_shared_host_gpu.py
#   bash benchmarks/gpu_session.sh fw BUDGET_S      # a full-width reduced-depth V4.1 checkpoint made here by
#       make_checkpoint --preset full-width: in-tree (eager) || the plugin with CUDA graphs, exact and parity
#   bash benchmarks/gpu_session.sh engram BUDGET_S  # one GPU: DEEPINFER_ENGRAM_DEVICE=host vs gpu, CUDA graphs
#   bash benchmarks/gpu_session.sh spec BUDGET_S [ARCH] [DRAFTER]  # one GPU: bench_spec_decode.py on a tiny-gpu
#       checkpoint (v4.1-flash / v4-flash; --drafter reproduce / noise): off, fixed, varlen, in-tree (reproduce);
#       MODES=off,fixed picks modes, MODE_T caps each mode's seconds (engine start included)
#   bash benchmarks/gpu_session.sh spec-check BUDGET_S  # one GPU, ~5 min: tests/gpu/test_spec_decode_gpu.py (greedy
#       speculation == none with CUDA graphs on the memorised-head checkpoints: DSpark, MTP fixed, MTP varlen)
#   bash benchmarks/gpu_session.sh invariant BUDGET_S  # one GPU, ~8 min: tests/gpu/test_batch_invariance_gpu.py
#       (V1 runner, CASES=200; TESTS=... picks others) then bench_e2e --invariant (decode 1/16/64 + prefill)
#   bash benchmarks/gpu_session.sh tp BUDGET_S      # two GPUs: tensor_parallel_size 2 vs 1, CUDA graphs
#   bash benchmarks/gpu_session.sh dpep BUDGET_S    # two GPUs, ~9 min: `vllm serve --data-parallel-size 2
#       --enable-expert-parallel --enable-eplb` (2 redundant experts, rebalanced every 16 steps) vs one GPU on the
#       memorised-head V4.1 and V4 (token identity), then the served throughput of ours and in-tree on the protocol
#       model (full-width V4.1, 8 layers, 384 experts, dummy weights) under DP=2+EP (par_bench dpep)
#   bash benchmarks/gpu_session.sh par-bench tp|dpep BUDGET_S   # two GPUs, ~5 min: that served throughput alone
#       (in-tree then ours, `bench_serve.py --serve-args`), for TP=2 or DP=2+EP -> $OUT/bench-<par>.tgz
#   bash benchmarks/gpu_session.sh pytest ARGS...   # after READY: plugin wheel + tiny-gpu checkpoints, then pytest ARGS
#   bash benchmarks/gpu_session.sh jit-save [FIRST] # last call on a warm host: JIT caches -> $OUT/jit (copy that
#       folder to .gpuwork/jit here; the next host's first vllm_env restores it)
#   The benchmark protocol (issue 9; bench_e2e.py defaults: V4.1 release widths, 8 layers, 384 experts top-6,
#   packed storage on our side, 24 GiB KV both sides). Estimated device time on a staged host with JIT caches
#   restored (cold in-tree JIT adds minutes: see shared/gpu/README.md):
#   bash benchmarks/gpu_session.sh compact BUDGET_S      # ~8 min: in-tree then ours, prefill 1k/4k/16k + decode
#       1/16/64/256 (steady-state step times), REPS timed reps (default 1), graphs 1/16/64/256, no JIT warm-up -> $OUT/e2e.tgz
#   bash benchmarks/gpu_session.sh intree-bench|ours-bench BUDGET_S   # ~4-5 min each: the same, 3 reps, one side
#   bash benchmarks/gpu_session.sh ab BUDGET_S           # ~5 min: ours alone, default vs VLLM_DEEPINFER_FLASHMLA=1, vs
#       VLLM_DEEPINFER_DEEPGEMM_HC=1, vs both (prefill 1k/4k, decode 1/64/256; BENCH_ARGS as in compact) -> $OUT/ab_*
#   bash benchmarks/gpu_session.sh serve-intree|serve-ours BUDGET_S   # ~6 min each: vllm serve + vllm bench serve,
#       random 1024 in / 128 out, 200 prompts at concurrency 1, 8, 32, 128 -> $OUT/serve-<side>.tgz
#       (SERVE_ARGS adds bench_serve.py options; H100: SERVE_ARGS="--kv-gib 6 --num-prompts 32,64,128,256")
#   bash benchmarks/gpu_session.sh cold-ours|cold-intree BUDGET_S     # ours ~4 min, in-tree 5-10 min (each
#       launch capped at half the budget): serve -> first token, JIT caches cold then warm -> $OUT/cold-<side>.tgz
#   bash benchmarks/gpu_session.sh sweep-ours|sweep-intree BUDGET_S   # ~5-6 min each: vllm bench sweep + Pareto
#       plots (configs/serve-gpu1.json x configs/bench-gpu-pareto.json) -> $OUT/sweep-<side>.tgz
#   (then on CPU: python benchmarks/bench_e2e.py --report DIR; bench_serve.py --report DIR1 DIR2;
#    cold_start.py --report DIR1 DIR2 -> ours/in-tree tables with ratios)
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

kernel_ab() {  # host torch: the kernels of batch-invariant mode (the A/Bs that set their switches, then the tests;
  # on a fresh H100 the tests alone take ~6 min of triton compiles: give the call 600 s)
  PYTHONPATH=$REPO timeout 180 python3 benchmarks/bench_kernels.py --invariant-gemms > "$OUT/invariant_gemms.log" 2>&1
  echo "invariant gemms rc=$?"; grep -E "M=1 |ROWS DIFFER|fp32_out" "$OUT/invariant_gemms.log" | cut -c1-110 | tail -70
  PYTHONPATH=$REPO timeout 150 python3 benchmarks/bench_kernels.py --moe-only --quick > "$OUT/moe.log" 2>&1
  echo "moe rc=$?"; grep -E "E=384|BITS" "$OUT/moe.log" | cut -c1-110 | tail -40
  PYTHONPATH=$REPO timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_kernels.py \
    tests/gpu/test_gemm_kernels.py tests/gpu/test_kernels.py tests/gpu/test_kv_record_kernels.py 2>&1 \
    | tee "$OUT/kernel_tests.log" | grep -E "rel err|passed|failed|Error" | tail -20
}

vllm_env() {  # plugin wheel first, then env.sh (it puts /root/gpu-env/plugin on PYTHONPATH only if it exists)
  python3 -m pip install -q --upgrade --no-index --no-deps --target /root/gpu-env/plugin .gpuwork/whl/*.whl
  source shared/gpu/env.sh || { echo "env.sh: stack not READY"; exit 1; }
  export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_DEEP_GEMM_WARMUP=skip
  # FlashInfer's top-k/top-p sampler JIT-builds for minutes on a fresh host (2026-12-02: every spec-decode
  # engine killed at 160 s in "Building JIT module sampling"); vLLM's PyTorch sampler on both sides
  export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
  # JIT caches of an earlier host (DeepGEMM, TileLang, Triton, FlashInfer, torch.compile), see jit-save
  if [ -f .gpuwork/jit/jit.manifest ] && [ ! -f /root/gpu-stage/jit-restored ]; then
    bash shared/gpu/jit-cache.sh restore .gpuwork/jit | tail -1 && touch /root/gpu-stage/jit-restored
  fi
}

# The device returns at most 8 files per call: logs go to $LOGS and come back as one tarball (pack_logs),
# benchmark working files stay in /tmp/bench_e2e (only its JSON/log are copied to $OUT).
LOGS=/tmp/gpu-logs
mkdir -p "$LOGS"
BENCH="python3 benchmarks/bench_e2e.py --out /tmp/bench_e2e --no-jit-warmup"
pack_logs() { tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
keep_bench() { cp /tmp/bench_e2e/*.json /tmp/bench_e2e/*.log "$OUT/" 2>/dev/null; rm -f "$OUT/results.json"; }

make_checkpoints() {  # tiny-gpu checkpoints (generated here, byte-checked) and their memorised-head copies
  for a in "v4.1-flash v41" "v4-flash v4"; do
    set -- $a
    [ -d .gpuwork/ckpt-$2 ] || python3 -m vllm_deepinfer.tools.make_checkpoint --arch $1 --preset tiny-gpu \
      --out .gpuwork/ckpt-$2 > "$LOGS/make_$2.log" 2>&1
  done
  (cd .gpuwork && sha256sum -c ckpt.sha256) || exit 1
  for a in v41 v4; do
    [ -f .gpuwork/head-$a.safetensors ] && [ ! -d .gpuwork/ckpt-${a}m ] && python3 benchmarks/memorize_head.py \
      .gpuwork/ckpt-$a .gpuwork/ckpt-${a}m --apply .gpuwork/head-$a.safetensors > "$LOGS/memo_$a.log" 2>&1
  done
  return 0
}

memo_session() {  # BUDGET_S: token-identity fidelity on the memorised-head checkpoints
  local budget=$1 t0=$SECONDS
  vllm_env
  make_checkpoints
  local F="python3 benchmarks/gpu_vllm_fidelity.py run --prompts .gpuwork/prompts.json --kv-bytes 2 --no-jit-warmup
           --gpu-mem 0.12"
  local left=$((budget - 20))
  timeout $left $F --impl intree --text-only --ckpt .gpuwork/ckpt-v41m --out "$OUT/intree_v41m.json" > "$LOGS/i41.log" 2>&1 &
  timeout $left $F --impl intree --ckpt .gpuwork/ckpt-v4m --out "$OUT/intree_v4m.json" > "$LOGS/i4.log" 2>&1 &
  for a in v41 v4; do
    timeout $left $F --impl ours --no-eager --cudagraph-sizes 1,2,4 --ckpt .gpuwork/ckpt-${a}m \
      --out "$OUT/ours_${a}m.json" > "$LOGS/o$a.log" 2>&1 &
    DEEPINFER_NUMERICS=parity timeout $left $F --impl ours --no-eager --cudagraph-sizes 1,2,4 \
      --ckpt .gpuwork/ckpt-${a}m --out "$OUT/oursP_${a}m.json" > "$LOGS/oP$a.log" 2>&1 &
  done
  # Engram tables (issue 10): the default runs above keep them in pinned host memory; the same on the GPU, and the
  # node-shared mapping pinned and read through UVA by two processes
  DEEPINFER_ENGRAM_DEVICE=gpu timeout $left $F --impl ours --no-eager --cudagraph-sizes 1,2,4 --ckpt .gpuwork/ckpt-v41m \
    --out "$OUT/oursG_v41m.json" > "$LOGS/oG41.log" 2>&1 &
  timeout $left python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_shared_host_gpu.py > "$LOGS/shared_host.log" 2>&1 &
  wait
  for a in v41 v4; do
    for o in ours oursP; do
      python3 benchmarks/gpu_vllm_fidelity.py compare "$OUT/${o}_${a}m.json" "$OUT/intree_${a}m.json" 2>&1 | head -4
    done
  done
  python3 benchmarks/gpu_vllm_fidelity.py compare "$OUT/ours_v41m.json" "$OUT/oursG_v41m.json" --labels host,gpu 2>&1 | head -4
  grep -h "Engram tables\|Model loading took" "$LOGS/ov41.log" "$LOGS/oG41.log" | cut -c1-260
  grep -E "passed|failed|Error" "$LOGS/shared_host.log" | tail -3
  pack_logs
  echo "memo session done t=$((SECONDS - t0)) s"
}

fw_session() {  # BUDGET_S: deliverable 2/3 at release widths (4 layers, 8 experts, 8192-token vocabulary)
  local budget=$1 t0=$SECONDS
  vllm_env
  python3 -m vllm_deepinfer.tools.make_checkpoint --arch v4.1-flash --preset full-width --out /tmp/fw41 \
    --no-progress > "$LOGS/make_fw41.log" 2>&1 || { tail -5 "$LOGS/make_fw41.log"; exit 1; }
  (cd /tmp/fw41 && sha256sum *.safetensors) > "$LOGS/fw41.sha256"
  echo "checkpoint made in $((SECONDS - t0)) s: $(du -sh /tmp/fw41 | cut -f1)"
  local F="python3 benchmarks/gpu_vllm_fidelity.py run --prompts .gpuwork/prompts.json --kv-bytes 4 --no-jit-warmup
           --gpu-mem 0.2 --text-only --ckpt /tmp/fw41"
  local left=$((budget - (SECONDS - t0) - 20))
  timeout $left $F --impl intree --out "$OUT/intree_fw41.json" > "$LOGS/ifw41.log" 2>&1 &
  timeout $left $F --impl ours --no-eager --cudagraph-sizes 1,2,4 --out "$OUT/ours_fw41.json" > "$LOGS/ofw41.log" 2>&1 &
  DEEPINFER_NUMERICS=parity timeout $left $F --impl ours --no-eager --cudagraph-sizes 1,2,4 \
    --out "$OUT/oursP_fw41.json" > "$LOGS/oPfw41.log" 2>&1 &
  wait
  for o in ours oursP; do
    python3 benchmarks/gpu_vllm_fidelity.py compare "$OUT/${o}_fw41.json" "$OUT/intree_fw41.json" 2>&1 | head -6
  done
  grep -h "^\[ours\]\|Error" "$LOGS"/o*fw41.log | tail -8
  pack_logs
  echo "fw session done t=$((SECONDS - t0)) s"
}

vllm_session() {  # BUDGET_S
  local budget=$1 t0=$SECONDS
  vllm_env
  make_checkpoints
  local F="python3 benchmarks/gpu_vllm_fidelity.py run --prompts .gpuwork/prompts.json --kv-bytes 2 --no-jit-warmup
           --gpu-mem 0.12 --impl ours --no-eager --cudagraph-sizes 1,2,4"
  ( timeout 300 $F --ckpt .gpuwork/ckpt-v41 --out "$OUT/ours_v41.json" > "$LOGS/ours_v41.log" 2>&1 &
    DEEPINFER_NUMERICS=parity timeout 300 $F --ckpt .gpuwork/ckpt-v41 --out "$OUT/oursP_v41.json" \
      > "$LOGS/oursP_v41.log" 2>&1 &
    DEEPINFER_NUMERICS=parity timeout 300 $F --ckpt .gpuwork/ckpt-v4 --out "$OUT/oursP_v4.json" \
      > "$LOGS/oursP_v4.log" 2>&1 &
    wait ) &
  local left=$((budget - (SECONDS - t0) - 10))
  $BENCH --only intree --gpu-mem 0.45 --timeout $left > "$OUT/bench_intree.out" 2>&1
  wait
  keep_bench; pack_logs
  grep -h "^\[ours\]" "$LOGS"/ours*_v4*.log
  tail -20 "$OUT/bench_intree.out"
  echo "vllm session done t=$((SECONDS - t0)) s"
}

intree_bench() {  # BUDGET_S: vLLM's in-tree V4.1 alone on the GPU (the baseline column)
  local budget=$1 t0=$SECONDS
  vllm_env
  $BENCH --only intree --gpu-mem 0.45 --timeout $((budget - 15)) > "$OUT/bench_intree.out" 2>&1
  keep_bench
  tail -20 "$OUT/bench_intree.out"
  echo "intree bench done t=$((SECONDS - t0)) s"
}

ours_bench() {  # BUDGET_S
  local budget=$1 t0=$SECONDS
  vllm_env
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k "gathered or indexed" 2>&1 | grep -E "rel err|passed|failed"
  $BENCH --only ours --profile --timeout $((budget - 15)) > "$OUT/bench_ours.out" 2>&1
  keep_bench
  tail -60 "$OUT/bench_ours.out"
  echo "ours bench done t=$((SECONDS - t0)) s"
}

compact_bench() {  # BUDGET_S: both sides of the protocol in one call (ours with 2/5 of it, then in-tree with the rest)
  local budget=$1 t0=$SECONDS
  vllm_env
  # BENCH_ARGS: extra bench_e2e flags for both sides (an H100's 80 GB: e.g. --kv-gib 10 --gpu-mem 0.95)
  local C="$BENCH --reps ${REPS:-1} --warmup 1 --decode-tokens 48 --gpu-mem 0.9 ${BENCH_ARGS:-}"
  # PROFILE=B: also the per-op kernel profile of ours (one prefill call, decode per step at batch B);
  # IPROFILE=B: the same for in-tree (what its step spends per op, for the comparison table)
  # HOSTPROF=B: also a cProfile of one decode batch of B requests on both sides (where a step's host time goes)
  local share=$((budget * 2 / 5)); [ "${ONLY:-}" = ours ] && share=$((budget - 20))
  $C --only ours --timeout $share ${PROFILE:+--profile --profile-batch $PROFILE --profile-top 40} \
    ${HOSTPROF:+--host-profile $HOSTPROF} > "$OUT/bench_compact.out" 2>&1
  if [ "${ONLY:-}" != ours ]; then  # ONLY=ours: our side alone (no ratio: a check of our numbers)
    $C --only intree --timeout $((budget - (SECONDS - t0) - 25)) \
      ${IPROFILE:+--profile --profile-batch $IPROFILE --profile-top 40} ${HOSTPROF:+--host-profile $HOSTPROF} \
      >> "$OUT/bench_compact.out" 2>&1
    python3 benchmarks/bench_e2e.py --report /tmp/bench_e2e >> "$OUT/bench_compact.out" 2>&1
  fi
  tar czf "$OUT/e2e.tgz" --exclude 'model-*' -C /tmp bench_e2e 2>/dev/null
  grep -E "^\| |\[(ours|intree)\] (prefill|decode|engine)" "$OUT/bench_compact.out" | tail -30
  echo "compact bench done t=$((SECONDS - t0)) s"
}

ab_bench() {  # BUDGET_S: ours alone, the default path against each library switch (one engine per variant)
  local budget=$1 t0=$SECONDS
  vllm_env
  local C="$BENCH --only ours --reps 1 --warmup 1 --decode-tokens 48 --gpu-mem 0.9 --prefill-tokens 1024,4096
           --decode-batches 1,64,256 ${BENCH_ARGS:-}"
  local variants=(default VLLM_DEEPINFER_FLASHMLA=1 VLLM_DEEPINFER_DEEPGEMM_HC=1
                  "VLLM_DEEPINFER_FLASHMLA=1 VLLM_DEEPINFER_DEEPGEMM_HC=1")
  [ -n "${AB_VARIANTS:-}" ] && IFS=';' read -ra variants <<< "$AB_VARIANTS"  # e.g. "default;VLLM_DEEPINFER_FLASHMLA=1"
  local n=${#variants[@]} i=0 v
  for v in "${variants[@]}"; do
    local left=$((budget - (SECONDS - t0) - 15)) name=${v//[= ]/_}
    env $([ "$v" = default ] || echo "$v") $C --timeout $((left / (n - i))) > "$OUT/ab_$name.out" 2>&1
    keep_bench; mv "$OUT/ours.json" "$OUT/ab_$name.json" 2>/dev/null
    # a worker killed by its timeout can leave the engine core holding the GPU for a while
    for _ in $(seq 30); do [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)" -lt 2000 ] && break; sleep 1; done
    echo "== $v"; grep -E "\[ours\] (prefill|decode)" "$OUT/ab_$name.out" | sed 's/^ *//'
    i=$((i + 1))
  done
  rm -f "$OUT"/ours.log
  echo "ab bench done t=$((SECONDS - t0)) s"
}

serve_bench() {  # SIDE BUDGET_S
  local side=$1 budget=$2 t0=$SECONDS
  vllm_env
  timeout -k 10 $((budget - 15)) python3 benchmarks/bench_serve.py --only "$side" --out /tmp/serve \
    --start-timeout 360 ${SERVE_ARGS:-} > "$OUT/serve_$side.out" 2>&1
  tar czf "$OUT/serve-$side.tgz" --exclude 'model-*' -C /tmp serve 2>/dev/null
  tail -20 "$OUT/serve_$side.out"
  echo "serve $side done t=$((SECONDS - t0)) s"
}

cold_bench() {  # SIDE BUDGET_S (run it first on a fresh host: the cold number then includes a cold page cache)
  local side=$1 budget=$2 t0=$SECONDS
  vllm_env
  timeout -k 10 $((budget - 15)) python3 benchmarks/cold_start.py --only "$side" --out /tmp/cold \
    --limit $(((budget - 40) / 2)) > "$OUT/cold_$side.out" 2>&1
  tar czf "$OUT/cold-$side.tgz" --exclude 'cache-*' --exclude 'model-*' -C /tmp cold 2>/dev/null
  tail -12 "$OUT/cold_$side.out"
  echo "cold $side done t=$((SECONDS - t0)) s"
}

sweep_bench() {  # SIDE BUDGET_S
  local side=$1 budget=$2 t0=$SECONDS
  vllm_env
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_serve import protocol_model; from pathlib import Path; print(protocol_model(Path('/tmp/sweep'), False))" > /tmp/sweep_model.txt
  local disable=0; [ "$side" = intree ] && disable=1
  DEEPINFER_DISABLE=$disable DEEPINFER_FP8_LINEARS=packed DEEPINFER_EXPERT_STORAGE=packed PYTHON=python3 DEVICE=gpu \
    SERVE_PARAMS=configs/serve-gpu1.json BENCH_PARAMS=configs/bench-gpu-pareto.json NUM_RUNS=1 \
    OUT_DIR=/tmp/sweep EXPERIMENT=$side EXTRA_SERVE_ARGS="--load-format dummy --no-enable-prefix-caching \
    --kv-cache-memory-bytes 25769803776 --max-model-len 8192 --kernel-config '{\"enable_jit_warmup\":false}'" \
    timeout -k 10 $((budget - 15)) bash benchmarks/run_sweep.sh "$(cat /tmp/sweep_model.txt)" > "$OUT/sweep_$side.out" 2>&1
  tar czf "$OUT/sweep-$side.tgz" -C /tmp/sweep "$side" 2>/dev/null
  tail -12 "$OUT/sweep_$side.out"
  echo "sweep $side done t=$((SECONDS - t0)) s"
}

invariant_session() {  # BUDGET_S, one GPU (issue 12): the batch-invariance test with CUDA graphs (V1 runner,
  # N_GPU_CASES batches, and the companion with invariance off), then the default-vs-invariant benchmark
  # (BENCH_ARGS as in compact: an H100 needs --kv-gib 6)
  local budget=$1 t0=$SECONDS
  vllm_env
  local half=$((budget / 2))
  timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_marlin_invariance.py 2>&1 \
    | grep -E "^Marlin|passed|failed" | tail -8  # may Marlin serve this mode? (rows vs M, exhaustive to 512)
  [ "${SKIP_TEST:-0}" = 1 ] || DEEPINFER_INVARIANCE_CASES=${CASES:-200} timeout $half python3 -m pytest -q -s \
    -p no:cacheprovider tests/gpu/test_batch_invariance_gpu.py -k "${TESTS:-v1-runner or default_path}" \
    > "$LOGS/invariance_test.log" 2>&1
  echo "invariance test rc=$? t=$((SECONDS - t0)) s"
  grep -E "GPU batch invariance|invariance off|passed|failed|Error" "$LOGS/invariance_test.log" | cut -c1-300 | tail -8
  [ "${SKIP_BENCH:-0}" = 1 ] || $BENCH --invariant --reps ${REPS:-1} --warmup 1 --decode-tokens 48 --gpu-mem 0.9 \
    --decode-batches 1,16,64 ${BENCH_ARGS:-} --timeout $((budget - (SECONDS - t0) - 20)) > "$OUT/bench_invariant.out" 2>&1
  grep -E "^\| |\[(ours|invariant)\] (prefill|decode)" "$OUT/bench_invariant.out" | tail -20
  tar czf "$OUT/e2e-invariant.tgz" --exclude 'model-*' -C /tmp bench_e2e 2>/dev/null
  pack_logs
  echo "invariant session done t=$((SECONDS - t0)) s"
}

spec_session() {  # BUDGET_S [ARCH] [DRAFTER], one GPU (issue 11): a tiny-gpu checkpoint whose drafter reproduces
  # (HOST_PROFILE=1: in-process engines, a cProfile of one batch-1 call per mode in its log)
  # the target (or is noise), speculation off / fixed / varlen, ours and (reproduce) in-tree, batch 1/8/32
  local budget=$1 arch=${2:-v4.1-flash} drafter=${3:-reproduce} t0=$SECONDS
  vllm_env
  local ckpt=/tmp/spec-$arch-$drafter
  [ -d $ckpt ] || python3 -m vllm_deepinfer.tools.make_checkpoint --arch $arch --preset tiny-gpu --drafter $drafter \
    --out $ckpt > "$LOGS/make_spec.log" 2>&1 || { tail -5 "$LOGS/make_spec.log"; exit 1; }
  timeout $((budget - (SECONDS - t0) - 15)) python3 benchmarks/bench_spec_decode.py --model $ckpt \
    --out "$LOGS/spec-$arch-$drafter" --no-jit-warmup --k ${K:-5} --batches ${BATCHES:-1,8,32} --new-tokens ${NEW:-128} \
    $([ "$drafter" = reproduce ] && echo --intree) ${MODES:+--modes $MODES} --mode-timeout ${MODE_T:-240} \
    ${HOST_PROFILE:+--host-profile} \
    > "$OUT/spec_${arch}_${drafter}${MODES:+_${MODES//,/-}}.out" 2>&1
  echo "spec bench rc=$? t=$((SECONDS - t0)) s"
  tail -16 "$OUT/spec_${arch}_${drafter}${MODES:+_${MODES//,/-}}.out"
  cp "$LOGS/spec-$arch-$drafter/spec_decode.json" "$OUT/spec_${arch}_${drafter}${MODES:+_${MODES//,/-}}.json" 2>/dev/null
  pack_logs
}

spec_check() {  # BUDGET_S, one GPU (issue 11): greedy speculation == none with CUDA graphs, memorised heads
  local budget=$1 t0=$SECONDS
  vllm_env
  make_checkpoints
  timeout $((budget - 20)) python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_spec_decode_gpu.py \
    > "$LOGS/spec_check.log" 2>&1
  echo "spec check rc=$? t=$((SECONDS - t0)) s"
  grep -E "cudagraph_mode|passed|failed|Error" "$LOGS/spec_check.log" | cut -c1-300 | tail -10
  pack_logs
}

engram_session() {  # BUDGET_S, one GPU: V4.1 Engram tables in pinned host memory vs on the GPU, CUDA graphs
  local budget=$1 t0=$SECONDS
  vllm_env
  make_checkpoints
  local F="python3 benchmarks/gpu_vllm_fidelity.py run --impl ours --prompts .gpuwork/prompts.json --kv-bytes 2
           --no-jit-warmup --gpu-mem 0.12 --no-eager --cudagraph-sizes 1,2,4 --ckpt .gpuwork/ckpt-v41m"
  for d in host gpu; do
    DEEPINFER_ENGRAM_DEVICE=$d timeout $((budget - 20)) $F --out "$OUT/engram_$d.json" > "$LOGS/engram_$d.log" 2>&1 &
  done
  wait
  grep -h "Engram tables\|Model loading took\|Error" "$LOGS"/engram_*.log | cut -c1-240
  python3 benchmarks/gpu_vllm_fidelity.py compare "$OUT/engram_host.json" "$OUT/engram_gpu.json" --labels host,gpu 2>&1 | head -6
  pack_logs
  echo "engram session done t=$((SECONDS - t0)) s"
}

tp_session() {  # BUDGET_S, two GPUs: tensor_parallel_size 2 vs 1 (memorised-head V4.1 and V4, CUDA graphs)
  local budget=$1 t0=$SECONDS
  vllm_env
  make_checkpoints
  local F="python3 benchmarks/gpu_vllm_fidelity.py run --impl ours --prompts .gpuwork/prompts.json --kv-bytes 2
           --no-jit-warmup --gpu-mem 0.12 --no-eager --cudagraph-sizes 1,2,4"
  local left=$(( (budget - 30) / 2 ))
  for a in v41 v4; do
    timeout $left $F --tp 2 --ckpt .gpuwork/ckpt-${a}m --out "$OUT/tp2_$a.json" > "$LOGS/tp2_$a.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout $left $F --ckpt .gpuwork/ckpt-${a}m --out "$OUT/tp1_$a.json" > "$LOGS/tp1_$a.log" 2>&1 &
    wait
    python3 benchmarks/gpu_vllm_fidelity.py compare "$OUT/tp2_$a.json" "$OUT/tp1_$a.json" --labels tp2,tp1 2>&1 | head -6
  done
  grep -h "Error" "$LOGS"/tp*.log | head -5
  pack_logs
  echo "tp session done t=$((SECONDS - t0)) s"
}

DPEP="--data-parallel-size 2 --enable-expert-parallel --api-server-count 1"
EPLB='--enable-eplb --eplb-config {"num_redundant_experts":2,"step_interval":16,"window_size":16,"log_balancedness":true}'

dpep_session() {  # BUDGET_S, two GPUs: DP=2+EP=2+EPLB token identity vs one GPU, then par_bench dpep
  local budget=$1 t0=$SECONDS
  vllm_env
  make_checkpoints
  local F="python3 benchmarks/gpu_vllm_fidelity.py run --impl ours --prompts .gpuwork/prompts.json --kv-bytes 2
           --no-jit-warmup --gpu-mem 0.1 --no-eager --cudagraph-sizes 1,2,4 --start-timeout 200"
  local left=$(( budget * 2 / 5 )) port=8013
  for a in v41 v4; do  # both archs at once: DP ranks on GPU 0/1, the one-GPU runs on GPU 1 (fixed KV budgets)
    timeout $left $F --serve-args "$DPEP $EPLB" --port $port --ckpt .gpuwork/ckpt-${a}m --out "$OUT/dp2_$a.json" \
      > "$LOGS/dp2_$a.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout $left $F --ckpt .gpuwork/ckpt-${a}m --out "$OUT/dp1_$a.json" > "$LOGS/dp1_$a.log" 2>&1 &
    port=$((port + 1))
  done
  wait
  for a in v41 v4; do
    mv "$OUT/dp2_$a.serve.log" "$LOGS/" 2>/dev/null
    python3 benchmarks/gpu_vllm_fidelity.py compare "$OUT/dp2_$a.json" "$OUT/dp1_$a.json" --labels dp2ep,gpu1 2>&1 | head -6
    grep -hE "Rearranged|Skip rearrange|EPLB step|Error" "$LOGS/dp2_$a.serve.log" | cut -c1-200 | tail -4
  done
  echo "identity done t=$((SECONDS - t0)) s"
  par_bench dpep $((budget - (SECONDS - t0)))
  pack_logs
  echo "dpep session done t=$((SECONDS - t0)) s"
}

par_bench() {  # PAR (dpep | tp) BUDGET_S: served throughput of in-tree then ours on the protocol model (full-width
  # V4.1, 8 layers, 384 experts, dummy weights) under that parallel layout; short load (C=1/16/64, 64 new tokens).
  # Needs vllm_env done.
  local par=$1 budget=$2 t0=$SECONDS
  local args="$DPEP"; [ "$par" = tp ] && args="--tensor-parallel-size 2"
  local per=$(( (budget - 20) / 2 ))
  for side in intree ours; do
    timeout -k 10 $per python3 benchmarks/bench_serve.py --only $side --out /tmp/par-$par --concurrency 1,16,64 \
      --num-prompts 8,64,192 --output-len 64 --start-timeout $((per - 70)) --serve-args "$args" \
      > "$LOGS/bench_${par}_$side.out" 2>&1
    grep -E "first token|C=|not up|failed" "$LOGS/bench_${par}_$side.out" | tail -4
  done
  python3 benchmarks/bench_serve.py --report /tmp/par-$par 2>&1 | tail -8
  tar czf "$OUT/bench-$par.tgz" --exclude 'model-*' -C /tmp par-$par 2>/dev/null
  echo "par-bench $par done t=$((SECONDS - t0)) s"
}

linears() {  # the FP8 block linears of one V4.1 layer: vLLM Marlin W8A16 vs our Triton GEMM vs bf16 (+ check)
  vllm_env
  python3 benchmarks/bench_linears_vllm.py --tokens 1,16,64,256 --json "$OUT/bench_linears.json" \
    > "$OUT/bench_linears.log" 2>&1
  echo "linears bench rc=$?"; grep -E "^layer|correctness|Error" "$OUT/bench_linears.log" | tail -20
}

case "$mode" in
  kernels) kernels ;;
  kernel-ab) kernel_ab ;;
  linears) linears ;;
  stage) bash "$REPO/shared/gpu/receive.sh" "$2" ;;
  vllm) vllm_session "${2:-560}" ;;
  ours-bench) ours_bench "${2:-560}" ;;
  intree-bench) intree_bench "${2:-560}" ;;
  memo) memo_session "${2:-560}" ;;
  fw) fw_session "${2:-560}" ;;
  engram) engram_session "${2:-560}" ;;
  invariant) invariant_session "${2:-560}" ;;
  spec) spec_session "${2:-560}" "${3:-}" "${4:-}" ;;
  spec-check) spec_check "${2:-560}" ;;
  tp) tp_session "${2:-560}" ;;
  dpep) dpep_session "${2:-560}" ;;
  par-bench) vllm_env; par_bench "${2:-tp}" "${3:-560}"; pack_logs ;;
  jit-save) bash shared/gpu/jit-cache.sh save "$OUT/jit" "${2:-0}" ;;
  compact) compact_bench "${2:-560}" ;;
  ab) ab_bench "${2:-560}" ;;
  pytest) shift; vllm_env; make_checkpoints
    python3 -m pytest -q -s -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|Error|steps on" ;;
  serve-ours|serve-intree) serve_bench "${mode#serve-}" "${2:-560}" ;;
  cold-ours|cold-intree) cold_bench "${mode#cold-}" "${2:-560}" ;;
  sweep-ours|sweep-intree) sweep_bench "${mode#sweep-}" "${2:-560}" ;;
  *) echo "usage: $0 kernels|kernel-ab|linears|stage DIR|vllm|ours-bench|intree-bench|memo|fw|engram|tp|dpep|compact|ab|serve-SIDE|cold-SIDE|sweep-SIDE BUDGET_S|par-bench tp|dpep BUDGET_S|jit-save [FIRST]" >&2; exit 2 ;;
esac
