"""Routed experts at the release expert counts: vLLM's MXFP4 fused-MoE method vs the plugin's Triton MXFP4
kernel vs bf16 (vLLM's unquantized method and the plugin's torch grouped GEMM), one MoE layer, decode sizes.

    python benchmarks/bench_moe_vllm.py [--json OUT.json] [--tokens 1,16,64,256] [--arch v4.1,v4] [--eager]

Needs vLLM 0.32 (on the H200: `source shared/gpu/env.sh`). Shapes (model-spec §0.1): V4.1-Flash E=384,
D=5120, I=2304; V4-Flash E=256, D=4096, I=2048; top-6, SwiGLU limit 10. Each row times the expert compute
alone for the same routing (`select_experts` once, then the method's `apply` / the op), median ms with
CUDA graphs (`--eager`: plain launches): `vllm-mxfp4` = Mxfp4MoEMethod as the plugin selects it
(DEEPINFER_EXPERT_STORAGE=auto; on SM90 the Marlin W4A16 kernel), `vllm-bf16` = UnquantizedFusedMoEMethod
(=bf16), `ours-triton-mxfp4` = kernels_nvidia.moe (ops.routed_experts_packed), `ours-bf16` =
ops.routed_experts (torch._grouped_mm). GB/s: bytes of the experts the batch touches (packed or bf16) +
activations. Off CUDA (`--small`): a plumbing check of the same code with tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = {"v4.1": (384, 5120, 2304), "v4": (256, 4096, 2048)}
K, LIMIT, SCALE = 6, 10.0, 1.5


def setup(device: str):
    """A one-rank vLLM config/distributed state for building fused-MoE layers outside an engine."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    from vllm_deepinfer.models.quant_config import DeepInferFP8Config

    cfg = VllmConfig(quant_config=DeepInferFP8Config([128, 128], "fp4"))
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()
    init_distributed_environment(1, 0, "tcp://127.0.0.1:29517", 0, backend="nccl" if device == "cuda" else "gloo")
    initialize_model_parallel(1, 1)
    if device == "cuda":
        from vllm.v1.worker.workspace import init_workspace_manager
        init_workspace_manager(torch.device(device))
    return cfg


def build(cfg, storage: str, name: str, E: int, D: int, I: int, codes, device: str, dtype):
    """The plugin's MoE layer (gate + vLLM fused-MoE experts, no shared expert) with `storage`, loaded with
    `codes` = (w13 codes, w13 scales, w2 codes, w2 scales) through the layer's weight loader."""
    from vllm_deepinfer.checkpoint.formats import dequant_mxfp4
    from vllm_deepinfer.moe.layer import MoE

    os.environ["DEEPINFER_EXPERT_STORAGE"] = storage
    with torch.device(device):
        moe = MoE(cfg, f"{name}.ffn", D, I, E, K, 0, 1000, False, SCALE, LIMIT).to(dtype)
    moe.gate.weight.data.normal_(0, D ** -0.5)
    moe.gate.bias.data.zero_()
    experts = moe.experts.routed_experts
    w13c, w13s, w2c, w2s = codes
    packed = experts.w13_weight.dtype == torch.uint8
    for e in range(E):
        for shard, rows in (("w1", slice(0, I)), ("w3", slice(I, 2 * I)), ("w2", slice(None))):
            c, s = (w2c, w2s) if shard == "w2" else (w13c, w13s)
            stem = "w2" if shard == "w2" else "w13"
            param = getattr(experts, f"{stem}_weight")
            if packed:
                param.weight_loader(param, c[e, rows], f"{stem}_weight", shard, e)
                sp = getattr(experts, f"{stem}_weight_scale")
                sp.weight_loader(sp, s[e, rows], f"{stem}_weight_scale", shard, e)
            else:
                param.weight_loader(param, dequant_mxfp4(c[e, rows], s[e, rows], checked=False).to(dtype),
                                    f"{stem}_weight", shard, e)
    experts.quant_method.process_weights_after_loading(experts)
    return moe


def timer(eager: bool):
    import triton

    def bench(fn) -> float:
        fn()
        if eager or not torch.cuda.is_available():
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") if torch.cuda.is_available() \
                else _cpu_time(fn)
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return bench


def _cpu_time(fn, n=5) -> float:
    import time
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", default="1,16,64,256")
    ap.add_argument("--arch", default="v4.1,v4")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU plumbing check)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    cfg = setup(device)
    from vllm.forward_context import set_forward_context

    from vllm_deepinfer import ops
    from vllm_deepinfer.checkpoint.formats import dequant_mxfp4

    bench = timer(args.eager)
    rows = []
    for arch in args.arch.split(","):
        E, D, I = (16, 256, 128) if args.small else SHAPES[arch]
        g = torch.Generator(device=device).manual_seed(0)
        codes = [torch.randint(0, 256, shape, device=device, dtype=torch.uint8, generator=g) for shape in
                 ((E, 2 * I, D // 2), (E, 2 * I, D // 32), (E, D, I // 2), (E, D, I // 32))]
        codes[1].clamp_(118, 126)  # scales 2^-9..2^-1: finite outputs
        codes[3].clamp_(118, 126)
        per_expert = {"packed": sum(c[0].numel() for c in codes), "bf16": 3 * D * I * 2}
        layers = {"vllm-mxfp4": build(cfg, "packed", f"{arch}.p", E, D, I, codes, device, dtype),
                  "vllm-bf16": build(cfg, "bf16", f"{arch}.b", E, D, I, codes, device, dtype)}
        for name, layer in layers.items():
            print(f"{arch} {name}: {type(layer.experts.routed_experts.quant_method).__name__}",
                  getattr(layer.experts.routed_experts.quant_method, "mxfp4_backend", ""), flush=True)
        w13, w2 = (dequant_mxfp4(c, s, checked=False).to(dtype) for c, s in ((codes[0], codes[1]), (codes[2], codes[3])))
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, D, device=device, dtype=dtype)
            token_ids = torch.randint(0, 1000, (t,), device=device)
            router = layers["vllm-mxfp4"].router
            logits = x.float() @ layers["vllm-mxfp4"].gate.weight.float().t()
            topk_w, topk_ids = router.select_experts(x, logits, torch.int32, input_ids=token_ids)
            touched = topk_ids.unique().numel()
            fns = {f"{n}": (lambda lay=lay: lay.experts.routed_experts.quant_method.apply(
                       lay.experts.routed_experts, x, topk_w, topk_ids, None, None)) for n, lay in layers.items()}
            fns["ours-bf16"] = lambda: ops.routed_experts(x, topk_ids.long(), topk_w, w13, w2, LIMIT)
            if device == "cuda":
                fns["ours-triton-mxfp4"] = lambda: ops.routed_experts_packed(x, topk_ids.long(), topk_w, *codes, LIMIT)
            ref = fns["ours-bf16"]().float()
            for n, fn in fns.items():
                with set_forward_context(None, cfg):
                    out = fn().float()
                    ms = bench(fn)
                err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
                nbytes = touched * per_expert["packed" if "mxfp4" in n else "bf16"] + 2 * x.numel() * 2
                rows.append({"arch": arch, "T": t, "impl": n, "ms": ms, "GB/s": nbytes / ms / 1e6, "rel_err_vs_ours_bf16": err})
                print(f"{arch} T={t:4d} {n:18s} {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:7.0f} GB/s  "
                      f"rel.err {err:.2e}", flush=True)
        del layers
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
