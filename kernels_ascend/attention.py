"""Sparse attention with a learned sink over one latent (K = V), model-spec §3.4: one Triton kernel, three forms.

* `sparse_attention(q, keys, allowed, sink, scale)`: shared keys [N, d] with a per-query mask [T, N];
* `sparse_attention_indexed(q, kv, idx, sink, scale)`: each query's rows kv[idx[t, j]] (idx [T, K] int32,
  -1 = none): the window rows and the indexer's top-k compressed rows of a token in one list;
* `sparse_attention_gathered(q, keys, valid, sink, scale)`: each query's own gathered keys [T, K, d].

A task is one token x BH heads; it walks the keys in fixed BN blocks, in order, from the block of its first
valid key to that of its last, with an online softmax that starts from the sink (logit sink_h, value 0), so a
query that sees nothing returns 0 and no state is ever -inf. Keys that are masked out are never read (rows of
`gathered` may hold NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend.common import F32DOT, dot, grid, is_pow2

BH, BN = 16, 32  # q tile 16 x d, key tile 32 x d: 2 x 32 KiB of bf16 at d = 512, fp32 accumulator 32 KiB


@triton.jit
def _sparse_attn_kernel(Q, KEYS, SEL, SINK, O, T, H, N, scale,
                        sq_t, sq_h, sk_t, sk_n, ss_t, so_t, so_h,
                        INDEXED: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                        F32: tl.constexpr):
    """INDEXED: SEL = row ids [T, N] (-1 none) into KEYS [R, d]; else SEL = mask [T, N] over KEYS
    [(T,) N, d] (sk_t = 0: keys shared by all queries)."""
    n_hb = (H + BH - 1) // BH
    offs_d = tl.arange(0, D)
    for task in range(tl.program_id(0), T * n_hb, tl.num_programs(0)):
        t = task // n_hb
        offs_h = (task % n_hb) * BH + tl.arange(0, BH)
        hmask = offs_h < H
        q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None], other=0.0)
        m_i = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
        l_i = tl.full([BH], 1.0, tl.float32)
        acc = tl.full([BH, D], 0.0, tl.float32)
        # only the key blocks from the first to the last valid one: a block with no valid key leaves
        # (m, l, acc) exactly as they were, so skipping it changes no bit
        lo = N
        hi = 0
        for n0 in range(0, N, BN):
            offs_n = n0 + tl.arange(0, BN)
            inb = offs_n < N
            if INDEXED:
                valid = tl.load(SEL + t * ss_t + offs_n, mask=inb, other=-1) >= 0
            else:
                valid = tl.load(SEL + t * ss_t + offs_n, mask=inb, other=0) != 0
            lo = tl.minimum(lo, tl.min(tl.where(valid, offs_n, N), 0))
            hi = tl.maximum(hi, tl.max(tl.where(valid, offs_n + 1, 0), 0))
        for n0 in range(lo // BN * BN, hi, BN):
            offs_n = n0 + tl.arange(0, BN)
            inb = offs_n < N
            if INDEXED:
                idx = tl.load(SEL + t * ss_t + offs_n, mask=inb, other=-1)
                valid = idx >= 0
                rows = tl.where(valid, idx, 0).to(tl.int64)
                kp = KEYS + rows[:, None] * sk_n + offs_d[None, :]
            else:
                valid = tl.load(SEL + t * ss_t + offs_n, mask=inb, other=0) != 0
                kp = KEYS + t * sk_t + offs_n[:, None] * sk_n + offs_d[None, :]
            k = tl.load(kp, mask=valid[:, None], other=0.0)
            s = dot(q, tl.trans(k), F32) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + dot(p.to(k.dtype), k, F32)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(O + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=hmask[:, None])


def _launch(q, keys, sel, sink, scale, indexed: bool, sk_t: int) -> torch.Tensor:
    t, h, d = q.shape
    if not is_pow2(d) or d < 16 or q.stride(-1) != 1 or keys.stride(-1) != 1:
        raise NotImplementedError(f"head dim {d} must be a power of two >= 16, rows contiguous")
    if keys.dtype != q.dtype:
        raise NotImplementedError(f"keys {keys.dtype} != queries {q.dtype}")
    sel = sel.contiguous()
    if sel.dtype == torch.bool:
        sel = sel.view(torch.uint8)
    out = torch.empty_like(q)
    n = sel.shape[1]
    _sparse_attn_kernel[grid(t * triton.cdiv(h, BH))](
        q, keys, sel, sink.float().contiguous(), out, t, h, n, float(scale),
        q.stride(0), q.stride(1), sk_t, keys.stride(-2), sel.stride(0), out.stride(0), out.stride(1),
        INDEXED=indexed, D=d, BH=BH, BN=BN, F32=F32DOT)
    return out


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, d]; keys [N, d]; allowed [T, N] bool; sink [H] -> [T, H, d]."""
    return _launch(q, keys, allowed, sink, scale, indexed=False, sk_t=0)


def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """q [T, H, d]; kv [R, d]; idx [T, K] row ids (-1 = none); sink [H] -> [T, H, d]."""
    return _launch(q, kv, idx.to(torch.int32), sink, scale, indexed=True, sk_t=0)


def sparse_attention_gathered(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q [T, H, d]; keys [T, K, d]; valid [T, K] bool; sink [H] -> [T, H, d]."""
    return _launch(q, keys, valid, sink, scale, indexed=False, sk_t=keys.stride(0))
