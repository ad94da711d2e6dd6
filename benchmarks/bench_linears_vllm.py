"""FP8 block linears of one V4.1-Flash layer at release widths: vLLM's Marlin W8A16 GEMM (the plugin's CUDA
default, `ops.marlin`) vs the plugin's Triton weight-only FP8 GEMM (`kernels_nvidia.gemm`) vs bf16 torch
(dequantised weights), at decode and prefill token counts; with a correctness check against the fp32 oracle.

    python benchmarks/bench_linears_vllm.py [--json OUT.json] [--tokens 1,16,64,256,4096] [--eager]

Needs vLLM 0.32 on CUDA (on the H200: `source shared/gpu/env.sh`). Shapes (model-spec §0.1, V4.1: D=5120,
q_lora 1280, 64 x 512 heads, 8 wo_a groups of 1024, shared expert 2304, indexer 32 x 128; 32x32 scale
blocks): every FP8 matrix of one attention + shared-expert sublayer. Median us with CUDA graphs
(`--eager`: plain launches); the `layer` rows sum the matrices, `layer stacked` with the
`FUSED` pairs as one GEMM each (what the model runs). rel err: ||y - ref|| / ||ref|| against
`reference.linear_fp8_block` in fp32 on the CPU (bound 4e-3, see tests/gpu/test_gemm_kernels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_moe_vllm import timer  # noqa: E402

BLOCK = 32
#: name -> (N, K, groups) for one V4.1 layer (wo_a: [G * o_lora, H * d / G], input [T, H * d])
SHAPES = {"wq_a": (1280, 5120, 1), "wq_b": (32768, 1280, 1), "wkv": (512, 5120, 1), "wo_a": (8192, 4096, 8),
          "wo_b": (5120, 8192, 1), "indexer.wq_b": (4096, 1280, 1), "shared.w1": (2304, 5120, 1),
          "shared.w3": (2304, 5120, 1), "shared.w2": (5120, 2304, 1)}
#: the stacked matrices the model multiplies instead of their parts (`Linear.fuse_outputs`): part names
FUSED = {"wq_a|wkv": ("wq_a", "wkv"), "shared.w1|w3": ("shared.w1", "shared.w3")}
SHAPES.update({name: (sum(SHAPES[p][0] for p in parts), 5120, 1) for name, parts in FUSED.items()})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", default="1,16,64,256,4096")
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    from kernels_nvidia import gemm

    from vllm_deepinfer.checkpoint.formats import dequant_fp8_block, quant_fp8_block
    from vllm_deepinfer.ops import marlin
    from vllm_deepinfer.ops import reference as ref

    dev, dtype = "cuda", torch.bfloat16
    bench = timer(args.eager)
    torch.manual_seed(0)
    rows, layer, matrix_us = [], {}, {}
    for name, (n, k, groups) in SHAPES.items():
        codes, scale = quant_fp8_block(torch.randn(n, k) / k ** 0.5, BLOCK)
        scale = scale.view(torch.uint8)
        w, s = codes.to(dev), scale.to(dev)
        dense = dequant_fp8_block(codes, scale.view(torch.float8_e8m0fnu), BLOCK).to(dev, dtype)
        per = n // groups  # wo_a: one Marlin matrix per group (the 8-call form the model does not use)
        mar = [marlin.MarlinFP8.from_packed(w[g * per:(g + 1) * per], s[g * per // BLOCK:(g + 1) * per // BLOCK],
                                            (BLOCK, BLOCK), dtype) for g in range(groups)]
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, groups * k, device=dev, dtype=dtype)
            want = ref.linear_fp8_block(x.float().cpu(), codes, scale, (BLOCK, BLOCK), groups)
            fns = {"marlin": lambda: torch.cat([m(xg) for m, xg in zip(mar, x.chunk(groups, dim=1))], dim=1),
                   "triton": lambda: gemm.linear_fp8_block(x, w, s, (BLOCK, BLOCK), groups),
                   "bf16": lambda: ref.linear(x, dense, groups)}
            for impl, fn in fns.items():
                got = fn().float().cpu()
                err = ((got - want).norm() / want.norm()).item()
                us = bench(fn) * 1e3
                rows.append({"matrix": name, "T": t, "impl": impl, "us": us, "rel_err": err})
                if name not in FUSED:
                    layer[(t, impl)] = layer.get((t, impl), 0.0) + us
                matrix_us[(name, t, impl)] = us
                gbs = (n * k * (1 + 1 / 32) if impl == "marlin" else n * k * (2 if impl == "bf16" else 1)) / us / 1e3
                print(f"{name:13s} T={t:5d} {impl:7s} {us:9.1f} us {gbs:7.0f} GB/s  rel err {err:.2e}", flush=True)
    for (t, impl), us in sorted(layer.items()):
        print(f"layer         T={t:5d} {impl:7s} {us:9.1f} us  (ratio to bf16 {layer[(t, 'bf16')] / us:.2f}x)")
        fused = us + sum(matrix_us[(f, t, impl)] - sum(matrix_us[(p, t, impl)] for p in parts)
                         for f, parts in FUSED.items())
        print(f"layer stacked T={t:5d} {impl:7s} {fused:9.1f} us  (wq_a|wkv and shared w1|w3 as one GEMM each)")
    bad = [r for r in rows if r["rel_err"] > 4e-3]
    print("correctness:", "PASS" if not bad else f"FAIL {bad[:3]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
