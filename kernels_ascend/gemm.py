"""Block-FP8 linear y = x W^T (model-spec §4.2), weight-only: one Triton kernel.

W is stored as E4M3 codes [N, K] with one E8M0 scale per (BN_s x BK_s) block. A task is one BM x BN
output tile; it walks K in fixed BK chunks (64, or the scale block when smaller: a chunk has one scale
per row), decodes the codes to fp32 in the vector unit (exact), scales them, rounds them to x.dtype
(exact: 3 mantissa bits) and multiplies on the cube unit with fp32 accumulation. The product equals
the oracle's (dequantise, cast, matmul) up to the summation order.

Native formats: the 950's cube unit multiplies FP8 (E4M3) operands directly; a torch_npu quantised
matmul with per-block scales would read the same bytes without the decode and also quantise x. That
needs the NPU to test; this kernel keeps the checkpoint format bit for bit and x unquantised.
`groups` > 1 (the grouped `wo_a`, block-diagonal): output column n belongs to group n // (N / G) and
reads x columns of that group; a tile must not straddle groups ((N / G) % BN == 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend.common import F32DOT, dot, e4m3, e8m0, grid, is_pow2

BM, BN, BK = 16, 64, 64


@triton.jit
def _fp8_block_kernel(X, W, S, Y, M, N, K, R, sx_m, sw_n, ss_n, sy_m, SBN, SBK,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """R = output columns per group (N when ungrouped); group g reads x columns [g K, (g+1) K)."""
    n_mb = (M + BM - 1) // BM
    n_nb = (N + BN - 1) // BN
    for task in range(tl.program_id(0), n_mb * n_nb, tl.num_programs(0)):
        offs_m = (task % n_mb) * BM + tl.arange(0, BM)
        n0 = (task // n_mb) * BN
        offs_n = n0 + tl.arange(0, BN)
        mmask, nmask = offs_m < M, offs_n < N
        xk0 = (n0 // R) * K
        acc = tl.full([BM, BN], 0.0, tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            kmask = offs_k < K
            x = tl.load(X + offs_m[:, None] * sx_m + xk0 + offs_k[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)
            codes = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=nmask[:, None] & kmask[None, :],
                            other=0)
            sc = e8m0(tl.load(S + (offs_n // SBN) * ss_n + k0 // SBK, mask=nmask, other=127))
            w = (e4m3(codes) * sc[:, None]).to(x.dtype)
            acc += dot(x, tl.trans(w), F32)
        tl.store(Y + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def linear_fp8_block(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     groups: int = 1) -> torch.Tensor:
    """x [T, G*K] (bf16/fp16/fp32); w E4M3 [N, K]; scale E8M0 bytes [ceil(N/BN_s), ceil(K/BK_s)] -> [T, N]."""
    sbn, sbk = (block, block) if isinstance(block, int) else block
    n, k = w.shape
    if w.element_size() != 1 or scale.element_size() != 1 or x.dtype not in (torch.bfloat16, torch.float16,
                                                                            torch.float32):
        raise NotImplementedError(f"fp8 block linear takes E4M3 w and E8M0 scale bytes; got {w.dtype}, {scale.dtype}")
    bk = min(BK, sbk)   # a chunk never straddles a scale block: V4.1's 32 x 32, V4's 128 x 128
    if not is_pow2(sbk) or sbk < 16 or n % groups or (groups > 1 and (n // groups) % BN):
        raise NotImplementedError(f"scale block K {sbk} must be a power of two >= 16; "
                                  f"group width {n // groups} a multiple of {BN}")
    if x.shape[1] != groups * k:
        raise ValueError(f"x has {x.shape[1]} columns, expected {groups} x {k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w8, s8 = w.view(torch.uint8), scale.view(torch.uint8)
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _fp8_block_kernel[grid(triton.cdiv(m, BM) * triton.cdiv(n, BN))](
        x, w8, s8, y, m, n, k, n // groups, x.stride(0), w8.stride(0), s8.stride(0), y.stride(0), sbn, sbk,
        BM=BM, BN=BN, BK=bk, F32=F32DOT)
    return y
