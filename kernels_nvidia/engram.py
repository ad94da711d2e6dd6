"""The gated injection of an Engram layer's value into the residual streams, as one Triton kernel.

`engram_inject(streams, keys, value, q_weight, k_weight, eps, mute)`: per token t and stream j

    xn = rms_norm(streams[t, j]), kn = rms_norm(keys[t, j])           (each rounded to the streams' dtype)
    dot = sum_d xn * kn * (q_weight[j] * k_weight[j]) / sqrt(D)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), 0 where mute[t]
    out[t, j] = streams[t, j] + gate * value[t]                          (fp32 math, streams' dtype)

The oracle runs about twenty kernels over [T, h, D] fp32 copies (two norms, casts, three products, a sum,
the gate, the residual add and the cast back); here each (token, stream) is one program that reads its rows in
fixed chunks of D three times (norms, dot, output) and writes once. Each token is computed in a fixed
order, independent of the batch (batch-invariant). streams, keys: [T, h, D]; value: [T, D];
q_weight, k_weight: [h, D]; mute: [T] bool (V4.1 image tokens) or None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # columns per pass step: a fixed tile (the reduction order never depends on T)


@triton.jit
def _engram_inject_kernel(X, K, V, QW, KW, M, Y, D, sx_t, sx_h, sk_t, sk_h, sv_t, sy_t, sy_h, eps, sqrt_d,
                          HAS_MUTE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row, k_row, y_row = X + t * sx_t + h * sx_h, K + t * sk_t + h * sk_h, Y + t * sy_t + h * sy_h
    sx = tl.zeros([BLOCK], tl.float32)
    sk = tl.zeros([BLOCK], tl.float32)
    for d0 in range(0, D, BLOCK):
        m = d0 + offs < D
        x = tl.load(x_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
        k = tl.load(k_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
        sx += x * x
        sk += k * k
    rx = tl.rsqrt(tl.sum(sx, 0) / D + eps)
    rk = tl.rsqrt(tl.sum(sk, 0) / D + eps)
    acc = tl.zeros([BLOCK], tl.float32)
    for d0 in range(0, D, BLOCK):
        m = d0 + offs < D
        x = tl.load(x_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
        k = tl.load(k_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(QW + h * D + d0 + offs, mask=m, other=0.0).to(tl.float32) \
            * tl.load(KW + h * D + d0 + offs, mask=m, other=0.0).to(tl.float32)
        xn = (x * rx).to(Y.dtype.element_ty).to(tl.float32)
        kn = (k * rk).to(Y.dtype.element_ty).to(tl.float32)
        acc += xn * kn * w
    dot = tl.sum(acc, 0) / sqrt_d
    mag = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    s = tl.where(dot > 0, mag, tl.where(dot < 0, -mag, 0.0))
    gate = 1.0 / (1.0 + tl.exp(-s))
    if HAS_MUTE:
        gate = tl.where(tl.load(M + t) != 0, 0.0, gate)
    for d0 in range(0, D, BLOCK):
        m = d0 + offs < D
        x = tl.load(x_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
        v = tl.load(V + t * sv_t + d0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + d0 + offs, (x + gate * v).to(Y.dtype.element_ty), mask=m)


def engram_inject(streams: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float, mute: torch.Tensor | None = None) -> torch.Tensor:
    """streams, keys: [T, h, D]; value: [T, D]; q_weight, k_weight: [h, D]; mute: [T] bool or None -> [T, h, D]."""
    t, h, d = streams.shape
    if streams.stride(-1) != 1 or keys.stride(-1) != 1 or value.stride(-1) != 1:
        raise NotImplementedError("engram_inject: rows must be contiguous in their last dim")
    out = torch.empty((t, h, d), dtype=streams.dtype, device=streams.device)
    if t:
        block = min(CHUNK, triton.next_power_of_2(d))
        _engram_inject_kernel[(t, h)](
            streams, keys, value, q_weight.contiguous(), k_weight.contiguous(),
            streams if mute is None else mute.contiguous().view(torch.uint8), out, d,
            streams.stride(0), streams.stride(1), keys.stride(0), keys.stride(1), value.stride(0),
            out.stride(0), out.stride(1), float(eps), float(d ** 0.5),
            HAS_MUTE=mute is not None, BLOCK=block, num_warps=4)
    return out
