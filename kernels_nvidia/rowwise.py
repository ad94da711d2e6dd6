"""Row-wise ops, RMSNorm, interleaved RoPE and the clamped SwiGLU activation, as single Triton kernels
(the oracle's formulas, fp32 math).

* `rms_norm(x, weight, eps)`: y = x / sqrt(mean(x^2) + eps) * weight per row, one program per row (the
  oracle runs five kernels: cast, square, mean, rsqrt, products).
* `apply_rope(x, cos, sin, inverse)`: the GPT-J rotation of the last 2 * cos.shape[-1] dims, the rest of
  each row copied, one program per (token, middle index) (the oracle: slices, casts, four products, a
  stack and a cat); `apply_rope_` the same in place, touching the rotated dims only, one program per token
  and up to 16 middle indices; `rope_cos_sin(positions, inv_freq, scale)` the fp32 cos / sin tables of a step.
* `swiglu(a, b, limit)`: silu(min(a, l)) * clamp(b, -l, l) of the two GEMM products, one pass over
  (possibly strided) rows (the oracle: two casts, two clamps, silu, product, cast).

Each row is computed by one program in a fixed order, independent of the batch (batch-invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Y, N, sx, sy, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + r * sx + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    if HAS_W:
        y = y * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + r * sy + offs, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., n]; weight: [n] or None -> x.dtype, the same shape."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows if weight is None else weight.contiguous(), y, n,
                                           rows.stride(0), y.stride(0), float(eps), HAS_W=weight is not None,
                                           BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return y.view(x.shape)


@triton.jit
def _rope_kernel(X, C, S, Y, M, NOPE, sx_t, sx_m, sc_t, sy_t, sy_m, SIGN: tl.constexpr,
                 BLOCK_N: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr, COPY: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    mmask = offs_m[:, None] < M
    x_rows = X + t * sx_t + offs_m[:, None].to(tl.int64) * sx_m          # [BM, 1]
    y_rows = Y + t * sy_t + offs_m[:, None].to(tl.int64) * sy_m
    if COPY:  # the part without rotation
        for n0 in range(0, NOPE, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)[None, :]
            m = mmask & (offs < NOPE)
            tl.store(y_rows + offs, tl.load(x_rows + offs, mask=m), mask=m)
    i = tl.arange(0, HALF)[None, :]
    a = tl.load(x_rows + NOPE + 2 * i, mask=mmask).to(tl.float32)
    b = tl.load(x_rows + NOPE + 2 * i + 1, mask=mmask).to(tl.float32)
    c = tl.load(C + t * sc_t + i)
    s = tl.load(S + t * sc_t + i) * SIGN
    tl.store(y_rows + NOPE + 2 * i, (a * c - b * s).to(Y.dtype.element_ty), mask=mmask)
    tl.store(y_rows + NOPE + 2 * i + 1, (b * c + a * s).to(Y.dtype.element_ty), mask=mmask)


def _rope_rows(x: torch.Tensor, cos: torch.Tensor) -> tuple[int, int]:
    """(half, n) of a rotation of x [N, ..., n] by cos [N, r/2], or NotImplementedError."""
    half, n = cos.shape[-1], x.shape[-1]
    if half & (half - 1) or 2 * half > n or cos.shape[0] != x.shape[0]:
        raise NotImplementedError(f"rotary half width {half} must be a power of two <= {n // 2}, one row per token")
    return half, n


def _launch_rope(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor, inverse: bool,
                 copy: bool) -> None:
    """rows, y: [N, M, n] (unit inner stride); rotates the last 2 * cos.shape[-1] dims of rows into y."""
    if not rows.numel():
        return
    half, n = cos.shape[-1], rows.shape[-1]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    bm = 1 if copy else min(16, triton.next_power_of_2(rows.shape[1]))
    _rope_kernel[(rows.shape[0], triton.cdiv(rows.shape[1], bm))](
        rows, cos, sin, y, rows.shape[1], n - 2 * half, rows.stride(0), rows.stride(1), cos.stride(0),
        y.stride(0), y.stride(1), SIGN=-1.0 if inverse else 1.0, BLOCK_N=256, HALF=half, BM=bm, COPY=copy,
        num_warps=2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: [N, ..., n]; cos/sin: [N, r/2] fp32 (r/2 a power of two) -> x.dtype, the same shape."""
    _, n = _rope_rows(x, cos)
    rows = x.reshape(x.shape[0], -1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch_rope(rows, cos, sin, y, inverse, copy=True)
    return y.view(x.shape)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` in place: reads and writes only the rotated 2 * cos.shape[-1] dims of x [N, ..., n]
    (the copying form moves whole rows: 8x the bytes for 512-wide heads with 64 rotated dims). Returns x."""
    _, n = _rope_rows(x, cos)
    try:
        rows = x.view(x.shape[0], -1, n)
    except RuntimeError:
        raise NotImplementedError("apply_rope_ needs x viewable as [N, M, n]") from None
    if rows.stride(-1) != 1:
        raise NotImplementedError("apply_rope_ needs a unit inner stride")
    _launch_rope(rows, cos, sin, rows, inverse, copy=False)
    return x


@triton.jit
def _rope_cos_sin_kernel(P, F, C, S, N, scale, HALF: tl.constexpr, BN: tl.constexpr):
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    m = offs < N
    pos = (tl.load(P + offs, mask=m, other=0).to(tl.int64) * scale).to(tl.float64)
    angle = pos[:, None] * tl.load(F + tl.arange(0, HALF))[None, :]                # fp64, as the oracle
    out = offs[:, None].to(tl.int64) * HALF + tl.arange(0, HALF)[None, :]
    tl.store(C + out, tl.cos(angle).to(tl.float32), mask=m[:, None])
    tl.store(S + out, tl.sin(angle).to(tl.float32), mask=m[:, None])


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] int (times `scale`); inv_freq [r/2] fp64 -> fp32 (cos, sin) [N, r/2]: the oracle's fp64 angles
    and libdevice cos / sin rounded to fp32, one launch (the oracle: a cast, a product, cos, sin, two casts)."""
    half = inv_freq.shape[-1]
    if half & (half - 1) or inv_freq.dtype != torch.float64 or positions.dim() != 1 or positions.is_floating_point():
        raise NotImplementedError("rope_cos_sin takes integer positions [N] and power-of-two fp64 frequencies")
    n = positions.shape[0]
    cos = torch.empty(n, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        bn = 16
        _rope_cos_sin_kernel[(triton.cdiv(n, bn),)](positions.contiguous(), inv_freq.contiguous(), cos, sin, n,
                                                    int(scale), HALF=half, BN=bn, num_warps=2,
                                                    enable_fp_fusion=False)  # the angle is rounded before cos
    return cos, sin


@triton.jit
def _swiglu_kernel(A, B, Y, N, sa, sb, sy, limit, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.minimum(tl.load(A + r * sa + offs, mask=mask, other=0.0).to(tl.float32), limit)
    b = tl.load(B + r * sb + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.minimum(tl.maximum(b, -limit), limit)
    tl.store(Y + r * sy + offs, (a / (1.0 + tl.exp(-a)) * b).to(Y.dtype.element_ty), mask=mask)


def swiglu(a: torch.Tensor, b: torch.Tensor, limit: float) -> torch.Tensor:
    """a, b: [T, I] (rows may be strided, e.g. the halves of one [T, 2I] product) -> [T, I] in a's dtype."""
    if a.dim() != 2 or a.shape != b.shape or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise NotImplementedError("swiglu takes two [T, I] operands with unit inner stride")
    y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if a.numel():
        block = 1024
        _swiglu_kernel[(a.shape[0], triton.cdiv(a.shape[1], block))](
            a, b, y, a.shape[1], a.stride(0), b.stride(0), y.stride(0), float(limit), BLOCK=block, num_warps=4)
    return y
