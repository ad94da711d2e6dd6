"""mHC (manifold-constrained hyper-connections, model-spec §3.2): three Triton kernels, vector unit, fp32.

* `hc_coefficients`: a task is one token: mu = v . fn^T over the h*D reduction in fixed BK chunks (the
  pre, post and comb rows of fn as three products), the RMS scale, sigmoid pre/post and the Sinkhorn
  normalisation of the [h, h] comb matrix, all in registers.
* `hc_collapse`: a task is one token x BD columns: u = sum_j w_j X_j, j in order.
* `hc_expand`: a task is one token x BD columns: X'_k = post_k y + sum_j comb[j, k] X_j, j in order.
h (the number of streams) must be a power of two (4 in both models).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend.common import grid, is_pow2

BK = 512   # reduction chunk of the coefficient GEMV (fixed: batch-invariant)
BD = 256   # columns per collapse/expand task


@triton.jit
def _hc_coefficients_kernel(X, FN, BASE, SCALE, PRE, POST, COMB, T, K, sx_t, sfn_m, rms_eps, hc_eps, iters,
                            HC: tl.constexpr, BK: tl.constexpr):
    j = tl.arange(0, HC)
    jk = tl.arange(0, HC * HC)
    s_pre = tl.load(SCALE)
    s_post = tl.load(SCALE + 1)
    s_comb = tl.load(SCALE + 2)
    b_pre = tl.load(BASE + j)
    b_post = tl.load(BASE + HC + j)
    b_comb = tl.reshape(tl.load(BASE + 2 * HC + jk), (HC, HC))
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        a_pre = tl.full([HC], 0.0, tl.float32)
        a_post = tl.full([HC], 0.0, tl.float32)
        a_comb = tl.full([HC * HC], 0.0, tl.float32)
        sq = tl.full([BK], 0.0, tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            kmask = offs_k < K
            v = tl.load(X + t * sx_t + offs_k, mask=kmask, other=0.0).to(tl.float32)
            sq += v * v
            f = tl.load(FN + j[:, None] * sfn_m + offs_k[None, :], mask=kmask[None, :], other=0.0)
            a_pre += tl.sum(f * v[None, :], 1)
            f = tl.load(FN + (HC + j[:, None]) * sfn_m + offs_k[None, :], mask=kmask[None, :], other=0.0)
            a_post += tl.sum(f * v[None, :], 1)
            f = tl.load(FN + (2 * HC + jk[:, None]) * sfn_m + offs_k[None, :], mask=kmask[None, :], other=0.0)
            a_comb += tl.sum(f * v[None, :], 1)
        r = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + rms_eps)
        pre = 1.0 / (1.0 + tl.exp(-(a_pre * r * s_pre + b_pre))) + hc_eps
        post = 2.0 * 1.0 / (1.0 + tl.exp(-(a_post * r * s_post + b_post)))
        logits = tl.reshape(a_comb, (HC, HC)) * r * s_comb + b_comb     # row j = source, column k = destination
        e = tl.exp(logits - tl.max(logits, 1)[:, None])
        c = e / tl.sum(e, 1)[:, None] + hc_eps
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        for _it in range(1, iters):
            c = c / (tl.sum(c, 1)[:, None] + hc_eps)
            c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        tl.store(PRE + t * HC + j, pre)
        tl.store(POST + t * HC + j, post)
        tl.store(COMB + t * HC * HC + jk, tl.reshape(c, (HC * HC,)))


@triton.jit
def _hc_collapse_kernel(X, W, OUT, T, D, sx_t, sx_j, sw_t, so_t, HC: tl.constexpr, BD: tl.constexpr):
    n_db = (D + BD - 1) // BD
    for task in range(tl.program_id(0), T * n_db, tl.num_programs(0)):
        t = task // n_db
        offs_d = (task % n_db) * BD + tl.arange(0, BD)
        dmask = offs_d < D
        acc = tl.full([BD], 0.0, tl.float32)
        for j in tl.static_range(HC):
            w = tl.load(W + t * sw_t + j).to(tl.float32)
            acc += w * tl.load(X + t * sx_t + j * sx_j + offs_d, mask=dmask, other=0.0).to(tl.float32)
        tl.store(OUT + t * so_t + offs_d, acc.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
def _hc_expand_kernel(X, Y, POST, COMB, OUT, T, D, sx_t, sx_j, sy_t, so_t, so_k,
                      HC: tl.constexpr, BD: tl.constexpr):
    n_db = (D + BD - 1) // BD
    k = tl.arange(0, HC)
    for task in range(tl.program_id(0), T * n_db, tl.num_programs(0)):
        t = task // n_db
        offs_d = (task % n_db) * BD + tl.arange(0, BD)
        dmask = offs_d < D
        y = tl.load(Y + t * sy_t + offs_d, mask=dmask, other=0.0).to(tl.float32)
        post = tl.load(POST + t * HC + k).to(tl.float32)
        acc = post[:, None] * y[None, :]                                     # [HC (k), BD]
        mixed = tl.full([HC, BD], 0.0, tl.float32)
        for j in tl.static_range(HC):
            cj = tl.load(COMB + t * HC * HC + j * HC + k).to(tl.float32)     # comb[j, :]
            xj = tl.load(X + t * sx_t + j * sx_j + offs_d, mask=dmask, other=0.0).to(tl.float32)
            mixed += cj[:, None] * xj[None, :]
        out = mixed + acc
        tl.store(OUT + t * so_t + k[:, None] * so_k + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=dmask[None, :])


def _check(streams: torch.Tensor) -> None:
    h = streams.shape[1]
    if not is_pow2(h) or streams.stride(-1) != 1:
        raise NotImplementedError(f"hc_mult {h} must be a power of two, streams contiguous in D")


def hc_coefficients(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    rms_eps: float, hc_eps: float, sinkhorn_iters: int):
    """streams [T, h, D]; fn [(2+h)h, hD]; base [(2+h)h]; scale [3] -> pre [T, h], post [T, h], comb [T, h, h]."""
    _check(streams)
    t, h, d = streams.shape
    x = streams.reshape(t, h * d)
    fn = fn.float().contiguous()
    pre = torch.empty(t, h, dtype=torch.float32, device=streams.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, h, h, dtype=torch.float32, device=streams.device)
    _hc_coefficients_kernel[grid(t, vector=True)](
        x, fn, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, t, h * d,
        x.stride(0), fn.stride(0), float(rms_eps), float(hc_eps), int(sinkhorn_iters), HC=h, BK=BK)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """streams [T, h, D]; weights [T, h] -> [T, D] in streams.dtype."""
    _check(streams)
    t, h, d = streams.shape
    w = weights.contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    _hc_collapse_kernel[grid(t * triton.cdiv(d, BD), vector=True)](
        streams, w, out, t, d, streams.stride(0), streams.stride(1), w.stride(0), out.stride(0), HC=h, BD=BD)
    return out


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [T, h, D]; y [T, D]; post [T, h]; comb [T, h, h] -> [T, h, D] in streams.dtype."""
    _check(streams)
    t, h, d = streams.shape
    y = y.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    out = torch.empty(t, h, d, dtype=streams.dtype, device=streams.device)
    _hc_expand_kernel[grid(t * triton.cdiv(d, BD), vector=True)](
        streams, y, post, comb, out, t, d, streams.stride(0), streams.stride(1), y.stride(0),
        out.stride(0), out.stride(1), HC=h, BD=BD)
    return out
