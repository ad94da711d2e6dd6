"""mHC (manifold-constrained hyper-connections, model-spec §3.2): Triton kernels.

* `hc_coefficients`: two launches. (1) split-K partial products mu_part = v . fn^T and sum(v^2)
  over chunks of the h*D reduction, BT tokens a program; (2) per token: sum the partials in split order,
  RMS scale, sigmoid pre/post and the full Sinkhorn (softmax + alternating normalisations) in registers,
  one [h, h] matrix per token. Tiles: (BT 16, KCHUNK 256) below WIDE_FROM_T tokens and always in
  batch-invariant mode (then they depend on the model width only, never on T); (BT 64, KCHUNK 1024) from
  WIDE_FROM_T tokens on (prefill): fn, read once per program, is then re-read 4x less, and the partials
  buffer is 4x smaller.
* `hc_collapse`: u = sum_j w_j X_j (fp32 accumulate), one pass over the streams.
* `hc_expand`: X'_k = post_k y + sum_j C_jk X_j, one pass (streams and y read once, streams written once).
Every reduction runs in a fixed order; with BATCH_INVARIANT every tile is fixed: batch-invariant.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# fixed tiles for every T (set by `vllm_deepinfer.ops.configure_invariant` in batch-invariant mode)
BATCH_INVARIANT = os.environ.get("KERNELS_NVIDIA_BATCH_INVARIANT", "0") == "1"
KCHUNK = 256  # split-K chunk of the coefficient GEMM (fixed: batch-invariant). 1024 gave 20 programs per
# 16 tokens at V4.1 widths (h*D = 20480): 22 us per call at T = 16 on the H200, most SMs idle.
WIDE_FROM_T, WIDE_BT, WIDE_KCHUNK = 1024, 64, 1024  # prefill tiles (not batch-invariant across the threshold;
# above the decode graph sizes). At BT 16 every program re-reads a [KCHUNK, MP] fp32 slice of fn from L2: 4x the
# bytes of its x tile (H100, 4096 tokens: 222 us a call).
TCHUNK = 4096  # tokens per launch pair: bounds the partials buffer (nsplit * TCHUNK * MP fp32, 42 MB)


@triton.jit
def _hc_mu_partial_kernel(X, FN, PART, SQ, T, K, M, sx_t, sfn_m,
                          KCHUNK: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr):
    ps = tl.program_id(1)
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_m = tl.arange(0, MP)
    tmask, mmask = offs_t < T, offs_m < M
    acc = tl.zeros([BT, MP], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    for k0 in range(0, KCHUNK, BK):
        offs_k = ps * KCHUNK + k0 + tl.arange(0, BK)
        kmask = offs_k < K
        x = tl.load(X + offs_t[:, None] * sx_t + offs_k[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        f = tl.load(FN + offs_m[None, :] * sfn_m + offs_k[:, None], mask=kmask[:, None] & mmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(x, f, input_precision="tf32x3")  # ~fp32 accuracy on tensor cores
        sq += tl.sum(x * x, 1)
    n_t = T
    tl.store(PART + (ps * n_t + offs_t[:, None]) * MP + offs_m[None, :], acc, mask=tmask[:, None])
    tl.store(SQ + ps * n_t + offs_t, sq, mask=tmask)


@triton.jit
def _sum_splits(PART, ps_stride, offs, mask, NSPLIT: tl.constexpr):
    v = tl.load(PART + offs, mask=mask, other=0.0)
    for s in range(1, NSPLIT):
        v += tl.load(PART + s * ps_stride + offs, mask=mask, other=0.0)
    return v


@triton.jit
def _hc_finalize_kernel(PART, SQ, BASE, SCALE, PRE, POST, COMB, T, K, rms_eps, hc_eps, iters,
                        NSPLIT: tl.constexpr, HC: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr):
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = offs_t < T
    j = tl.arange(0, HC)
    sq = _sum_splits(SQ, T, offs_t, tmask, NSPLIT)
    r = 1.0 / tl.sqrt(sq / K + rms_eps)
    s0 = tl.load(SCALE)
    s1 = tl.load(SCALE + 1)
    s2 = tl.load(SCALE + 2)
    m2 = tmask[:, None] & (j[None, :] >= 0)
    pre_mu = _sum_splits(PART, T * MP, offs_t[:, None] * MP + j[None, :], m2, NSPLIT) * r[:, None]
    post_mu = _sum_splits(PART, T * MP, offs_t[:, None] * MP + HC + j[None, :], m2, NSPLIT) * r[:, None]
    pre = tl.sigmoid(pre_mu * s0 + tl.load(BASE + j)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(post_mu * s1 + tl.load(BASE + HC + j)[None, :])
    tl.store(PRE + offs_t[:, None] * HC + j[None, :], pre, mask=m2)
    tl.store(POST + offs_t[:, None] * HC + j[None, :], post, mask=m2)
    jk = j[:, None] * HC + j[None, :]                                   # [HC, HC]: row j, column k
    m3 = tmask[:, None, None] & (jk[None, :, :] >= 0)
    mu = _sum_splits(PART, T * MP, offs_t[:, None, None] * MP + 2 * HC + jk[None, :, :], m3, NSPLIT)
    logits = mu * r[:, None, None] * s2 + tl.load(BASE + 2 * HC + jk)[None, :, :]
    e = tl.exp(logits - tl.max(logits, 2)[:, :, None])
    c = e / tl.sum(e, 2)[:, :, None] + hc_eps                           # softmax along each row
    c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)                          # column normalise
    for _ in range(iters - 1):
        c = c / (tl.sum(c, 2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
    tl.store(COMB + offs_t[:, None, None] * (HC * HC) + jk[None, :, :], c, mask=m3)


def hc_coefficients(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    rms_eps: float, hc_eps: float, sinkhorn_iters: int):
    """streams: [T, h, D]; fn: [(2+h)h, hD]; base: [(2+h)h]; scale: [3] -> pre [T,h], post [T,h], comb [T,h,h]."""
    t, h, d = streams.shape
    if h & (h - 1):
        raise NotImplementedError(f"hc_mult {h} must be a power of two")
    k = h * d
    m = fn.shape[0]
    mp = max(16, triton.next_power_of_2(m))
    x = streams.reshape(t, k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    fn, base, scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
    dev = streams.device
    wide = t >= WIDE_FROM_T and not BATCH_INVARIANT
    bt, kchunk = (WIDE_BT, WIDE_KCHUNK) if wide else (16, KCHUNK)
    nsplit = triton.cdiv(k, kchunk)
    pre = torch.empty(t, h, dtype=torch.float32, device=dev)
    post = torch.empty(t, h, dtype=torch.float32, device=dev)
    comb = torch.empty(t, h, h, dtype=torch.float32, device=dev)
    if t == 0:
        return pre, post, comb
    n = min(t, TCHUNK)
    part = torch.empty(nsplit, n, mp, dtype=torch.float32, device=dev)
    sq = torch.empty(nsplit, n, dtype=torch.float32, device=dev)
    for t0 in range(0, t, TCHUNK):  # a token's coefficients do not depend on its chunk
        c = min(TCHUNK, t - t0)
        _hc_mu_partial_kernel[(triton.cdiv(c, bt), nsplit)](
            x[t0:], fn, part, sq, c, k, m, x.stride(0), fn.stride(0),
            KCHUNK=kchunk, BT=bt, BK=64, MP=mp, num_warps=4, num_stages=3 if wide else 2)
        _finalize(part, sq, base, scale, pre[t0:], post[t0:], comb[t0:], c, k, rms_eps, hc_eps, sinkhorn_iters, h)
    return pre, post, comb


def _finalize(part, sq, base, scale, pre, post, comb, t: int, k: int, rms_eps: float, hc_eps: float, iters: int,
              h: int) -> None:
    """Sum the split partials part [S, >= t, MP] / sq [S, >= t] in split order, then pre, post, comb of t tokens."""
    bt = 16
    _hc_finalize_kernel[(triton.cdiv(t, bt),)](
        part, sq, base, scale, pre, post, comb, t, k, float(rms_eps), float(hc_eps), int(iters),
        NSPLIT=part.shape[0], HC=h, MP=part.shape[2], BT=bt, num_warps=4)


def hc_coefficients_from_partials(part: torch.Tensor, sq: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                                  k: int, rms_eps: float, hc_eps: float, sinkhorn_iters: int, h: int):
    """`hc_coefficients` from split-K partial products computed elsewhere (e.g. DeepGEMM's tf32 prenorm GEMM):
    part: [S, T, (2+h)h] = per split v . fn^T; sq: [S, T] = per split sum(v^2); k = h*D (the RMS divisor)
    -> pre [T,h], post [T,h], comb [T,h,h] (fp32)."""
    s, t, m = part.shape
    if h & (h - 1) or m != (2 + h) * h or sq.shape != (s, t):
        raise NotImplementedError(f"partials {tuple(part.shape)} / {tuple(sq.shape)} for hc_mult {h}")
    dev = part.device
    pre = torch.empty(t, h, dtype=torch.float32, device=dev)
    post = torch.empty(t, h, dtype=torch.float32, device=dev)
    comb = torch.empty(t, h, h, dtype=torch.float32, device=dev)
    if t:
        _finalize(part.contiguous(), sq.contiguous(), base.float().contiguous(), scale.float().contiguous(), pre,
                  post, comb, t, k, rms_eps, hc_eps, sinkhorn_iters, h)
    return pre, post, comb


@triton.jit
def _hc_collapse_kernel(X, W, OUT, D, sx_t, sx_j, sw_t, so_t, HC: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, HC)
    dmask = offs_d < D
    x = tl.load(X + t * sx_t + j[:, None] * sx_j + offs_d[None, :], mask=dmask[None, :], other=0.0).to(tl.float32)
    w = tl.load(W + t * sw_t + j).to(tl.float32)
    u = tl.sum(x * w[:, None], 0)
    tl.store(OUT + t * so_t + offs_d, u.to(OUT.dtype.element_ty), mask=dmask)


def hc_collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """u = sum_j w_j X_j. streams: [T, h, D]; weights: [T, h] -> [T, D] (streams.dtype)."""
    t, h, d = streams.shape
    if h & (h - 1):
        raise NotImplementedError(f"hc_mult {h} must be a power of two")
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    weights = weights.contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return out
    bd = 1024
    _hc_collapse_kernel[(t, triton.cdiv(d, bd))](
        streams, weights, out, d, streams.stride(0), streams.stride(1), weights.stride(0), out.stride(0),
        HC=h, BD=bd, num_warps=4)
    return out


@triton.jit
def _hc_expand_kernel(X, Y, POST, COMB, OUT, D, sx_t, sx_j, sy_t, sp_t, sc_t, so_t, so_j,
                      HC: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, HC)
    dmask = offs_d < D
    x = tl.load(X + t * sx_t + j[:, None] * sx_j + offs_d[None, :], mask=dmask[None, :], other=0.0).to(tl.float32)
    y = tl.load(Y + t * sy_t + offs_d, mask=dmask, other=0.0).to(tl.float32)
    post = tl.load(POST + t * sp_t + j).to(tl.float32)
    c = tl.load(COMB + t * sc_t + j[:, None] * HC + j[None, :]).to(tl.float32)   # [j, k]
    mixed = tl.sum(c[:, :, None] * x[:, None, :], 0)                              # [k, BD]
    out = mixed + post[:, None] * y[None, :]
    tl.store(OUT + t * so_t + j[:, None] * so_j + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=dmask[None, :])


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * y + sum_j comb[j, k] X_j. streams: [T, h, D]; y: [T, D] -> [T, h, D]."""
    t, h, d = streams.shape
    if h & (h - 1):
        raise NotImplementedError(f"hc_mult {h} must be a power of two")
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    out = torch.empty(t, h, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return out
    bd = 512
    _hc_expand_kernel[(t, triton.cdiv(d, bd))](
        streams, y, post, comb, out, d, streams.stride(0), streams.stride(1), y.stride(0), post.stride(0),
        comb.stride(0), out.stride(0), out.stride(1), HC=h, BD=bd, num_warps=4)
    return out
