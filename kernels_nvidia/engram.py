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

`engram_hash(history, valid, token_map, multipliers, primes, offsets, pad_id, image)`: the table rows of each
token's n-grams (the oracle's ~30 small int64 kernels a layer: casts, masks, a cumprod, gathers, k products and
XORs, (k-1) modulos and a cat) in one launch, BN tokens a program, int64 arithmetic wrapping as torch's; the
modulo is taken with Python's sign (torch.remainder), so the rows are bitwise the oracle's.

`fp8_rows(weight, scale, rows)`: the looked-up rows of a row-FP8 table decoded in one pass (E4M3 code times the
E8M0 scale of its 32-value group, both exact in fp32: bitwise the oracle), instead of two gathers, a cast and a
scale multiply over [N, d] fp32 (at 4096 prefill tokens 98,304 rows of 256 a layer).
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


@triton.jit
def _engram_hash_kernel(HIST, VALID, TMAP, MULT, PRIMES, OFFS, OUT, N, V, s_h, s_v, pad, lo, hi,
                        K: tl.constexpr, NH: tl.constexpr, HP: tl.constexpr, IMAGE: tl.constexpr,
                        BN: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    heads = tl.arange(0, HP)
    hmask = heads < NH
    alive = rmask
    rolling = tl.zeros([BN], tl.int64)
    for s in tl.static_range(K):               # shift s back from the token: history column K - 1 - s
        tok = tl.load(HIST + rows64 * s_h + (K - 1 - s), mask=rmask, other=0).to(tl.int64)
        ok = tl.load(VALID + rows64 * s_v + (K - 1 - s), mask=rmask, other=0) != 0
        if IMAGE:
            ok = ok & ((tok < lo) | (tok >= hi))
        alive = alive & ok
        cid = tl.load(TMAP + tl.minimum(tl.maximum(tok, 0), V - 1), mask=rmask, other=0)
        rolling = rolling ^ (tl.where(alive, cid, pad) * tl.load(MULT + s))
        if s > 0:
            p = tl.load(PRIMES + (s - 1) * NH + heads, mask=hmask, other=1)
            r = rolling[:, None] % p[None, :]
            r = tl.where(r < 0, r + p[None, :], r)     # Python's modulo: the divisor's sign
            r = r + tl.load(OFFS + (s - 1) * NH + heads, mask=hmask, other=0)[None, :]
            tl.store(OUT + rows64[:, None] * ((K - 1) * NH) + (s - 1) * NH + heads[None, :], r,
                     mask=rmask[:, None] & hmask[None, :])


def engram_hash(history: torch.Tensor, valid: torch.Tensor, token_map: torch.Tensor, multipliers: torch.Tensor,
                primes: torch.Tensor, offsets: torch.Tensor, pad_id: int,
                image: tuple[int, int] | None = None) -> torch.Tensor:
    """history, valid: [N, k]; token_map: [V] int64; multipliers: [k]; primes, offsets: [(k-1) * H] int64;
    image: (lo, hi) or None -> rows [N, (k-1) * H] int64 (the oracle's)."""
    n, k = history.shape
    if k < 2 or primes.shape[0] % (k - 1) or token_map.dtype != torch.int64 or multipliers.dtype != torch.int64:
        raise NotImplementedError("engram_hash: int64 maps and multipliers, k >= 2, (k - 1) * H primes")
    h = primes.shape[0] // (k - 1)
    out = torch.empty(n, (k - 1) * h, dtype=torch.int64, device=history.device)
    if n:
        history = history if history.stride(-1) == 1 else history.contiguous()
        valid = (valid if valid.stride(-1) == 1 else valid.contiguous()).view(torch.uint8)
        lo, hi = image if image is not None else (0, 0)
        bn = 64
        _engram_hash_kernel[(triton.cdiv(n, bn),)](
            history, valid, token_map, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out, n,
            token_map.numel(), history.stride(0), valid.stride(0), int(pad_id), int(lo), int(hi), K=k, NH=h,
            HP=triton.next_power_of_2(h), IMAGE=image is not None, BN=bn, num_warps=2)
    return out


@triton.jit
def _fp8_rows_kernel(W, S, ROWS, OUT, N, sw, ss, D: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                     GATHER: tl.constexpr):
    i = tl.program_id(0) * BN + tl.arange(0, BN)
    imask = i < N
    r = tl.load(ROWS + i, mask=imask, other=0).to(tl.int64) if GATHER else i.to(tl.int64)
    offs = tl.arange(0, D)
    m = imask[:, None]
    w = tl.load(W + r[:, None] * sw + offs[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True)
    b = tl.load(S + r[:, None] * ss + offs[None, :] // G, mask=m, other=127).to(tl.int32)
    scale = tl.where(b == 0, 2.0 ** -127, (b << 23).to(tl.float32, bitcast=True))   # E8M0: 2 ** (b - 127)
    tl.store(OUT + i[:, None].to(tl.int64) * D + offs[None, :], w.to(tl.float32) * scale, mask=m)


def fp8_rows(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """weight: [R, d] E4M3 (or its bytes); scale: [R, d / 32] E8M0 (or bytes); rows: [N] or None -> [N, d] fp32."""
    d = weight.shape[-1]
    if weight.dim() != 2 or scale.dim() != 2 or d & (d - 1) or scale.shape != (weight.shape[0], d // 32) \
            or weight.element_size() != 1 or scale.element_size() != 1 or weight.stride(-1) != 1 \
            or scale.stride(-1) != 1:
        raise NotImplementedError("fp8_rows: [R, d] codes with d a power of two, [R, d / 32] scales, unit stride")
    n = weight.shape[0] if rows is None else rows.numel()
    out = torch.empty(n, d, dtype=torch.float32, device=weight.device)
    if n:
        bn = max(1, 4096 // d)
        w8, s8 = weight.view(torch.uint8), scale.view(torch.uint8)
        _fp8_rows_kernel[(triton.cdiv(n, bn),)](w8, s8, w8 if rows is None else rows.reshape(-1).contiguous(), out,
                                                n, w8.stride(0), s8.stride(0), D=d, G=32, BN=bn,
                                                GATHER=rows is not None, num_warps=4)
    return out
