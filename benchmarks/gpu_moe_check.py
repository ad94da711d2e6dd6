"""Which fused-MoE method and kernel serve the routed experts, and do packed and bf16 storage agree.

    python benchmarks/gpu_moe_check.py [--preset tiny-gpu] [--tp 1] [--ep] [--eplb]

For each of tiny V4.1 and V4 (made here with make_checkpoint), runs the plugin with the default expert
storage (`auto`: packed on CUDA) and with `DEEPINFER_EXPERT_STORAGE=bf16`, prints per run the experts'
method, vLLM's MXFP4 backend and experts kernel class (expected on SM90: Mxfp4MoEMethod, MARLIN,
MarlinExperts; CPU: TorchMoEMethod), the greedy tokens of three prompts and whether the two storages
produce the same tokens (MXFP4 weights dequantise exactly to bf16, so only kernel rounding differs).
`--tp 2 --ep [--eplb]` runs expert parallel over two GPUs (EPLB: 2 redundant experts, rebalanced every
16 steps) and compares its tokens with `--tp 1`. One JSON line per run on stdout, summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 40, 300)]


def method_info(model) -> dict:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    experts = next(m for m in model.modules() if isinstance(m, RoutedExperts))
    qm = experts.quant_method
    kernel = getattr(qm, "moe_kernel", None)
    return {"method": type(qm).__name__, "backend": str(getattr(qm, "mxfp4_backend", getattr(qm, "unquantized_backend", ""))),
            "experts_kernel": type(kernel.fused_experts).__name__ if kernel is not None else None,
            "w13": f"{tuple(experts.w13_weight.shape)} {experts.w13_weight.dtype}",
            "local_experts": experts.local_num_experts}


def run(ckpt: str, storage: str, tp: int, ep: bool, eplb: bool) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    os.environ["DEEPINFER_EXPERT_STORAGE"] = storage
    kw = dict(tensor_parallel_size=tp, enable_expert_parallel=ep)
    if eplb:
        kw.update(enable_eplb=True, eplb_config={"num_redundant_experts": 2, "step_interval": 16, "window_size": 16})
    llm = LLM(model=ckpt, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048, seed=0, **kw)
    try:
        info = llm.apply_model(method_info)[0] if tp == 1 else {}
        outs = llm.generate(PROMPTS * 4, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
        info["tokens"] = [list(o.outputs[0].token_ids) for o in outs[: len(PROMPTS)]]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-gpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--eplb", action="store_true")
    args = ap.parse_args()
    from vllm_deepinfer.tools.make_checkpoint import make_checkpoint

    ok = True
    with tempfile.TemporaryDirectory() as root:
        for arch in ("v4.1-flash", "v4-flash"):
            ckpt = str(make_checkpoint(arch, args.preset, f"{root}/{arch}", seed=0))
            runs = {}
            for storage in ("auto", "bf16"):
                runs[storage] = run(ckpt, storage, 1, False, False)
                print(json.dumps({"arch": arch, "storage": storage, **runs[storage]}), flush=True)
            same = runs["auto"]["tokens"] == runs["bf16"]["tokens"]
            print(f"{arch}: default experts method {runs['auto']['method']} / {runs['auto']['backend']} / "
                  f"{runs['auto']['experts_kernel']}; packed vs bf16 greedy tokens "
                  f"{'identical' if same else 'DIFFER'}", flush=True)
            if args.tp > 1:
                par = run(ckpt, "auto", args.tp, args.ep, args.eplb)
                same_par = par["tokens"] == runs["auto"]["tokens"]
                print(f"{arch}: tp={args.tp} ep={args.ep} eplb={args.eplb} vs tp=1 greedy tokens "
                      f"{'identical' if same_par else 'DIFFER'}", flush=True)
                ok &= same_par
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
