"""Lightning-indexer scores I[t, i] = sum_h w[t, h] relu(q[t, h] . k[i]) (model-spec §3.5): one Triton kernel.

A task is one token x BN keys: the [H_I, d_I] query block times the [BN, d_I] key block on the cube
unit, then ReLU and the head-weighted sum on the vector unit, in fp32. Top-k selection stays with the
oracle (a stable sort: torch_npu's library sort on the NPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend.common import F32DOT, dot, grid, is_pow2, pow2

BN = 64


@triton.jit
def _indexer_kernel(Q, W, K, OUT, T, N, HI, sq_t, sq_h, sw_t, sk_t, sk_n, so_t,
                    HP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr):
    """K is [N, d] shared (sk_t = 0) or [T, N, d] per token."""
    n_nb = (N + BN - 1) // BN
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, D)
    hmask = offs_h < HI
    for task in range(tl.program_id(0), T * n_nb, tl.num_programs(0)):
        t = task // n_nb
        offs_n = (task % n_nb) * BN + tl.arange(0, BN)
        nmask = offs_n < N
        q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None], other=0.0)
        k = tl.load(K + t * sk_t + offs_n[:, None] * sk_n + offs_d[None, :], mask=nmask[:, None], other=0.0)
        w = tl.load(W + t * sw_t + offs_h, mask=hmask, other=0.0).to(tl.float32)
        s = tl.maximum(dot(q, tl.trans(k), F32), 0.0)
        tl.store(OUT + t * so_t + offs_n, tl.sum(s * w[:, None], 0), mask=nmask)


def _launch(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, sk_t: int) -> torch.Tensor:
    t, hi, d = q.shape
    if not is_pow2(d) or d < 16 or q.stride(-1) != 1 or keys.stride(-1) != 1 or keys.dtype != q.dtype:
        raise NotImplementedError(f"index head dim {d} must be a power of two >= 16, rows contiguous, one dtype")
    n = keys.shape[-2]
    out = torch.empty(t, n, dtype=torch.float32, device=q.device)
    w = weights.contiguous()
    _indexer_kernel[grid(t * triton.cdiv(n, BN))](
        q, w, keys, out, t, n, hi, q.stride(0), q.stride(1), w.stride(0), sk_t, keys.stride(-2), out.stride(0),
        HP=max(16, pow2(hi)), D=d, BN=BN, F32=F32DOT)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, H_I, d_I]; weights [T, H_I]; keys [N, d_I] -> [T, N] fp32."""
    return _launch(q, weights, keys, 0)


def indexer_scores_gathered(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, H_I, d_I]; weights [T, H_I]; keys [T, N, d_I] (each token's own) -> [T, N] fp32."""
    return _launch(q, weights, keys, keys.stride(0))
