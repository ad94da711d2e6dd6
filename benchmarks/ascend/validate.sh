#!/usr/bin/env bash
# Validation of vllm-deepinfer's Ascend 950 platform on a 950 host: correctness against the torch oracle and
# the independent references, and kernel speed, summarised in one table.
#
#   bash benchmarks/ascend/validate.sh [--quick] [--no-engine]      (from the repository root)
#
# Needs: CANN for the 950 (set_env.sh sourced), torch 2.13 + torch-npu 2.13.0, triton-ascend 3.2.0, vLLM 0.32.0
# (built with VLLM_TARGET_DEVICE=empty), this repository installed (`pip install --no-deps -e .`, for the
# entry points), pytest and transformers 5.19 (`pip install -e .[test]`), and no vllm-ascend (or
# VLLM_PLUGINS=deepinfer,deepinfer_ascend). Results go to $OUT (default ./ascend-validate-<time>/).
#   --quick      small kernel shapes (a fast smoke of the script itself)
#   --no-engine  skip the vLLM engine steps (fidelity tests, ACL graphs)
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-ascend-validate-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
QUICK="" ENGINE=1
for a in "$@"; do
  case $a in
    --quick) QUICK=--quick ;;
    --no-engine) ENGINE=0 ;;
    *) echo "unknown option $a"; exit 2 ;;
  esac
done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

echo "== environment" | tee "$OUT/env.txt"
$PY - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib.metadata as md, platform
def v(d):
    try: return md.version(d)
    except md.PackageNotFoundError: return "-"
print("python", platform.python_version(), "| torch", v("torch"), "| torch-npu", v("torch-npu"), "| triton-ascend",
      v("triton-ascend"), "| triton", v("triton"), "| vllm", v("vllm"), "| vllm-ascend", v("vllm-ascend"),
      "| vllm-deepinfer", v("vllm-deepinfer"))
eps = {e.name: e.value for e in md.entry_points(group="vllm.platform_plugins")}
print("platform plugins:", eps)
from kernels_ascend import platform as p
pr = p.probe()
print("probe:", pr)
print("decision:", p.decide(pr))
import kernels_ascend as k
print("triton has an Ascend backend:", k.triton_targets_npu(), "| kernels available:", k.available())
EOF
command -v npu-smi >/dev/null && npu-smi info 2>&1 | head -12 >> "$OUT/env.txt"

declare -A RES
step() {  # step NAME LOG COMMAND...: run, record PASS/FAIL
  local name=$1 log=$2; shift 2
  echo "== $name"
  if "$@" > "$OUT/$log" 2>&1; then RES[$name]=PASS; else RES[$name]="FAIL (see $OUT/$log)"; fi
  tail -3 "$OUT/$log"
}

step "platform + kernel tests (pytest, kernels on the NPU)" tests.log \
  $PY -m pytest -q -s -p no:cacheprovider tests/test_ascend_platform.py tests/test_ascend_kernels.py
step "kernel benchmark" bench.log $PY benchmarks/ascend/bench_ascend.py $QUICK --json "$OUT/bench.json"
if [ $ENGINE = 1 ]; then
  step "fidelity: V4.1 vs dense reference, V4 vs transformers (fp32), bf16 tolerance" fidelity.log \
    $PY -m pytest -q -p no:cacheprovider "tests/test_fidelity.py::test_v41_matches_dense_reference[0]" \
      "tests/test_fidelity.py::test_v4_matches_transformers[0]" tests/test_fidelity.py::test_bfloat16_within_tolerance
  step "engine: platform active, ACL graphs == eager" engine.log \
    $PY benchmarks/ascend/engine_check.py --json "$OUT/engine.json"
fi

echo
echo "== summary ($OUT)"
RES_DUMP=$(for k in "${!RES[@]}"; do printf '%s\t%s\n' "$k" "${RES[$k]}"; done)
RES_DUMP=$RES_DUMP OUT=$OUT $PY - <<'EOF'
import json, os
out = os.environ["OUT"]
print("| check | result | rel err (bound) | kernel ms | torch_npu ms | speedup |")
print("|---|---|---|---|---|---|")
for line in sorted(os.environ["RES_DUMP"].splitlines()):
    name, res = line.split("\t")
    print(f"| {name} | {res} | | | | |")
for fn in ("engine.json",):
    if os.path.exists(os.path.join(out, fn)):
        for r in json.load(open(os.path.join(out, fn))):
            print(f"| {r['check']} | {'PASS' if r['ok'] else 'FAIL'}: {r['detail']} | | | | |")
if os.path.exists(os.path.join(out, "bench.json")):
    for r in json.load(open(os.path.join(out, "bench.json")))["rows"]:
        print(f"| kernel: {r['case']} ({r['dtype']}) | {'PASS' if r['ok'] else 'FAIL'} | {r['rel_err']:.2e} "
              f"({r['bound']:.1e}) | {r['kernel_ms']:.3f} | {r['torch_ms']:.3f} | {r['speedup']:.2f}x |")
EOF
for k in "${!RES[@]}"; do [[ ${RES[$k]} == PASS ]] || exit 1; done
