"""Microbenchmarks of kernels_nvidia against the H200 ceilings measured in the same run.

    python3 benchmarks/bench_kernels.py [--json OUT.json] [--quick]
        [--only-fp8-linears | --moe-only | --topk-only | --router-only | --gemm-threshold | --invariant-gemms]

Ceilings first: a large device-to-device copy (bytes read + written) and an 8192^3 bf16 GEMM on random
data. Then each kernel at V4.1-Flash full-width shapes (H=64, d=512, index heads 64 x 128, hc=4,
D=4096; MXFP4 routed experts at the full-width config, `bench_moe`), timed with triton.testing.do_bench
(median), next to the torch oracle on the same GPU.
GB/s counts the fewest bytes the op must move (each input read once, each output written once);
TFLOP/s counts the useful multiply-adds (masked-out keys excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernels_nvidia import attention as kattn  # noqa: E402
from kernels_nvidia import gemm as kgemm  # noqa: E402
from kernels_nvidia import indexer as kidx  # noqa: E402
from kernels_nvidia import ops as kn  # noqa: E402
from kernels_nvidia import router as krouter  # noqa: E402
from kernels_nvidia import topk as ktopk  # noqa: E402
from vllm_deepinfer.checkpoint.formats import dequant_fp8_block, dequant_mxfp4, e8m0_decode  # noqa: E402
from vllm_deepinfer.ops import reference as ref  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16


GRAPH = True


def bench(fn, rep=100) -> float:
    """Median milliseconds of the GPU work: CUDA-graph replays (launch overhead excluded, as in serving
    with CUDA graphs on); --eager times plain launches (Python wrapper + launch latency included)."""
    if GRAPH:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def ceilings() -> tuple[float, float]:
    """Eager timing on purpose: a captured copy becomes a copy-engine memcpy node (2.77 TB/s measured)."""
    n = 1 << 30  # 1 GiB per buffer x 2: well past the 60 MB L2
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    copy_gbs = 2 * n / ms / 1e6
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=BF)
    y = torch.randn(8192, 8192, device=DEV, dtype=BF)
    ms = triton.testing.do_bench(lambda: x @ y, rep=200, return_mode="median")
    gemm_tf = 2 * 8192 ** 3 / ms / 1e9
    return copy_gbs, gemm_tf


ROWS = []


def record(name, ms_k, ms_r, nbytes, flops, copy_gbs, gemm_tf):
    gbs = nbytes / ms_k / 1e6
    tf = flops / ms_k / 1e9
    row = dict(op=name, us=ms_k * 1e3, ref_us=ms_r * 1e3 if ms_r else None, gbs=gbs, tflops=tf,
               pct_bw=100 * gbs / copy_gbs, pct_mma=100 * tf / gemm_tf,
               speedup=(ms_r / ms_k) if ms_r else None)
    ROWS.append(row)
    sp = f"{row['speedup']:7.1f}x" if ms_r else "      -"
    print(f"{name:44s} {row['us']:9.1f} us {gbs:8.0f} GB/s ({row['pct_bw']:5.1f}%) {tf:7.1f} TF/s "
          f"({row['pct_mma']:5.1f}%)  vs torch {sp}", flush=True)


#: FP8 block linears of the full-width V4.1 preset (D=5120, q_lora 1280, 64 heads x 512, o_lora 1024 x 8
#: groups, shared expert 2304, index 32 x 128, Engram 5 x D from 3 x 8 x 256): name -> (N, K per group, groups).
FP8_LINEARS = {"wq_a": (1280, 5120, 1), "wq_b": (32768, 1280, 1), "wkv": (512, 5120, 1),
               "wo_a": (8192, 4096, 8), "wo_b": (5120, 8192, 1), "indexer.wq_b": (4096, 1280, 1),
               "shared.w1/w3": (2304, 5120, 1), "shared.w2": (5120, 2304, 1), "engram.wkv": (25600, 6144, 1)}


def _fp8_block_weight(n: int, k: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E4M3 codes [N, K] and E8M0 block scale bytes (2^-17..2^-3) of a benchmark matrix."""
    w = (torch.randn(n, k, device=DEV) * 4).to(torch.float8_e4m3fn)
    s = torch.randint(110, 125, (triton.cdiv(n, block[0]), triton.cdiv(k, block[1])), device=DEV, dtype=torch.uint8)
    return w, s


def bench_fp8_linears(copy_gbs, gemm_tf, quick, block=(32, 32)):
    """kernels_nvidia.gemm.linear_fp8_block vs the bf16 torch matmul of the dequantised weight (the torch
    path's storage): GB/s over the FP8 codes + scales + x + y, TFLOP/s over 2*M*N*K."""
    for name, (n, k, groups) in FP8_LINEARS.items():
        w, s = _fp8_block_weight(n, k, block)
        wd = dequant_fp8_block(w, e8m0_decode(s), block).to(BF)
        for m in ((1, 64, 4096) if quick else (1, 16, 64, 256, 4096)):
            x = torch.randn(m, groups * k, device=DEV, dtype=BF)
            nbytes = w.numel() + s.numel() + x.numel() * 2 + m * n * 2
            flops = 2 * m * n * k
            ms_r = bench(lambda: ref.linear(x, wd, groups))
            ms_k = bench(lambda: kgemm.linear_fp8_block(x, w, s, block, groups))
            record(f"fp8_linear {name} M={m} N={n} K={k}x{groups}", ms_k, ms_r, nbytes, flops, copy_gbs, gemm_tf)
            if m > kgemm.DIRECT_MAX_M:  # the batch-invariant direct kernel at prefill sizes, for the threshold
                kgemm.BATCH_INVARIANT = True
                ms_k = bench(lambda: kgemm.linear_fp8_block(x, w, s, block, groups))
                kgemm.BATCH_INVARIANT = False
                record(f"  direct (batch-invariant) M={m}", ms_k, ms_r, nbytes, flops, copy_gbs, gemm_tf)
    # tile sweep of the direct kernel (TILE_M, TILE_N, warps, stages) at decode sizes, for the record
    default = (kgemm.TILE_M, kgemm.TILE_N, kgemm.WARPS, kgemm.STAGES)
    for name in ("wq_a", "wq_b", "wo_b"):
        n, k, _ = FP8_LINEARS[name]
        w, s = _fp8_block_weight(n, k, block)
        for m in (16, 256):
            x = torch.randn(m, k, device=DEV, dtype=BF)
            for tiles in ((16, 32, 4, 4), (16, 64, 4, 4), (32, 32, 4, 4), (32, 64, 4, 6), (64, 32, 4, 4),
                          (64, 64, 4, 4), (64, 128, 8, 4), (128, 64, 8, 4)):
                kgemm.TILE_M, kgemm.TILE_N, kgemm.WARPS, kgemm.STAGES = tiles
                try:
                    ms_k = bench(lambda: kgemm.linear_fp8_block(x, w, s, block))
                    record(f"  {name} M={m} TILE_M,TILE_N,warps,stages={tiles}", ms_k, None,
                           w.numel() + s.numel() + 2 * m * (n + k), 2 * m * n * k, copy_gbs, gemm_tf)
                except Exception as e:  # noqa: BLE001
                    print("  tiles", tiles, "failed:", type(e).__name__, str(e)[:200])
    kgemm.TILE_M, kgemm.TILE_N, kgemm.WARPS, kgemm.STAGES = default


def bench_invariant_gemms(copy_gbs, gemm_tf, block=(32, 32)):
    """The GEMMs of batch-invariant mode at decode sizes. The direct FP8 kernel (every linear, every M) per
    `gemm.SPLIT_FILL` (K splits up to that many programs per SM) and operand order (`gemm.SWAP_AB`); a setting's
    rows must be bitwise the same for M = 1 and 64 (checked here). The invariant b1 decode step spent 1.74 of
    5.41 ms in it (H100, protocol model, benchmarks/results/gpu-1207e/invariant_profile_b1.out), ~0.8 TB/s.
    Then the fixed-tile fp32-output GEMM (router, compressor) against cuBLAS's fp32 epilogue (the default's)."""
    keep = kgemm.SPLIT_FILL, kgemm.SWAP_AB, kgemm.BATCH_INVARIANT
    kgemm.BATCH_INVARIANT = True
    for name, (n, k, groups) in FP8_LINEARS.items():
        w, s = _fp8_block_weight(n, k, block)
        x64 = torch.randn(64, groups * k, device=DEV, dtype=BF)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, groups * k, device=DEV, dtype=BF) if m != 64 else x64
            nbytes, flops = w.numel() + s.numel() + x.numel() * 2 + m * n * 2, 2 * m * n * k
            for fill, swap in ((1.0, False), (2.0, False), (4.0, False), (8.0, False), (1.0, True), (4.0, True)):
                kgemm.SPLIT_FILL, kgemm.SWAP_AB = fill, swap
                split = kgemm.split_k(n, k, x.device)
                ms = bench(lambda: kgemm.linear_fp8_block(x, w, s, block, groups))
                same = "" if m != 1 else (" bitwise M1==M64" if torch.equal(
                    kgemm.linear_fp8_block(x64[:1].clone(), w, s, block, groups),
                    kgemm.linear_fp8_block(x64, w, s, block, groups)[:1]) else " ROWS DIFFER M1/M64")
                record(f"{name} M={m} fill {fill:g}{' swap' if swap else ''} (split {split}){same}", ms, None,
                       nbytes, flops, copy_gbs, gemm_tf)
    # the fixed-tile bf16 GEMM with fp32 output (router logits; compressor projections) against cuBLAS's epilogue
    for name, (n, k) in {"router": (384, 5120), "compressor 1024": (1024, 5120)}.items():
        w = (torch.randn(n, k, device=DEV) / 70).to(BF)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, device=DEV, dtype=BF)
            kgemm.BATCH_INVARIANT = False
            ms_c = bench(lambda: kgemm.linear_fp32_out(x, w))
            kgemm.BATCH_INVARIANT = True
            ms_k = bench(lambda: kgemm.linear_fp32_out(x, w))
            record(f"fp32_out {name} M={m} (ref: cuBLAS)", ms_k, ms_c, 2 * (n * k + m * k) + 4 * m * n, 2 * m * n * k,
                   copy_gbs, gemm_tf)
    kgemm.SPLIT_FILL, kgemm.SWAP_AB, kgemm.BATCH_INVARIANT = keep


def bench_gemm_threshold(copy_gbs, gemm_tf, block=(32, 32)):
    """The M where the FP8 block GEMM should leave the direct kernel for dequantise + cuBLAS (`gemm.DIRECT_MAX_M`),
    on the matrices the default path sends to it (split K: wq_a|wkv stacked, indexer wq_b; grouped wo_a)."""
    keep = kgemm.DIRECT_MAX_M, kgemm.BATCH_INVARIANT
    for name, (n, k, groups) in {"wq_a|wkv": (1792, 5120, 1), "indexer.wq_b": (4096, 1280, 1),
                                 "wo_a": (8192, 4096, 8)}.items():
        w, s = _fp8_block_weight(n, k, block)
        for m in (64, 128, 256, 512, 1024, 2048):
            x = torch.randn(m, groups * k, device=DEV, dtype=BF)
            nbytes, flops = w.numel() + s.numel() + x.numel() * 2 + m * n * 2, 2 * m * n * k
            kgemm.DIRECT_MAX_M, kgemm.BATCH_INVARIANT = 1 << 30, False
            ms_d = bench(lambda: kgemm.linear_fp8_block(x, w, s, block, groups))
            kgemm.DIRECT_MAX_M = 0
            ms_c = bench(lambda: kgemm.linear_fp8_block(x, w, s, block, groups))
            record(f"{name} M={m}: direct vs dequant+cuBLAS (ratio)", ms_d, ms_c, nbytes, flops, copy_gbs, gemm_tf)
    kgemm.DIRECT_MAX_M, kgemm.BATCH_INVARIANT = keep


#: (BM, BN, BK, warps, stages) swept per expert count, for the record; at 384 the decode candidates (a row's bits
#: must not change: the sweep prints whether they do against the default tiles)
MOE_TILES = {8: ((16, 64, 128, 4, 2), (32, 64, 128, 4, 2), (64, 128, 128, 8, 2), (64, 64, 256, 4, 2),
                 (128, 64, 128, 8, 2)),
             384: ((16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 64, 256, 4, 2), (16, 64, 256, 8, 3),
                   (16, 64, 128, 8, 3), (16, 128, 128, 8, 3), (32, 64, 128, 4, 2))}


def bench_moe(copy_gbs, gemm_tf, quick):
    """MXFP4 routed experts (kernels_nvidia.moe) at the full-width V4.1 widths (D=5120, I=2304, top-6): with 8
    experts against the oracle's bf16 grouped-GEMM path on the dequantised weights, and at the release count (384:
    at decode each token reads its own experts; the weights repeat the 8 experts, bytes do not change the speed; no
    torch row, 27 GB of bf16 experts). Bytes: the packed codes and scales of the experts the batch touches, x and
    the output; FLOPs: 2 * T*K * 3*D*I."""
    from kernels_nvidia import moe
    E8, D, I, K = 8, 5120, 2304, 6
    w8 = [torch.randint(0, 256, shape, device=DEV, dtype=torch.uint8) for shape in
          ((E8, 2 * I, D // 2), (E8, 2 * I, D // 32), (E8, D, I // 2), (E8, D, I // 32))]
    w8[1].clamp_(118, 126)  # random codes with scales 2^-9..2^-1: finite outputs
    w8[3].clamp_(118, 126)
    w13, w2 = (dequant_mxfp4(c, sc, checked=False).to(BF) for c, sc in ((w8[0], w8[1]), (w8[2], w8[3])))
    per_expert = sum(t[0].numel() for t in w8)
    small = (1, 16, 64, 256) if quick else (1, 16, 64, 256, 4096)
    for E, sizes, sweep in ((E8, small, (16, 64, 4096)), (384, (1, 16, 64, 256), (1, 16, 64, 256))):
        w = w8 if E == E8 else [t.repeat(E // E8, *(1,) * (t.dim() - 1)) for t in w8]
        for t in sizes:
            ids = torch.rand(t, E, device=DEV).argsort(dim=1)[:, :K]
            weights = torch.rand(t, K, device=DEV)
            x = torch.randn(t, D, device=DEV, dtype=BF)
            nbytes = ids.unique().numel() * per_expert + 2 * x.numel() * 2
            flops = 2 * t * K * 3 * D * I
            ms_r = bench(lambda: ref.routed_experts(x, ids, weights, w13, w2, 10.0)) if E == E8 else None
            ms_k = bench(lambda: moe.routed_experts_packed(x, ids, weights, *w, 10.0))
            record(f"routed_experts_mxfp4 T={t} E={E} K={K}", ms_k, ms_r, nbytes, flops, copy_gbs, gemm_tf)
            if t * K <= moe.PAIRS_KERNEL_MAX:  # the routing glue's torch path instead of its one-program kernel
                keep, moe.PAIRS_KERNEL_MAX = moe.PAIRS_KERNEL_MAX, -1
                ms_g = bench(lambda: moe.routed_experts_packed(x, ids, weights, *w, 10.0))
                moe.PAIRS_KERNEL_MAX = keep
                record(f"  T={t} E={E} glue: kernel (ref: torch ops)", ms_k, ms_g, nbytes, flops, copy_gbs, gemm_tf)
            if t not in sweep:
                continue
            keep = moe.BN, moe.BK, moe.WARPS, moe.STAGES
            base = moe.routed_experts_packed(x, ids, weights, *w, 10.0)
            for tiles in MOE_TILES[E]:
                moe.BM, (moe.BN, moe.BK, moe.WARPS, moe.STAGES) = tiles[0], tiles[1:]
                try:
                    ms_k = bench(lambda: moe.routed_experts_packed(x, ids, weights, *w, 10.0))
                    same = torch.equal(moe.routed_experts_packed(x, ids, weights, *w, 10.0), base)
                    record(f"  T={t} E={E} BM,BN,BK,warps,stages={tiles}{'' if same else ' BITS DIFFER'}", ms_k,
                           None, nbytes, flops, copy_gbs, gemm_tf)
                except Exception as e:  # noqa: BLE001
                    print("  tiles", tiles, "failed:", type(e).__name__, str(e)[:200])
            moe.BM, (moe.BN, moe.BK, moe.WARPS, moe.STAGES) = None, keep


def bench_topk(copy_gbs, gemm_tf):
    """Decode top-k (kernels_nvidia.topk_rows, length-bounded radix select) on fixed-width rows (max_model_len /
    ratio + 1 columns: 1M / 4 + 1, 64k / 4 + 1, 4k / 4 + 1) with short (1k-4k) or full valid prefixes, vs the
    oracle's stable sort and the packed-key torch.topk on the same scores. GB/s counts the valid scores + the ids."""
    for n in (262145, 16385, 1025):
        for t in (1, 64, 256):
            short = torch.randint(1024, 4097, (t,), device=DEV).clamp(max=n)
            for fill, n_valid in (("short", short), ("full", torch.full((t,), n, device=DEV))):
                s = torch.randn(t, n, device=DEV).masked_fill(
                    torch.arange(n, device=DEV) >= n_valid.unsqueeze(1), float("-inf"))
                for k in (512, 1024):
                    nbytes = int(n_valid.sum()) * 4 + t * k * 8
                    ms_k = bench(lambda: kn.topk_rows(s, k, n_valid))
                    ms_r = bench(lambda: ref.topk_rows(s, k))
                    ms_p = bench(lambda: kidx.topk_rows_packed(s, k))
                    record(f"topk_rows T={t} N={n} n_valid={fill} k={k}", ms_k, ms_r, nbytes, 0, copy_gbs, gemm_tf)
                    record("  topk_rows_packed (torch.topk)", ms_p, ms_r, nbytes, 0, copy_gbs, gemm_tf)
                if t == 64 and n == 262145:  # sweep of the kernel's knobs at k=512, for the record
                    keep = ktopk.BLOCK, ktopk.WAVES, ktopk.SORT_WARPS
                    for knobs in ((512, 4, 8), (2048, 4, 8), (4096, 4, 8), (1024, 2, 8), (1024, 8, 8), (1024, 4, 4)):
                        ktopk.BLOCK, ktopk.WAVES, ktopk.SORT_WARPS = knobs
                        ms_k = bench(lambda: ktopk.topk_rows(s, 512, n_valid))
                        record(f"  BLOCK,WAVES,SORT_WARPS={knobs}", ms_k, None, int(n_valid.sum()) * 4 + t * 512 * 8, 0,
                               copy_gbs, gemm_tf)
                    ktopk.BLOCK, ktopk.WAVES, ktopk.SORT_WARPS = keep


def bench_router(copy_gbs, gemm_tf):
    """MoE router (kernels_nvidia.sqrtsoftplus_route: one program per token) at the release shape E=384, K=6 with
    a shared bias, vs the oracle (softplus, sqrt, add, stable sort, gather, sum, scale: ~10 kernels). GB/s counts
    the logits, the bias, the ids and the weights."""
    e, k = 384, 6
    bias = torch.randn(e, device=DEV) * 0.1
    for t in (1, 64, 256, 4096):
        logits = torch.randn(t, e, device=DEV) * 2
        nbytes = (t + 1) * e * 4 + t * k * 12
        ms_k = bench(lambda: kn.sqrtsoftplus_route(logits, bias, k, 2.5))
        ms_r = bench(lambda: ref.sqrtsoftplus_route(logits, bias, k, 2.5))
        record(f"sqrtsoftplus_route T={t} E={e} K={k}", ms_k, ms_r, nbytes, 0, copy_gbs, gemm_tf)
        if t in (64, 4096):  # warps per row program, for the record
            keep = krouter.WARPS
            for warps in (1, 2, 4, 8):
                krouter.WARPS = warps
                ms_k = bench(lambda: kn.sqrtsoftplus_route(logits, bias, k, 2.5))
                record(f"  warps={warps}", ms_k, None, nbytes, 0, copy_gbs, gemm_tf)
            krouter.WARPS = keep


def bench_engram(copy_gbs, gemm_tf):
    """Engram gate + residual add (kernels_nvidia.engram_inject: one program per token and stream) at V4.1 widths (hc 4 x 5120,
    keys and value as views of one [T, 5, 5120] projection) vs the oracle (~20 kernels). GB/s counts streams
    and keys read, value read, streams written (bf16)."""
    h, d = 4, 5120
    qw, kw = torch.rand(h, d, device=DEV) + 0.5, torch.rand(h, d, device=DEV) + 0.5
    for t in (1, 64, 256, 4096):
        streams = torch.randn(t, h, d, device=DEV).bfloat16()
        kv = torch.randn(t, h + 1, d, device=DEV).bfloat16()
        nbytes = t * (3 * h + 1) * d * 2
        ms_k = bench(lambda: kn.engram_inject(streams, kv[:, :h], kv[:, h], qw, kw, 1e-6))
        ms_r = bench(lambda: ref.engram_inject(streams, kv[:, :h], kv[:, h], qw, kw, 1e-6))
        record(f"engram_inject T={t} hc={h} D={d}", ms_k, ms_r, nbytes, 0, copy_gbs, gemm_tf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--only-fp8-linears", action="store_true", help="run the FP8 block GEMM section only")
    ap.add_argument("--moe-only", action="store_true", help="ceilings and the routed-experts rows only")
    ap.add_argument("--topk-only", action="store_true", help="ceilings and the decode top-k rows only")
    ap.add_argument("--invariant-gemms", action="store_true",
                    help="ceilings and the batch-invariant GEMM rows only (FP8 per gemm.SPLIT_FILL; fp32 output)")
    ap.add_argument("--gemm-threshold", action="store_true",
                    help="ceilings and the FP8 GEMM direct-vs-dequantise rows only (gemm.DIRECT_MAX_M)")
    ap.add_argument("--router-only", action="store_true",
                    help="ceilings and the MoE router and Engram injection rows only")
    args = ap.parse_args()
    global GRAPH
    GRAPH = not args.eager
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    copy_gbs, gemm_tf = ceilings()
    print("timing:", "CUDA-graph replays (GPU time)" if GRAPH else "eager launches", flush=True)
    print(f"CEILINGS copy {copy_gbs:.0f} GB/s (read+write), bf16 GEMM 8192^3 {gemm_tf:.0f} TFLOP/s", flush=True)
    if args.topk_only:
        bench_topk(copy_gbs, gemm_tf)
        return dump(args.json, copy_gbs, gemm_tf)
    if args.invariant_gemms:
        bench_invariant_gemms(copy_gbs, gemm_tf)
        return dump(args.json, copy_gbs, gemm_tf)
    if args.gemm_threshold:
        bench_gemm_threshold(copy_gbs, gemm_tf)
        return dump(args.json, copy_gbs, gemm_tf)
    if args.router_only:
        bench_router(copy_gbs, gemm_tf)
        bench_engram(copy_gbs, gemm_tf)
        return dump(args.json, copy_gbs, gemm_tf)
    if not args.moe_only:
        bench_fp8_linears(copy_gbs, gemm_tf, args.quick)
    if args.only_fp8_linears:
        return dump(args.json, copy_gbs, gemm_tf)
    bench_moe(copy_gbs, gemm_tf, args.quick)
    if args.moe_only:
        return dump(args.json, copy_gbs, gemm_tf)
    H, d, scale = 64, 512, 512 ** -0.5
    sink = torch.randn(H, device=DEV)

    # --- sparse attention, decode: every token its own 128 window + 512 selected rows (gather form)
    pool = torch.randn(65536, d, device=DEV, dtype=BF) * 0.5
    for t in (1, 16, 64, 256):
        q = torch.randn(t, H, d, device=DEV, dtype=BF)
        idx = torch.randint(0, pool.shape[0], (t, 640), device=DEV, dtype=torch.int32)
        nbytes = t * 640 * d * 2 + 2 * q.numel() * 2 + t * 640 * 4
        flops = 4 * t * H * 640 * d
        ms_k = bench(lambda: kn.sparse_attention_indexed(q, pool, idx, sink, scale))
        ms_r = bench(lambda: ref.sparse_attention_indexed(q, pool, idx, sink, scale)) if t <= 64 else None
        record(f"attn_decode_indexed T={t} K=640", ms_k, ms_r, nbytes, flops, copy_gbs, gemm_tf)
    # tile sweep at T=64 (decode) for the record
    q = torch.randn(64, H, d, device=DEV, dtype=BF)
    idx = torch.randint(0, pool.shape[0], (64, 640), device=DEV, dtype=torch.int32)
    for tt in (1, 64, 256):
        q = torch.randn(tt, H, d, device=DEV, dtype=BF)
        idx = torch.randint(0, pool.shape[0], (tt, 640), device=DEV, dtype=torch.int32)
        for split in (False, True):
            for tiles in ((16, 64, 4), (32, 32, 8), (32, 64, 8), (64, 32, 8), (64, 64, 8)):
                kattn.TILES, kattn.SPLIT = tiles, split
                try:
                    ms_k = bench(lambda: kn.sparse_attention_indexed(q, pool, idx, sink, scale))
                    record(f"  T={tt} split={int(split)} BH,BN,warps={tiles}", ms_k, None,
                           tt * 640 * d * 2 + 4 * q.numel(), 4 * tt * H * 640 * d, copy_gbs, gemm_tf)
                except Exception as e:  # noqa: BLE001
                    print("  tiles", tiles, "failed:", type(e).__name__, str(e)[:200])
    kattn.TILES = kattn.SPLIT = None

    # --- sparse attention, prefill of one request: T queries, window 128 + 512 selected compressed rows
    for t in ((1024,) if args.quick else (1024, 4096)):
        n_cmp = t // 2
        keys = torch.randn(t + n_cmp, d, device=DEV, dtype=BF) * 0.5
        q = torch.randn(t, H, d, device=DEV, dtype=BF)
        pos = torch.arange(t, device=DEV)
        dist = pos[:, None] - pos[None, :]
        win = (dist >= 0) & (dist < 128)
        sel = torch.rand(t, n_cmp, device=DEV) < (512 / n_cmp)
        sel &= torch.arange(n_cmp, device=DEV)[None, :] < ((pos + 1) // 2)[:, None]
        allowed = torch.cat((win, sel), dim=1)
        n_allowed = int(allowed.sum())
        nbytes = keys.numel() * 2 + 2 * q.numel() * 2 + allowed.numel()
        flops = 4 * H * n_allowed * d
        ms_k = triton.testing.do_bench(lambda: kn.sparse_attention(q, keys, allowed, sink, scale),
                                       return_mode="median")  # eager: the mask->ids conversion syncs
        ms_r = bench(lambda: ref.sparse_attention(q, keys, allowed, sink, scale), rep=20) if t <= 1024 else None
        record(f"attn_prefill_mask T={t} N={t + n_cmp} (->gather)", ms_k, ms_r, nbytes, flops, copy_gbs, gemm_tf)
        ids = kattn.mask_to_indices(allowed)
        ms_k = bench(lambda: kn.sparse_attention_indexed(q, keys, ids, sink, scale))
        record(f"  gather kernel alone T={t} K={ids.shape[1]}", ms_k, None, nbytes, flops, copy_gbs, gemm_tf)
        kattn.GATHER_FROM_T = 1 << 30
        ms_k = bench(lambda: kn.sparse_attention(q, keys, allowed, sink, scale))
        kattn.GATHER_FROM_T = 64
        record(f"  mask kernel T={t}", ms_k, None, nbytes, flops, copy_gbs, gemm_tf)

    # --- indexer scores + top-k
    for t, n in ((1, 8192), (64, 8192), (2048, 4096)):
        qi = torch.randn(t, 64, 128, device=DEV, dtype=BF)
        w = torch.randn(t, 64, device=DEV)
        k = torch.randn(n, 128, device=DEV, dtype=BF)
        nbytes = qi.numel() * 2 + w.numel() * 4 + k.numel() * 2 + t * n * 4
        ms_k = bench(lambda: kn.indexer_scores(qi, w, k))
        ms_r = bench(lambda: ref.indexer_scores(qi, w, k))
        record(f"indexer_scores T={t} N={n}", ms_k, ms_r, nbytes, 2 * t * 64 * n * 128, copy_gbs, gemm_tf)
        kidx.HEADS_AS_ROWS = False
        ms_k = bench(lambda: kn.indexer_scores(qi, w, k))
        kidx.HEADS_AS_ROWS = True
        record(f"  indexer_scores token-tile kernel T={t}", ms_k, None, nbytes, 2 * t * 64 * n * 128, copy_gbs, gemm_tf)
    bench_topk(copy_gbs, gemm_tf)  # the packed torch.topk rows too, beside the radix select
    bench_router(copy_gbs, gemm_tf)
    bench_engram(copy_gbs, gemm_tf)

    # --- paged cache slots (decode addressing: window rows, selected rows), kernel vs the oracle's torch ops
    bt = torch.randint(1, 60000, (256, 64), device=DEV, dtype=torch.int32)
    for t in (1, 64, 256):
        req = torch.arange(t, device=DEV)
        pos = torch.randint(200, 4000, (t,), device=DEV)
        sel = torch.randint(-1, 1000, (t, 512), device=DEV)
        ms_k = bench(lambda: kn.range_slots(bt, req, pos - 127, 128, None, 1, 64, 64))
        ms_r = bench(lambda: ref.range_slots(bt, req, pos - 127, 128, None, 1, 64, 64))
        record(f"range_slots (window) T={t} W=128", ms_k, ms_r, t * 128 * 12, 0, copy_gbs, gemm_tf)
        ms_k = bench(lambda: kn.row_slots(bt, req.unsqueeze(1), sel, 4, 256, 64, True))
        ms_r = bench(lambda: ref.row_slots(bt, req.unsqueeze(1), sel, 4, 256, 64, True))
        record(f"row_slots (selected, masked) T={t} K=512", ms_k, ms_r, t * 512 * 20, 0, copy_gbs, gemm_tf)

    # --- mHC
    hc, D = 4, 4096
    fn = torch.randn(24, hc * D, device=DEV) * 0.02
    base, sc = torch.randn(24, device=DEV), torch.rand(3, device=DEV)
    for t in (1, 64, 4096):
        st = torch.randn(t, hc, D, device=DEV, dtype=BF)
        nbytes = st.numel() * 2 + fn.numel() * 4 + t * 24 * 4
        ms_k = bench(lambda: kn.hc_coefficients(st, fn, base, sc, 1e-20, 1e-6, 20))
        ms_r = bench(lambda: ref.hc_coefficients(st, fn, base, sc, 1e-20, 1e-6, 20))
        record(f"hc_coefficients T={t}", ms_k, ms_r, nbytes, 2 * t * hc * D * 24, copy_gbs, gemm_tf)
        w = torch.rand(t, hc, device=DEV)
        ms_k = bench(lambda: kn.hc_collapse(st, w))
        ms_r = bench(lambda: ref.hc_collapse(st, w))
        record(f"hc_collapse T={t}", ms_k, ms_r, st.numel() * 2 + t * D * 2, 2 * t * hc * D, copy_gbs, gemm_tf)
        y = torch.randn(t, D, device=DEV, dtype=BF)
        post, comb = torch.rand(t, hc, device=DEV), torch.rand(t, hc, hc, device=DEV)
        ms_k = bench(lambda: kn.hc_expand(st, y, post, comb))
        ms_r = bench(lambda: ref.hc_expand(st, y, post, comb))
        record(f"hc_expand T={t}", ms_k, ms_r, 2 * st.numel() * 2 + y.numel() * 2, 2 * t * hc * hc * D,
               copy_gbs, gemm_tf)

    # --- compressor pooling (V4.1 ratio 2, V4 CSA 8 slots x 512, V4 HCA 128 slots x 512)
    for g, s_, c in ((2048, 2, 512), (65536, 2, 512), (16384, 8, 512), (1024, 128, 512)):
        v = torch.randn(g, s_, c, device=DEV)
        lg = torch.randn(g, s_, c, device=DEV)
        ms_k = bench(lambda: kn.softmax_pool(v, lg))
        ms_r = bench(lambda: ref.softmax_pool(v, lg))
        record(f"softmax_pool G={g} S={s_} c={c}", ms_k, ms_r, 2 * v.numel() * 4 + g * c * 4, 0, copy_gbs, gemm_tf)

    dump(args.json, copy_gbs, gemm_tf)


def dump(path, copy_gbs, gemm_tf):
    if path:
        with open(path, "w") as f:
            json.dump(dict(copy_gbs=copy_gbs, gemm_tflops=gemm_tf, device=torch.cuda.get_device_name(),
                           torch=torch.__version__, triton=triton.__version__, rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
