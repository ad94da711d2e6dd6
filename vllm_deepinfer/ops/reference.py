"""Torch reference implementation of every op of the model (model-spec §3).

This backend runs on any device, is the CPU path, and is the oracle the kernel packages are tested
against. Shapes use T = tokens, H = heads, h = residual streams, D = hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32; returns x.dtype. x: [..., n]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- mHC
def hc_coefficients(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    rms_eps: float, hc_eps: float, sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients of one sublayer (model-spec §3.2).

    streams: [T, h, D]; fn: [(2+h)h, hD]; base: [(2+h)h]; scale: [3].
    Returns pre [T, h], post [T, h] and the doubly-stochastic combination comb [T, h, h]
    (row j = source stream, column k = destination stream).
    """
    t, h, _ = streams.shape
    v = streams.reshape(t, -1).float()
    mu = (v @ fn.float().t()) * torch.rsqrt(v.square().mean(-1, keepdim=True) + rms_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mu[:, :h] * scale[0] + base[:h]) + hc_eps
    post = 2.0 * torch.sigmoid(mu[:, h:2 * h] * scale[1] + base[h:2 * h])
    logits = (mu[:, 2 * h:] * scale[2] + base[2 * h:]).view(t, h, h)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """u = sum_j w_j X_j with fp32 accumulation. streams: [T, h, D]; weights: [T, h] -> [T, D]."""
    return torch.einsum("thd,th->td", streams.float(), weights.float()).to(streams.dtype)


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * y + sum_j comb[j, k] X_j. streams: [T, h, D]; y: [T, D] -> [T, h, D]."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), streams.float())
    return (mixed + post.float().unsqueeze(-1) * y.float().unsqueeze(1)).to(streams.dtype)


def hc_head_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    rms_eps: float, hc_eps: float) -> torch.Tensor:
    """V4 final collapse weights: sigmoid(mu * scale + base) + eps. streams: [T, h, D] -> [T, h]."""
    t = streams.shape[0]
    v = streams.reshape(t, -1).float()
    mu = (v @ fn.float().t()) * torch.rsqrt(v.square().mean(-1, keepdim=True) + rms_eps)
    return torch.sigmoid(mu * scale.float()[0] + base.float()) + hc_eps


# ----------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin for positions [N] and per-pair frequencies [r/2] -> ([N, r/2], [N, r/2])."""
    angles = positions.double().unsqueeze(-1) * inv_freq.double()
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last 2*cos.shape[-1] dims of x.

    x: [N, ..., n]; cos/sin: [N, r/2] broadcast over the middle dims. Returns x.dtype.
    """
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    rot = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    a, b = rot[..., 0], rot[..., 1]
    out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)


# ----------------------------------------------------------------------------- attention
def sparse_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of queries over a shared key set with a per-query mask and a learned sink.

    q: [T, H, d]; keys: [N, d] (K = V, one latent head); allowed: [T, N] bool; sink: [H].
    The sink is a virtual key with logit sink_h and value 0 (model-spec §3.4). Returns [T, H, d].
    """
    scores = torch.einsum("thd,nd->thn", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    sink_col = sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thn,nd->thd", probs, keys.float()).to(q.dtype)


def grouped_output(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped low-rank output projection. o: [T, H, d]; wo_a: [G*R, H*d/G]; wo_b: [D, G*R] -> [T, D]."""
    t = o.shape[0]
    og = o.reshape(t, groups, -1)
    z = torch.einsum("tgk,grk->tgr", og, wo_a.view(groups, -1, og.shape[-1]))
    return z.reshape(t, -1) @ wo_b.t()


# ----------------------------------------------------------------------------- compressor
def softmax_pool(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-dimension softmax pooling over slots. values/logits: [G, S, c] fp32 -> [G, c]."""
    return (torch.softmax(logits, dim=1) * values).sum(dim=1)


# ----------------------------------------------------------------------------- indexer
def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores I[t, i] = sum_h w[t, h] * relu(q[t, h] . k[i]).

    q: [T, H_I, d_I]; weights: [T, H_I]; keys: [N, d_I] -> [T, N] fp32.
    """
    dots = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu_()
    return torch.einsum("thn,th->tn", dots, weights.float())


def topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest finite scores per row, -1 where fewer exist. scores: [T, N] -> [T, k].

    -inf marks an invalid entry; +inf (a forced entry) is kept. Ties resolve to the lower index
    (stable sort), so the selection is deterministic.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    n = min(k, scores.shape[-1])
    idx, val = order.indices[:, :n], order.values[:, :n]
    idx = torch.where(val > float("-inf"), idx, torch.full_like(idx, -1))
    if n < k:
        idx = F.pad(idx, (0, k - n), value=-1)
    return idx


# ----------------------------------------------------------------------------- MoE
def sqrtsoftplus_route(logits: torch.Tensor, bias: torch.Tensor | None, topk: int, scale: float,
                       forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of model-spec §3.8. logits: [T, E] fp32; bias: [E] or [T, E]; forced: [T, K] (hash layers).

    Returns (expert ids [T, K] int64, weights [T, K] fp32): selection on score + bias, weights are the
    unbiased scores renormalised to sum to `scale`.
    """
    scores = torch.sqrt(F.softplus(logits.float()))
    if forced is not None:
        ids = forced.long()
    else:
        ids = torch.topk(scores + bias.float(), topk, dim=-1, sorted=True).indices
    picked = scores.gather(-1, ids)
    return ids, scale * picked / (picked.sum(-1, keepdim=True) + 1e-20)


def swiglu_clamped(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   limit: float) -> torch.Tensor:
    """Clamped SwiGLU expert: (silu(min(x w1, l)) * clamp(x w3, -l, l)) w2. x: [T, D] -> [T, D]."""
    a = (x @ w1.t()).float().clamp(max=limit)
    b = (x @ w3.t()).float().clamp(-limit, limit)
    return (F.silu(a) * b).to(x.dtype) @ w2.t()


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Sum of weighted routed experts. x: [T, D]; ids/weights: [T, K]; w13: [E, 2I, D]; w2: [E, D, I]."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        y = swiglu_clamped(x[tok], w13[e, :inter], w13[e, inter:], w2[e], limit)
        out.index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(-1))
    return out.to(x.dtype)


def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Gather form of `sparse_attention`: each query attends to its own rows kv[idx[t, j]].

    q: [T, H, d]; kv: [R, d] (K = V); idx: [T, K] distinct row ids, -1 = none; sink: [H] -> [T, H, d].
    Computed here as masked attention over all R rows (the same sum; shared keys keep it one GEMM
    on CPU); device kernels gather the K rows instead.
    """
    allowed = torch.zeros(idx.shape[0], kv.shape[0] + 1, dtype=torch.bool, device=idx.device)
    allowed.scatter_(1, torch.where(idx >= 0, idx, kv.shape[0]).long(), True)
    return sparse_attention(q, kv, allowed[:, :-1], sink, scale)
