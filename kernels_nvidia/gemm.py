"""Weight-only FP8 block GEMM: y = x @ dequant(W)^T with the E4M3 codes and E8M0 block scales read directly.

    W[n, k] = e4m3(codes[n, k]) * 2**(scale[n // BN, k // BK] - 127)      (model-spec §4.2)
    y[m, n] = sum_k x[m, k] * W[n, k]                     x, y: bf16; fp32 accumulation

E4M3 times a power of two is exact in bf16, so each dequantised tile equals the bf16 weight the torch
path builds at load, and y equals the bf16 reference up to the fp32 accumulation order.

`groups` > 1 is the block-diagonal (grouped low-rank) product of the attention output projection
`wo_a`: output rows [g*N/G, (g+1)*N/G) of W read input columns [g*K, (g+1)*K) of x (x: [M, G*K]).

Strategies (selected by M only above a fixed threshold):
* direct (`_fp8_gemm_kernel`, every M <= DIRECT_MAX_M, and every M when BATCH_INVARIANT): grid over
  (N tiles, M tiles, K splits) with one fixed tile shape, each split's K loop in order, one tl.dot per
  K tile. A matrix with few N tiles (thin N: wq_a 1280 x 5120 has 20) splits K into `split_k(N, K)`
  ranges, a number fixed by the matrix and the GPU's SM count, never by M; the fp32 partials are summed
  in split order by `_sum_splits_kernel`. A row's result is bitwise the same whatever M is
  (batch-invariant). Memory-bound in decode: W is read once per M tile (a second M tile re-reads it
  from L2). `SWAP_AB` (on) swaps the operands: the same fixed weight tile and K order with the tokens as the
  tensor-core N dimension, their tile chosen from M.
* dequant + cuBLAS (M > DIRECT_MAX_M, prefill): `_dequant_kernel` writes W to a bf16 scratch, then
  torch.matmul. cuBLAS picks its algorithm from M, so rows depend on M there; set
  KERNELS_NVIDIA_BATCH_INVARIANT=1 (or `gemm.BATCH_INVARIANT = True`) to keep the direct kernel for all M.

Both are sync-free (no host reads of device data) and CUDA-graph capturable; the scratch of the prefill
path and the split partials come from torch's caching allocator.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BATCH_INVARIANT = os.environ.get("KERNELS_NVIDIA_BATCH_INVARIANT", "0") == "1"
# Above: dequantise to a bf16 scratch + cuBLAS (not batch-invariant). H100, V4.1 widths (2026-12-06): the direct
# kernel ran the thin linears of a 1 x 1024 prefill at ~244 TFLOP/s end to end (triton 3.7.1: 2.19 ms for 19
# calls) and of a b256 decode step at ~197 (0.93 ms); dequantise + cuBLAS (`bench_kernels.py --gemm-threshold`)
# takes wo_a 83 / 100 / 154 us at M 256 / 512 / 1024 (214 / 343 / 446 TFLOP/s), so it wins above 256.
DIRECT_MAX_M = 256
# Fixed tiles of the direct kernel (never chosen from M): tokens x output features x K; a K tile spans
# 128 / BK scale blocks (V4.1: 4 of 32), one scale byte loaded per block and row.
TILE_M, TILE_N, TILE_K, WARPS, STAGES = 64, 64, 128, 4, 4
FP32_OUT_TILE_K = 64  # K chunk of the batch-invariant bf16 GEMM with fp32 output (bf16 operand tiles)
MIN_SPLIT_TILES = 4   # K tiles per split at least
# Programs per SM the N tiles x K splits of a launch may reach (`split_k`). H100 decode A/B (2026-12-08,
# `bench_kernels.py --invariant-gemms`, V4.1 linears, M 1 / 16 / 64, swapped operands): fill 4 beats 1 by 1.2-1.9x on
# wo_b, wo_a and shared w1|w3, equal elsewhere; `ops.marlin.faster_than_triton` keeps 1 (its recorded threshold).
SPLIT_FILL = 4.0
# Swapped operands (`_fp8_gemm_kernel` SWAP): the token tile follows M (SWAP_TOKEN_TILES: (at most M, tile), else
# SWAP_TOKEN_TILE_LARGE), so decode reads 16-row activation tiles instead of 64-row ones and more programs fit an
# SM. H100 (same A/B): 1.2-2.3x at M 1-16 on every V4.1 linear, rows bitwise equal between M 1 and M 64.
SWAP_AB = True
SWAP_TOKEN_TILES = ((16, 16), (32, 32), (64, 64))
SWAP_TOKEN_TILE_LARGE = 128
SPLIT_ROWS = 1024     # rows per launch when K is split: bounds the fp32 partials (split * rows * N * 4 B)
_SMS: dict[int, int] = {}  # CUDA device index -> SM count
# Triton's interpreter multiplies bf16 tl.dot operands wrongly (triton 3.6); there the dequantised tiles go
# to tl.dot as fp32 (exact: bf16 values, IEEE products), on the GPU as bf16.
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dequant(codes, s_ptrs, k0, K, rmask, BK: tl.constexpr):
    """E4M3 codes [R, C] (columns k0 .. k0 + C) times their blocks' 2**(byte - 127) -> bf16, exact.

    s_ptrs [R]: each row's scale-row pointer; one byte per BK columns is loaded ([R, C / BK], not one per
    element) and broadcast in registers. The power of two is built from its fp32 exponent bits (byte 0 gives 0
    instead of 2**-127; bytes 1..254)."""
    R: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    WIDTH: tl.constexpr = BK if BK < C else C      # columns sharing one scale byte inside the tile
    kg = k0 + WIDTH * tl.arange(0, C // WIDTH)
    sb = tl.load(s_ptrs[:, None] + (kg // BK)[None, :], mask=rmask[:, None] & (kg < K)[None, :], other=127)
    scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    w = tl.reshape(codes.to(tl.float32), (R, C // WIDTH, WIDTH)) * scale[:, :, None]
    return tl.reshape(w, (R, C)).to(tl.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(X, W, S, Y, M, N, K, sx_m, sy_m, sy_s, s_sn, n_group, k_split,
                     BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, DOT_F32: tl.constexpr, SWAP: tl.constexpr):
    """Y[m, n] = sum_k X[m, g(n)*K + k] * W[n, k], g(n) = n // n_group, over this program's K range
    [pid_s * k_split, +k_split). X bf16, W E4M3 [N, K], S uint8; Y bf16, or the fp32 partial of split
    pid_s at Y + pid_s * sy_s when PARTIAL. SWAP: the transposed product acc[n, m] = W tile @ X^T tile, so the
    weight rows are the tensor-core M dimension (fixed) and the tokens its N dimension (`swap_token_tile`)."""
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = offs_m < M, offs_n < N
    x_rows = X + offs_m.to(tl.int64) * sx_m + (pid_n * BLOCK_N // n_group) * K  # [BLOCK_M] row pointers
    w_base = W + offs_n[:, None].to(tl.int64) * K
    s_base = S + (offs_n // BN) * s_sn
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_s * k_split
    for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        codes = tl.load(w_base + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        w = _dequant(codes, s_base, k0, K, nmask, BK)
        if SWAP:
            xt = tl.load(x_rows[None, :] + offs_k[:, None], mask=kmask[:, None] & mmask[None, :], other=0.0)
            if DOT_F32:
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(w, xt)
        else:
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
    if SWAP:
        y = Y + offs_m[None, :].to(tl.int64) * sy_m + offs_n[:, None]
        mask = nmask[:, None] & mmask[None, :]
    else:
        y = Y + offs_m[:, None].to(tl.int64) * sy_m + offs_n[None, :]
        mask = mmask[:, None] & nmask[None, :]
    if PARTIAL:
        tl.store(y + pid_s.to(tl.int64) * sy_s, acc, mask=mask)
    else:
        tl.store(y, acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _sum_splits_kernel(P, Y, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Y[i] = sum_s P[s, i] in split order (s = 0, 1, ...), stored in Y's dtype (bf16 / fp32); P fp32 [SPLIT, MN]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(P + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gemm_fp32_out_kernel(X, W, Y, M, N, K, sx_m, sw_n, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """Y[s, m, n] = sum_k X[m, k] * W[n, k] over split s's K range [s * k_split, (s + 1) * k_split) in fp32
    (bf16 / fp16 operands: exact products), in BLOCK_K chunks in order; Y fp32 [splits, M, N] contiguous."""
    pid_n, pid_m, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = offs_m < M, offs_n < N
    Y += sp.to(tl.int64) * M * N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(sp * k_split, tl.minimum(K, (sp + 1) * k_split), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * sx_m + offs_k[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(W + offs_n[:, None].to(tl.int64) * sw_n + offs_k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _dequant_kernel(W, S, OUT, N, K, s_sn, BN: tl.constexpr, BK: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[n, k] = bf16(W[n, k] * 2**(S[n // BN, k // BK] - 127))."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    idx = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    codes = tl.load(W + idx, mask=mask, other=0.0)
    k0 = tl.program_id(1) * BLOCK_K
    tl.store(OUT + idx, _dequant(codes, S + (offs_n // BN) * s_sn, k0, K, offs_n < N, BK), mask=mask)


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], groups: int) -> None:
    n, k = w.shape
    bn, bk = block
    if x.dtype != torch.bfloat16 or w.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8:
        raise NotImplementedError(f"fp8 block GEMM takes bf16 x, E4M3 w, uint8 scale; got "
                                  f"{x.dtype}, {w.dtype}, {scale.dtype}")
    if x.shape[-1] != groups * k or n % groups:
        raise ValueError(f"x {tuple(x.shape)} / w {tuple(w.shape)}: expected x[..., {groups}*{k}], N % {groups} == 0")
    if tuple(scale.shape) != (triton.cdiv(n, bn), triton.cdiv(k, bk)):
        raise ValueError(f"scale {tuple(scale.shape)} does not match w {tuple(w.shape)} with block {bn}x{bk}")
    if bk & (bk - 1) or (groups > 1 and (n // groups) % TILE_N):
        raise NotImplementedError(f"block K {bk} not a power of two or group width {n // groups} not a "
                                  f"multiple of {TILE_N}")


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 off CUDA: the interpreter runs the H200's split)."""
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def swap_token_tile(m: int) -> int:
    """Token tile of the swapped FP8 GEMM (`SWAP_AB`) for a launch of m rows."""
    return next((tile for most, tile in SWAP_TOKEN_TILES if m <= most), SWAP_TOKEN_TILE_LARGE)


def split_k(n: int, k: int, device: torch.device, fill: float | None = None) -> int:
    """K splits of an [N, K] matrix (N: every output column of the launch, all groups): doubled while the
    doubled N tiles x splits stay within `fill` (default SPLIT_FILL) programs per SM and every split keeps
    MIN_SPLIT_TILES K tiles (V4.1 at fill 1: wq_a|wkv 4, wkv 8, indexer wq_b 2, the rest 1). Depends on the
    matrix and the GPU only (batch-invariant)."""
    n_tiles, k_tiles, sms = triton.cdiv(n, TILE_N), triton.cdiv(k, TILE_K), _sm_count(device)
    fill = SPLIT_FILL if fill is None else fill
    split = 1
    while 2 * n_tiles * split <= fill * sms and k_tiles >= 2 * split * MIN_SPLIT_TILES:
        split *= 2
    return split


def _split_len(k: int, split: int, tile_k: int) -> int:
    """K columns per split of a K split `split` ways in whole `tile_k` chunks."""
    return triton.cdiv(triton.cdiv(k, tile_k), split) * tile_k


def _sum_splits(part: torch.Tensor, out: torch.Tensor) -> None:
    """out (contiguous, bf16 / fp32) = the fp32 partials summed in split order; part: [split, ...] whose first
    split * out.numel() values hold them as [split, out.numel()] (a launch of fewer rows uses its head)."""
    mn = out.numel()
    _sum_splits_kernel[(triton.cdiv(mn, 1024),)](part, out, mn, SPLIT=part.shape[0], BLOCK=1024)


def dequant_to_bf16(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """E4M3 w [N, K] + uint8 E8M0 scale [ceil(N/BN), ceil(K/BK)] -> bf16 [N, K] (one pass)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(n, 32), triton.cdiv(k, 128))
    _dequant_kernel[grid](w, scale, out, n, k, scale.stride(0), BN=block[0], BK=block[1], BLOCK_N=32, BLOCK_K=128)
    return out


def linear_fp8_block(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     groups: int = 1) -> torch.Tensor:
    """x [..., G*K] bf16; w E4M3 [N, K]; scale uint8 [ceil(N/BN), ceil(K/BK)] -> y [..., N] bf16.
    groups = G > 1: block-diagonal product (group g of x times rows g*N/G.. of W)."""
    _check(x, w, scale, block, groups)
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > DIRECT_MAX_M and not BATCH_INVARIANT:
        wd = dequant_to_bf16(w, scale, block)
        if groups == 1:
            return (x2 @ wd.t()).view(*lead, n)
        xg = x2.view(m, groups, k).transpose(0, 1)                         # [G, M, K]
        y = torch.bmm(xg, wd.view(groups, n // groups, k).transpose(1, 2))  # [G, M, N/G]
        return y.transpose(0, 1).reshape(*lead, n)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    split = split_k(n, k, x.device) if m else 1
    k_split = _split_len(k, split, TILE_K)
    rows = SPLIT_ROWS if split > 1 else max(m, 1)
    part = torch.empty(split, min(m, rows), n, dtype=torch.float32, device=x.device) if split > 1 else y
    for r0 in range(0, m, rows):  # a row's result does not depend on its launch
        r = min(rows, m - r0)
        out = part if split > 1 else y[r0:]
        tile_m = swap_token_tile(r) if SWAP_AB else TILE_M
        grid = (triton.cdiv(n, TILE_N), triton.cdiv(r, tile_m), split)
        _fp8_gemm_kernel[grid](x2[r0:], w, scale, out, r, n, k, x2.stride(0), n, r * n, scale.stride(0), n // groups,
                               k_split, BN=block[0], BK=block[1], BLOCK_M=tile_m, BLOCK_N=TILE_N, BLOCK_K=TILE_K,
                               PARTIAL=split > 1, DOT_F32=_DOT_F32, SWAP=SWAP_AB, num_warps=WARPS, num_stages=STAGES)
        if split > 1:
            _sum_splits(part, y[r0:r0 + r])
    return y.view(*lead, n)


def linear_fp32_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> fp32 [M, N] for bf16/fp16 operands: one tensor-core GEMM with an fp32
    epilogue (torch.mm out_dtype, cuBLAS; what vLLM's in-tree V4.1 runs for its router and compressor
    projections) instead of an fp32 SGEMM on casted copies. cuBLAS picks its algorithm from M, so
    batch-invariant mode runs `_gemm_fp32_out_kernel` instead: fixed tiles and the FP8 kernel's K split (`split_k`:
    by the matrix and the GPU only, partials summed in split order), so a row's result does not depend on M
    (before: vLLM's persistent GEMM on fp32 copies of both operands, the weight cast every call)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or x.dim() != 2:
        raise NotImplementedError("fp32-output GEMM takes 2-D bf16/fp16 operands of one dtype")
    if BATCH_INVARIANT:
        m, k = x.shape
        n = w.shape[0]
        x, w = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w))
        y = torch.empty(m, n, dtype=torch.float32, device=x.device)
        if m:
            split = split_k(n, k, x.device)
            k_split = _split_len(k, split, FP32_OUT_TILE_K)
            part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
            _gemm_fp32_out_kernel[(triton.cdiv(n, TILE_N), triton.cdiv(m, TILE_M), split)](
                x, w, part, m, n, k, x.stride(0), w.stride(0), k_split, BLOCK_M=TILE_M, BLOCK_N=TILE_N,
                BLOCK_K=FP32_OUT_TILE_K, DOT_F32=_DOT_F32, num_warps=WARPS, num_stages=STAGES)
            if split > 1:
                _sum_splits(part, y)
        return y
    try:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except TypeError as e:  # torch without the out_dtype epilogue
        raise NotImplementedError(str(e)) from e
