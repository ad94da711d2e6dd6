"""Torch reference implementation of every op of the model (model-spec §3).

This backend runs on any device, is the CPU path, and is the oracle the kernel packages are tested
against. Shapes use T = tokens, H = heads, h = residual streams, D = hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm_deepinfer.checkpoint.formats import dequant_fp8_block, dequant_fp8_rows, dequant_mxfp4, e8m0_decode
from vllm_deepinfer.ops import quant

# Batch-invariant mode (`DEEPINFER_BATCH_INVARIANT`): set by `vllm_deepinfer.ops.configure_invariant`.
BATCH_INVARIANT = False
INVARIANT_ROWS = 16  # row tile of `matmul_invariant`
VECTOR_STEP = 64  # elements per iteration of torch's CPU vectorized loop, at most (2 x 32 16-bit lanes of AVX-512)


def elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise transcendental fn (sigmoid, silu, rsqrt, softplus), any shape.

    Batch-invariant mode on CPU: torch's vectorized loop and its scalar tail loop round these
    functions differently, and which elements fall in the tail (the last numel % (2 x vector width)
    of each thread's chunk: 16 floats on AVX2, 32 on AVX-512, 64 for 16-bit types there) depends on
    the batch. The input is flattened and zero-padded to a multiple of VECTOR_STEP elements per
    possible thread chunk, so every element takes the vectorized loop.
    """
    if not BATCH_INVARIANT or x.device.type != "cpu":
        return fn(x)
    n = x.numel()
    pad = -n % (VECTOR_STEP * math.lcm(*range(1, torch.get_num_threads() + 1)))
    return fn(F.pad(x.reshape(-1), (0, pad)))[:n].view(x.shape)


# ----------------------------------------------------------------------------- GEMM
def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T. x: [M, K]; w: [N, K] -> [M, N]; `matmul_invariant` in batch-invariant mode."""
    return matmul_invariant(x, w) if BATCH_INVARIANT else x @ w.t()


def matmul_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T where row i depends only on x[i] and W, bitwise, whatever M. x: [M, K]; w: [N, K] -> [M, N].

    Torch GEMMs round by M (CPU: MKL/oneDNN pick other kernels for M = 1 and small M; CUDA: cuBLAS
    picks tiles and split-K by M). CPU: rows padded to tiles of INVARIANT_ROWS, one [16, K] x [K, N]
    GEMM per tile, every call the same shape (a row's result does not depend on its slot in the tile,
    checked in tests/test_batch_invariance.py). One bmm over all tiles is not invariant: MKL threads a
    batch of one GEMM differently from a batch of several (on AMX hosts rows then differ in the last
    bits between a 1-tile and a 2-tile call). CUDA: vLLM's batch-invariant persistent Triton GEMM (fixed
    tiles, no split-K).
    """
    if x.is_cuda:
        from vllm.model_executor.determinism.batch_invariant import matmul_batch_invariant

        return matmul_batch_invariant(x, w.t())
    m, r = x.shape[0], INVARIANT_ROWS
    wt = w.t()
    tiles = F.pad(x, (0, 0, 0, -m % r)).split(r)
    return torch.cat([tile @ wt for tile in tiles])[:m]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32; returns x.dtype. x: [..., n]."""
    xf = x.float()
    y = xf * elementwise(torch.rsqrt, xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def fp8_rows(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of a row-FP8 table (E4M3 codes, one E8M0 scale per 32 values; Engram tables), decoded.
    weight: [R, d]; scale: [R, d / 32]; rows: [N] int or None (all R, in order) -> [N, d] fp32. Codes and scales
    are not checked for NaN (tables are validated at load)."""
    if rows is not None:
        weight, scale = weight[rows], scale[rows]
    return dequant_fp8_rows(weight, scale, checked=False)


def engram_hash(history: torch.Tensor, valid: torch.Tensor, token_map: torch.Tensor, multipliers: torch.Tensor,
                primes: torch.Tensor, offsets: torch.Tensor, pad_id: int,
                image: tuple[int, int] | None = None) -> torch.Tensor:
    """Engram table rows of each token's n-grams (model-spec §3.9). history, valid: [N, k] raw token ids at
    positions pos-(k-1) .. pos and whether each exists; token_map: [V] compressed ids; multipliers: [k];
    primes, offsets: [(k-1) * H] (n-gram order 2 first, H hash heads each); image: (lo, hi) or None, ids in
    [lo, hi) end an n-gram like a missing token -> [N, (k-1) * H] int64.

    Shift s (0 = the token itself) contributes map(id) while every shift up to s is a live token, else
    pad_id; the rolling hash XORs value * multipliers[s] (int64, wrapping); order s + 1's head h row is
    rolling mod primes + offsets (Python modulo)."""
    k = history.shape[-1]
    ids = token_map[history.long().clamp(0, token_map.numel() - 1)]          # padding rows may hold anything
    dead = ~valid
    if image is not None:
        dead = dead | ((history >= image[0]) & (history < image[1]))
    alive = torch.cumprod((~dead).flip(-1).long(), dim=-1).bool()            # [N, k], shift s = column k-1-s
    vals = torch.where(alive, ids.flip(-1), pad_id)
    rolling = torch.zeros(history.shape[:-1], dtype=torch.long, device=history.device)
    cols = []
    h = primes.shape[0] // (k - 1)
    for s in range(k):
        rolling = rolling ^ (vals[..., s] * multipliers[s])
        if s > 0:
            c = slice((s - 1) * h, s * h)
            cols.append(rolling.unsqueeze(-1) % primes[c] + offsets[c])
    return torch.cat(cols, dim=-1)


def engram_inject(streams: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float, mute: torch.Tensor | None = None) -> torch.Tensor:
    """Gated Engram value added to the streams (model-spec §3.9). streams, keys: [T, h, D]; value: [T, D];
    q_weight, k_weight: [h, D]; mute: [T] bool (tokens whose gate is 0: V4.1 image tokens) -> [T, h, D]:
    streams + sigmoid(sign(dot) sqrt(|dot|)) value, dot = <rms_norm(x), rms_norm(k)>_(q_weight k_weight) / sqrt(D)."""
    xn = rms_norm(streams, None, eps).float()
    kn = rms_norm(keys, None, eps).float()
    dot = (xn * kn * (q_weight.float() * k_weight.float())).sum(-1) / streams.shape[-1] ** 0.5
    gate = elementwise(torch.sigmoid, dot.sign() * dot.abs().clamp(min=1e-6).sqrt())   # [T, h]
    if mute is not None:
        gate = gate.masked_fill(mute.unsqueeze(1), 0.0)
    return (streams.float() + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(streams.dtype)


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
    mu = matmul(v, fn.float()) * elementwise(torch.rsqrt, v.square().mean(-1, keepdim=True) + rms_eps)
    base, scale = base.float(), scale.float()
    pre = elementwise(torch.sigmoid, mu[:, :h] * scale[0] + base[:h]) + hc_eps
    post = 2.0 * elementwise(torch.sigmoid, mu[:, h:2 * h] * scale[1] + base[h:2 * h])
    logits = (mu[:, 2 * h:] * scale[2] + base[2 * h:]).view(t, h, h)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """u = sum_j w_j X_j with fp32 accumulation. streams: [T, h, D]; weights: [T, h] -> [T, D]."""
    if BATCH_INVARIANT:  # the einsum's bmm rounds by T: a fixed-order sum over the h streams instead
        x, w = streams.float(), weights.float()
        out = x[:, 0] * w[:, :1]
        for j in range(1, x.shape[1]):
            out = out + x[:, j] * w[:, j:j + 1]
        return out.to(streams.dtype)
    return torch.einsum("thd,th->td", streams.float(), weights.float()).to(streams.dtype)


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * y + sum_j comb[j, k] X_j. streams: [T, h, D]; y: [T, D] -> [T, h, D]."""
    if BATCH_INVARIANT:  # fixed-order sum over the source streams j (the einsum's bmm rounds by T)
        x, c = streams.float(), comb.float()
        mixed = c[:, 0].unsqueeze(-1) * x[:, :1]
        for j in range(1, x.shape[1]):
            mixed = mixed + c[:, j].unsqueeze(-1) * x[:, j:j + 1]
    else:
        mixed = torch.einsum("tjk,tjd->tkd", comb.float(), streams.float())
    return (mixed + post.float().unsqueeze(-1) * y.float().unsqueeze(1)).to(streams.dtype)


def hc_head_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    rms_eps: float, hc_eps: float) -> torch.Tensor:
    """V4 final collapse weights: sigmoid(mu * scale + base) + eps. streams: [T, h, D] -> [T, h]."""
    t = streams.shape[0]
    v = streams.reshape(t, -1).float()
    mu = matmul(v, fn.float()) * elementwise(torch.rsqrt, v.square().mean(-1, keepdim=True) + rms_eps)
    return elementwise(torch.sigmoid, mu * scale.float()[0] + base.float()) + hc_eps


# ----------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin for positions [N] (times `scale`) and per-pair frequencies [r/2] -> ([N, r/2], [N, r/2])."""
    angles = (positions * scale).double().unsqueeze(-1) * inv_freq.double()
    return angles.cos().float(), angles.sin().float()


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The last 2*cos.shape[-1] dims of x rotated (GPT-J pairs), fp32: [N, ..., r]."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    rot = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    a, b = rot[..., 0], rot[..., 1]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last 2*cos.shape[-1] dims of x.

    x: [N, ..., n]; cos/sin: [N, r/2] broadcast over the middle dims. Returns x.dtype.
    """
    r = 2 * cos.shape[-1]
    return torch.cat((x[..., :-r], _rotated(x, cos, sin, inverse).to(x.dtype)), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` in place: only the last 2*cos.shape[-1] dims of x are rewritten. Returns x."""
    x[..., -2 * cos.shape[-1]:] = _rotated(x, cos, sin, inverse).to(x.dtype)
    return x


# ----------------------------------------------------------------------------- attention
def sparse_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of queries over a shared key set with a per-query mask and a learned sink.

    q: [T, H, d]; keys: [N, d] (K = V, one latent head); allowed: [T, N] bool; sink: [H].
    The sink is a virtual key with logit sink_h and value 0 (model-spec §3.4). Returns [T, H, d].
    """
    scores = torch.einsum("thd,nd->thn", q.float(), keys.float()) * scale
    probs = _sink_softmax(scores.masked_fill(~allowed.unsqueeze(1), float("-inf")), sink)
    return torch.einsum("thn,nd->thd", probs, keys.float()).to(q.dtype)


def _sink_softmax(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys plus one virtual sink key of logit sink_h (value 0). scores: [T, H, N] fp32."""
    sink_col = sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    return torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]


def grouped_low_rank(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped (block-diagonal) low-rank projection. o: [T, H, d] or [T, H*d]; wo_a: [G*R, H*d/G] -> z [T, G*R]."""
    t = o.shape[0]
    og = o.reshape(t, groups, -1)
    if BATCH_INVARIANT:  # the einsum is a bmm over groups with M = T
        return torch.cat([matmul_invariant(og[:, g], w) for g, w in enumerate(wo_a.view(groups, -1, og.shape[-1]))],
                         dim=1)
    return torch.einsum("tgk,grk->tgr", og, wo_a.view(groups, -1, og.shape[-1])).reshape(t, -1)


def linear(x: torch.Tensor, w: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """y = x W^T. x: [T, G*K]; w: [N, K] -> [T, N]; groups = G > 1: block-diagonal product
    (`grouped_low_rank`, the grouped `wo_a`)."""
    if groups == 1:
        return matmul(x, w)
    return grouped_low_rank(x.view(x.shape[0], groups, -1), w, groups)


def linear_fp32_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T in fp32 from operands held in the model dtype (router logits, compressor projections).
    x: [T, K]; w: [N, K] -> fp32 [T, N]. Products of bf16 values are exact in fp32, so this is the fp32
    product of the stored values whatever their dtype."""
    return matmul(x.float(), w.float())


def linear_fp8_block(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     groups: int = 1) -> torch.Tensor:
    """`linear` with W = dequant_fp8_block(w, scale, block) in x.dtype (model-spec §4.2).

    x: [T, G*K]; w: E4M3 [N, K]; scale: E8M0 bytes (uint8) [ceil(N/BN), ceil(K/BK)] -> [T, N]."""
    return linear(x, dequant_fp8_block(w, e8m0_decode(scale), block).to(x.dtype), groups)


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


def indexer_scores_gathered(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`indexer_scores` with each token's own keys. q: [T, H_I, d_I]; weights: [T, H_I];
    keys: [T, N, d_I] -> [T, N] fp32."""
    dots = torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu_()
    return torch.einsum("thn,th->tn", dots, weights.float())


def topk_rows(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k largest finite scores per row, -1 where fewer exist. scores: [T, N] -> [T, k].

    -inf marks an invalid entry; +inf (a forced entry) is kept. Ties resolve to the lower index
    (stable sort), so the selection is deterministic. n_valid: optional [T] valid length per row; the
    caller promises scores[t, n_valid[t]:] == -inf, so it changes nothing here (kernels read only the
    valid prefix).
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
                       forced: torch.Tensor | None = None, vl: tuple | None = None,
                       ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of model-spec §3.8. logits: [T, E] fp32; bias: [E] or [T, E]; forced: [T, K] (hash layers);
    vl: None or (bias_vl [E], token_ids [T], lo, hi): tokens with lo <= id < hi (V4.1 image tokens) are
    biased by bias_vl instead of bias.

    Returns (expert ids [T, K] `ids_dtype`, weights [T, K] fp32): selection on score + bias in descending
    order, ties to the lower expert id (stable sort; torch.topk leaves tie order unspecified); weights are
    the unbiased scores renormalised to sum to `scale`.
    """
    scores = torch.sqrt(elementwise(F.softplus, logits.float()))
    if forced is not None:
        ids = forced.long()
    else:
        if vl is not None:
            bias_vl, token_ids, lo, hi = vl
            bias = torch.where(((token_ids >= lo) & (token_ids < hi)).unsqueeze(-1), bias_vl, bias)
        ids = torch.sort(scores + bias.float(), dim=-1, descending=True, stable=True).indices[:, :topk]
    picked = scores.gather(-1, ids)
    return ids.to(ids_dtype), scale * picked / (picked.sum(-1, keepdim=True) + 1e-20)


def swiglu(a: torch.Tensor, b: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU activation silu(min(a, l)) * clamp(b, -l, l) in fp32. a, b: [T, I] -> [T, I] in a's dtype."""
    return (elementwise(F.silu, a.float().clamp(max=limit)) * b.float().clamp(-limit, limit)).to(a.dtype)


def swiglu_clamped(x: torch.Tensor, w1, w3, w2,
                   limit: float, act=None, activation=swiglu) -> torch.Tensor:
    """Clamped SwiGLU expert: (silu(min(x w1, l)) * clamp(x w3, -l, l)) w2. x: [T, D] -> [T, D].
    w1, w3: [I, D] and w2: [D, I] weights, or callables t -> t W^T (FP8-packed linears); w3 = None:
    w1 is a callable giving both products (t W1^T, t W3^T) (one stacked GEMM, `Linear.matmul_group`).

    `act`: optional function applied to each GEMM input (parity numerics: FP8 activation round trip);
    `activation`: the `swiglu` op to use (`ops.swiglu_clamped` passes the device kernel's)."""
    act = act or (lambda t: t)
    xa = act(x)
    a, b = w1(xa) if w3 is None else (_mm(xa, w1), _mm(xa, w3))
    return _mm(act(activation(a, b, limit).to(x.dtype)), w2)


def _mm(x: torch.Tensor, w) -> torch.Tensor:
    """x W^T for a weight tensor W, or w(x) for a callable (a packed linear's product)."""
    return w(x) if callable(w) else matmul(x, w)


def _grouped_mm_takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch._grouped_mm accepts these operands: one dtype of bf16/fp16/fp32, row strides and
    weight offsets of 16-byte multiples (D, I, the weights' strides; allocations are 16-byte aligned),
    fewer than 1024 experts (the CUTLASS kernel's limit)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not x.dtype == w13.dtype == w2.dtype:
        return False
    align = 16 // x.element_size()
    return (w13.shape[0] < 1024 and x.shape[1] % align == 0 and w2.shape[2] % align == 0
            and all(w.stride(-1) == 1 and w.stride(-2) % align == 0 and w.storage_offset() % align == 0
                    for w in (w13, w2)))


def _routed_experts_loop(rows: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         limit: float) -> torch.Tensor:
    """Fallback for the grouped GEMMs of `routed_experts`: rows[offs[e-1]:offs[e]] through expert e by
    `swiglu_clamped`, one host sync for offs. rows: [N, D] sorted by expert; offs: [E] -> [N, D]."""
    inter = w2.shape[2]
    y = rows.new_empty(rows.shape[0], w2.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            y[start:end] = swiglu_clamped(rows[start:end], w13[e, :inter], w13[e, inter:], w2[e], limit)
        start = end
    return y


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Sum of weighted routed experts. x: [T, D]; ids/weights: [T, K]; w13: [E, 2I, D]; w2: [E, D, I] -> [T, D].

    out[t] = sum_k weights[t, k] * swiglu_clamped(x[t], expert ids[t, k]), summed in fp32 in
    ascending expert id (as the per-expert loops of the dense references), returned in x.dtype; on
    CPU bitwise equal to such a loop. Fixed shapes, no host sync: the T*K assignments are
    stably sorted by expert, offs[e] = #assignments with id <= e (int32, always [E]), and two
    torch._grouped_mm (rows w13^T, then h w2^T) run one GEMM per expert over its rows; the SwiGLU
    runs in fp32 and h is cast back to x.dtype, as in `swiglu_clamped`. A token's row depends on the
    other tokens only through the GEMM (no atomics; the K-sum has a fixed order), and torch promises
    no batch invariance for it: on CPU (one mm per expert) bf16 rows are bitwise batch-invariant in
    the tests, fp32 ones are not (MKL sgemm rounds by the expert's row count); the CUDA CUTLASS
    kernel picks its tile shape from the mean rows per expert (T*K/E <= 128 or not), and gave
    bitwise-equal bf16 rows on an H200 up to T*K/E = 1875.

    torch._grouped_mm on CUDA: bf16 on SM90/SM100 runs the CUTLASS grouped GEMM (fp32 accumulation,
    no sync, CUDA-graph capturable); fp16/fp32, or other GPUs, run torch's own mm loop over the
    experts after copying offs to the host (a sync; not capturable). Operands it refuses (other
    dtypes; D or I not a multiple of 16 bytes: 8 elements in 16-bit, 4 in fp32) run
    `_routed_experts_loop`, likewise one sync.
    """
    T, K = ids.shape
    inter = w2.shape[2]
    ids, slot = ids.sort(dim=1, stable=True)  # each token's experts ascending: the order of the fp32 sum
    weights = weights.gather(1, slot)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # [T*K] assignment t*K+k, grouped by expert
    offs = torch.searchsorted(flat[order], torch.arange(1, w2.shape[0] + 1, device=ids.device), out_int32=True)
    rows = x[order // K]  # [T*K, D]
    if _grouped_mm_takes(x, w13, w2) and not BATCH_INVARIANT:
        h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # [T*K, 2I]
        a = h[:, :inter].float().clamp(max=limit)
        b = h[:, inter:].float().clamp(-limit, limit)
        y = torch._grouped_mm((F.silu(a) * b).to(x.dtype), w2.transpose(1, 2), offs=offs)  # [T*K, D]
    else:
        y = _routed_experts_loop(rows, offs, w13, w2, limit)
    y = torch.empty_like(y).index_copy_(0, order, y).view(T, K, w2.shape[1])  # back to assignment order t*K+k
    out = y[:, 0].float() * weights[:, :1]
    for k in range(1, K):  # fixed order: a token's sum does not depend on the batch
        out = out + y[:, k].float() * weights[:, k:k + 1]
    return out.to(x.dtype)


def routed_experts_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                          w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                          fmt: str = "mxfp4") -> torch.Tensor:
    """`routed_experts` with the expert weights in their stored format. fmt "mxfp4" (model-spec §4.3):
    w13 uint8 [E, 2I, D/2] + E8M0 bytes w13_scale [E, 2I, D/32]; w2 uint8 [E, D, I/2] + w2_scale [E, D, I/32].

    Dequantised (exact) to x.dtype, then `routed_experts`: bitwise equal to it on the dequantised weights.
    """
    if fmt != "mxfp4":
        raise ValueError(f"routed_experts_packed: unknown expert format {fmt!r}")
    w13, w2 = (dequant_mxfp4(w, s, checked=False).to(x.dtype) for w, s in ((w13, w13_scale), (w2, w2_scale)))
    return routed_experts(x, ids, weights, w13, w2, limit)


def sparse_attention_gathered(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """`sparse_attention` with each query's own gathered keys (decode path).

    q: [T, H, d]; keys: [T, K, d] (K = V); valid: [T, K] bool; sink: [H] -> [T, H, d]. Invalid rows
    may hold anything (they are zeroed before use).
    """
    keys = torch.where(valid.unsqueeze(-1), keys.float(), 0.0)
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    probs = _sink_softmax(scores.masked_fill(~valid.unsqueeze(1), float("-inf")), sink)
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Gather form of `sparse_attention`: each query attends to its own rows kv[idx[t, j]].

    q: [T, H, d]; kv: [R, d] (K = V); idx: [T, K] distinct row ids, -1 = none; sink: [H] -> [T, H, d].
    Computed here in token tiles as masked attention over the rows the tile uses (their sorted
    union U): consecutive tokens of a request share most rows, so each tile is one shared-key GEMM
    (the per-request product of the old per-span path, without its loop). Peak temporaries
    tile * H * |U| fp32 values with |U| <= min(R, tile * K), kept under TILE_ELEMS; never [T, R].
    Device kernels gather the K rows instead.
    """
    t, k = idx.shape
    if t == 0:
        return torch.empty_like(q)
    tile = _token_tile(t, lambda n: q.shape[1] * min(kv.shape[0], n * k))
    out = []
    for s in range(0, t, tile):
        sub = idx[s:s + tile]
        valid = sub >= 0
        rows = torch.unique(sub[valid])                                        # sorted union [U]
        col = torch.where(valid, torch.searchsorted(rows, sub.clamp(min=0)), rows.numel())
        allowed = torch.zeros(sub.shape[0], rows.numel() + 1, dtype=torch.bool, device=idx.device)
        out.append(sparse_attention(q[s:s + tile], kv[rows], allowed.scatter_(1, col, True)[:, :-1], sink, scale))
    return out[0] if len(out) == 1 else torch.cat(out)


TILE_ELEMS = 1 << 24  # fp32 values of the largest temporary of one token tile (64 MiB)


def _token_tile(t: int, per_tile: Callable[[int], int]) -> int:
    """Largest power-of-two token tile (at most t rounded up) whose temporary of n * per_tile(n) fp32
    values stays within TILE_ELEMS (at least 1 token)."""
    n = 1
    while n < t and 2 * n * per_tile(2 * n) <= TILE_ELEMS:
        n *= 2
    return n


def indexer_scores_ragged(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor,
                          n_keys: torch.Tensor, n_cols: int) -> torch.Tensor:
    """`indexer_scores` of each token against its own range of a packed key buffer (varlen prefill).

    out[t, j] = sum_h w[t, h] * relu(q[t, h] . keys[key_start[t] + j]) for j < n_keys[t], -inf for
    n_keys[t] <= j < n_cols. q: [T, H_I, d_I]; weights: [T, H_I]; keys: [N, d_I]; key_start, n_keys: [T]
    int -> [T, n_cols] fp32. Computed here in token tiles as `indexer_scores` against the key range
    the tile's tokens use (one GEMM: consecutive tokens of a request share their rows; reads the
    range bounds on the host), then each token's columns are picked. Peak temporaries about
    tile * H_I * (n_cols * spans in the tile) fp32 values, within TILE_ELEMS; kernels read rows in place.
    """
    t = q.shape[0]
    out = torch.full((t, n_cols), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or n_cols == 0:
        return out
    h = q.shape[1]
    width = int((key_start + n_keys).max() - key_start.min())
    tile = _token_tile(t, lambda n: h * min(width, n * n_cols))
    cols = torch.arange(n_cols, device=q.device)
    for s in range(0, t, tile):
        ks, nk = key_start[s:s + tile], n_keys[s:s + tile]
        lo, hi = int(ks.min()), int((ks + nk).max())
        if hi <= lo:
            continue
        scores = indexer_scores(q[s:s + tile], weights[s:s + tile], keys[lo:hi])        # [tile, hi - lo]
        pick = (ks - lo).unsqueeze(1) + cols
        valid = cols < nk.unsqueeze(1)
        out[s:s + tile] = torch.where(valid, scores.gather(1, pick.clamp(max=hi - lo - 1)), float("-inf"))
    return out


# ----------------------------------------------------------------------------- paged forms (decode)
def row_slots(block_table: torch.Tensor, req: torch.Tensor, row_ids: torch.Tensor, tokens_per_row: int,
              block_size: int, rows_per_block: int, masked: bool = False,
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """Flat slots of rows `row_ids` of requests `req` in a paged row buffer (one row per `tokens_per_row`
    tokens, `block_size` tokens per block): row i lives in block block_table[r, i*m // block_size], slot
    (i*m % block_size) // m of it. block_table: [R, NB]; req: [T] or [T, 1]; row_ids: [T] or [T, K] -> int64,
    row_ids' shape. Block columns past the table are clamped into it (any id maps to some slot); `masked`:
    ids < 0 give -1; `keep` [T]: slot 0 (the null block) where False, for fixed-shape writes."""
    if masked:
        return torch.where(row_ids >= 0, row_slots(block_table, req, row_ids.clamp(min=0), tokens_per_row,
                                                   block_size, rows_per_block, keep=keep), -1)
    if req.dim() < row_ids.dim():
        req = req.reshape(*req.shape, *[1] * (row_ids.dim() - req.dim()))
    tok = row_ids * tokens_per_row
    col = (tok // block_size).clamp(0, block_table.shape[1] - 1)
    slots = block_table[req, col].long() * rows_per_block + (tok % block_size) // tokens_per_row
    return slots if keep is None else torch.where(keep.view(-1, *[1] * (slots.dim() - 1)), slots, 0)


def range_slots(block_table: torch.Tensor, req: torch.Tensor, start: torch.Tensor, count: int,
                stop: torch.Tensor | None, tokens_per_row: int, block_size: int, rows_per_block: int) -> torch.Tensor:
    """`row_slots` (masked) of the row ids start[t] + j, j < count, of request req[t]; ids below 0 or at or above
    stop[t] (None: no upper bound) give -1. start, stop: [T] -> [T, count] int64 (decode's window rows,
    HCA's visible rows)."""
    ids = start.unsqueeze(1) + torch.arange(count, device=start.device)
    valid = ids >= 0 if stop is None else (ids >= 0) & (ids < stop.unsqueeze(1))
    return row_slots(block_table, req, torch.where(valid, ids, -1), tokens_per_row, block_size, rows_per_block,
                     masked=True)


def gather_pair(kv_a: torch.Tensor, idx_a: torch.Tensor, kv_b: torch.Tensor,
                idx_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows kv_a[idx_a[t]] then kv_b[idx_b[t]] per query (-1 = none) -> keys [T, K_a + K_b, d], valid [T, K_a + K_b]."""
    keys = torch.cat([kv_a[idx_a.clamp(min=0)], kv_b[idx_b.clamp(min=0)]], dim=1)
    return keys, torch.cat([idx_a >= 0, idx_b >= 0], dim=1)


def sparse_attention_paged(q: torch.Tensor, kv_a: torch.Tensor, idx_a: torch.Tensor, kv_b: torch.Tensor,
                           idx_b: torch.Tensor, sink: torch.Tensor, scale: float,
                           attend=sparse_attention_gathered) -> torch.Tensor:
    """`sparse_attention_gathered` over each query's rows kv_a[idx_a[t]] then kv_b[idx_b[t]] (-1 = none).

    q: [T, H, d]; kv_*: [R_*, d] row buffers (e.g. two paged caches); idx_*: [T, K_*] -> [T, H, d].
    `attend`: the gathered attention to run on the rows (the ops layer passes its dispatched one)."""
    return attend(q, *gather_pair(kv_a, idx_a, kv_b, idx_b), sink, scale)


def _record_areas(pages: torch.Tensor, rows_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a record cache's pages [B, P] uint8: data [B, R, 576] (block start), scales [B, R, 8] (after it)."""
    r, data_bytes = rows_per_block, quant.KV_RECORD_DATA_BYTES
    data = pages[:, :r * data_bytes].unflatten(1, (r, data_bytes))
    scales = pages[:, r * data_bytes:r * quant.KV_RECORD_BYTES].unflatten(1, (r, quant.KV_RECORD_SCALE_BYTES))
    return data, scales


def kv_record_store(pages: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rows_per_block: int) -> None:
    """Quantise rows [N, 512] into ``fp8_ds_mla`` records at flat slots [N] (block slot // R, row slot % R) of
    pages [B, P] uint8 (`quant.kv_record_encode`; vLLM's block layout: R x 576 data bytes, then R x 8 scale bytes)."""
    data, scales = _record_areas(pages, rows_per_block)
    b, r = slots // rows_per_block, slots % rows_per_block
    data[b, r], scales[b, r] = quant.kv_record_encode(rows)


def kv_record_gather(pages: torch.Tensor, slots: torch.Tensor, rows_per_block: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantised records at flat slots [...] of pages [B, P] uint8 -> [..., 512] of `dtype` (slot -1 reads slot 0;
    callers mask it)."""
    data, scales = _record_areas(pages, rows_per_block)
    s = slots.clamp(min=0)
    b, r = s // rows_per_block, s % rows_per_block
    return quant.kv_record_decode(data[b, r], scales[b, r], dtype)


def sparse_attention_records(q: torch.Tensor, pages_a: torch.Tensor, idx_a: torch.Tensor, pages_b: torch.Tensor,
                             idx_b: torch.Tensor, rows_per_block: int, sink: torch.Tensor, scale: float,
                             attend=sparse_attention_gathered) -> torch.Tensor:
    """`sparse_attention_paged` over two ``fp8_ds_mla`` record caches: each query's records pages_a[idx_a[t]] then
    pages_b[idx_b[t]] (flat slots, -1 = none), dequantised (`kv_record_gather`) to q's dtype, then `attend`.

    q: [T, H, 512]; pages_*: [B_*, P] uint8 with `rows_per_block` records per block; idx_*: [T, K_*] -> [T, H, 512]."""
    keys = torch.cat([kv_record_gather(pages_a, idx_a, rows_per_block, q.dtype),
                      kv_record_gather(pages_b, idx_b, rows_per_block, q.dtype)], dim=1)
    return attend(q, keys, torch.cat([idx_a >= 0, idx_b >= 0], dim=1), sink, scale)


def indexer_scores_paged(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor,
                         n_valid: torch.Tensor, n_rows: int, rows_per_block: int,
                         score=indexer_scores_gathered) -> torch.Tensor:
    """`indexer_scores_gathered` of each token against rows 0..n_rows-1 of its own request in a paged key
    buffer (`range_slots` of rows 0 .. n_rows - 1 over each token's own block-table row), -inf from row n_valid[t] on.

    q: [T, H_I, d_I]; weights: [T, H_I]; keys: [R, d_I]; block_table: [T, NB]; n_valid: [T] -> [T, n_rows] fp32.
    `score`: the gathered scoring to run (the ops layer passes its dispatched one)."""
    t = block_table.shape[0]
    rows = torch.arange(t, device=q.device)
    slots = range_slots(block_table, rows, torch.zeros_like(rows), n_rows, None, 1, rows_per_block, rows_per_block)
    scores = score(q, weights, keys[slots])
    return scores.masked_fill(torch.arange(n_rows, device=q.device) >= n_valid.unsqueeze(1), float("-inf"))
