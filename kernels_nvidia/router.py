"""The MoE router `sqrtsoftplus_route` (model-spec §3.8) as one Triton kernel, one program per token row.

`sqrtsoftplus_route(logits, bias, topk, scale, forced, vl, ids_dtype)`: logits [T, E] fp32; bias None, [E] or [T, E]
fp32; forced None or [T, K] int (hash layers: the ids are given, only the weights computed); vl None or (bias_vl [E],
token_ids [T], lo, hi): V4.1's image tokens (lo <= id < hi) take bias_vl, chosen per row inside the kernel (no
per-layer mask and select) -> (ids [T, K] `ids_dtype` (int64 or int32), weights [T, K] fp32). Per row: scores =
sqrt(softplus(logits)) (torch's softplus: beta 1, threshold 20), ids = the K largest scores + bias in descending
order, ties to the lower expert id, weights = scale * picked / (sum(picked) + 1e-20) of the unbiased scores at the
ids.

Exactness contract (against the oracle `vllm_deepinfer.ops.reference.sqrtsoftplus_route`):
* ids equal the oracle's stable descending sort bitwise given the same scores: each value is mapped to an int32 key
  whose order is torch.sort's float order (-0.0 = +0.0, every NaN above +inf, equal among themselves) and packed
  with the inverted column into an int64, so one max per pick finds the largest value at its lowest column. NaN
  scores (NaN logits or bias, inf - inf) are picked first, lowest column first, as the oracle's sort does.
* scores are torch's CUDA formula in fp32 (libdevice expf / log1pf without FTZ, IEEE sqrt), so on the GPU they
  are bitwise torch's (tests/gpu checks it on CUDA); the weights are scale * p / ((((p_0 + p_1) + p_2) + ...) + 1e-20)
  with IEEE division, bitwise that expression evaluated by torch on the GPU. The oracle's sum(picked) adds in
  another order (torch's CUDA row reduction picks it by the number of rows, the CPU's by K), so the weights agree
  with the oracle's to a couple of ulp.
* Triton's interpreter (TRITON_INTERPRET=1, CPU tests) has no libdevice: there exp / log are numpy's and log1p is
  log(u) * e / (u - 1) with u = 1 + e (a few ulp), so the scores may differ from the CPU oracle's in the last bits.

Bias None without forced: no bias (the oracle needs a tensor there). Forced ids outside [0, E) are not read (their
weights are unspecified; the oracle's gather fails). Declined (NotImplementedError, the oracle runs): K > MAX_K,
K > E, E > MAX_E. Every row is independent and computed in a fixed order (batch-invariant; the warps per row,
chosen by T, change no result); no host sync, capturable in CUDA graphs. T = 0 returns empty tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels_nvidia.topk import _radix_keys

MAX_E = 4096   # the row is held in registers (next_pow2(E) values per program)
MAX_K = 32     # K picks, each a max over the row; larger K: the oracle's sort
WARPS = 0      # warps per row program; 0: by the row width and the number of rows (`_warps`)
EXACT = os.environ.get("TRITON_INTERPRET") != "1"  # libdevice on the GPU; the interpreter has none


@triton.jit
def _sqrt_softplus(x, EXACT: tl.constexpr):
    """sqrt(softplus(x)) in fp32, torch's formula: x > 20 -> x, else log1p(exp(x))."""
    if EXACT:
        sp = libdevice.log1p(libdevice.exp(x))
    else:  # interpreter: log1p(e) = log(u) * e / (u - 1), u = 1 + e (exact e where u rounds to 1)
        e = tl.exp(x)
        u = 1.0 + e
        sp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, sp))


@triton.jit
def _route_kernel(L, B, BVL, TOK, F, IDS, W, E, s_l, s_b, s_f, scale, lo, hi, HAS_BIAS: tl.constexpr,
                  VL: tl.constexpr, FORCED: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                  EXACT: tl.constexpr):
    """Row program_id(0): ids and weights; KP: a power of two >= K; VL: the row's token id picks B or BVL."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    kmask = ks < K
    if FORCED:
        ids = tl.load(F + row * s_f + ks, mask=kmask, other=0).to(tl.int64)
    else:
        offs = tl.arange(0, BLOCK)
        valid = offs < E
        v = _sqrt_softplus(tl.load(L + row * s_l + offs, mask=valid, other=0.0), EXACT)
        if HAS_BIAS:
            b = tl.load(B + row * s_b + offs, mask=valid, other=0.0)
            if VL:
                tok = tl.load(TOK + row)
                image = (tok >= lo) & (tok < hi)
                b = tl.where(image, tl.load(BVL + offs, mask=valid, other=0.0), b)
            v = v + b
        key = _radix_keys(v).to(tl.int32, bitcast=True) ^ -2147483648     # signed: torch.sort's order
        key = tl.where(valid, key, -2147483648)                        # padding below -inf: never picked (K <= E)
        packed = (key.to(tl.int64) << 32) | (BLOCK - 1 - offs).to(tl.int64)  # ties: the lower column is larger
        ids = tl.zeros([KP], tl.int64)
        for i in tl.static_range(K):
            m = tl.max(packed, 0)
            ids = tl.where(ks == i, BLOCK - 1 - (m & (BLOCK - 1)), ids)
            packed = tl.where(packed == m, -9223372036854775808, packed)
    ok = kmask & (ids >= 0) & (ids < E)            # forced ids outside [0, E) are not read (weight: unspecified)
    picked = _sqrt_softplus(tl.load(L + row * s_l + ids, mask=ok, other=0.0), EXACT)
    picked = tl.where(kmask, picked, 0.0)
    total = tl.sum(tl.where(ks == 0, picked, 0.0), 0)
    for i in tl.static_range(1, K):                # p_0 + p_1 + ... in order (each masked sum is exact: one term)
        total += tl.sum(tl.where(ks == i, picked, 0.0), 0)
    w = tl.div_rn(scale * picked, total + 1e-20)
    tl.store(IDS + row * K + ks, ids.to(IDS.dtype.element_ty), mask=kmask)
    tl.store(W + row * K + ks, w, mask=kmask)


def _warps(block: int, t: int) -> int:
    """Warps per row: 4 for a few rows (decode: latency), 1 for many (prefill: more rows per SM; H200, E=384:
    T=64 3.2 us at 4 warps vs 4.3 at 1, T=4096 13.0 us at 1 vs 19.9 at 4); at most 16 values a thread. The
    results do not depend on it (exact max, a fixed-order sum)."""
    return WARPS or max(1, block // 512, 1 if t > 512 else min(4, block // 128))


def sqrtsoftplus_route(logits: torch.Tensor, bias: torch.Tensor | None, topk: int, scale: float,
                       forced: torch.Tensor | None = None, vl: tuple | None = None,
                       ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] fp32; bias: None, [E] or [T, E]; forced: None or [T, K] int; vl: None or (bias_vl [E],
    token_ids [T], lo, hi) -> (ids [T, K] ids_dtype, weights [T, K] fp32) (oracle semantics, see the module
    docstring; bias None without forced: no bias)."""
    t, e = logits.shape
    k = forced.shape[-1] if forced is not None else int(topk)
    if k < 1 or k > MAX_K or k > e or e > MAX_E or ids_dtype not in (torch.int64, torch.int32):
        raise NotImplementedError(f"sqrtsoftplus_route: K = {k}, E = {e}, {ids_dtype} outside the kernel's bounds")
    dev = logits.device
    ids = torch.empty(t, k, dtype=ids_dtype, device=dev)
    weights = torch.empty(t, k, dtype=torch.float32, device=dev)
    if t == 0:
        return ids, weights
    logits = logits.float()
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    has_bias = forced is None and bias is not None
    s_b = 0
    if has_bias:
        bias = bias.float()
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
        s_b = bias.stride(0) if bias.dim() == 2 and bias.shape[0] > 1 else 0
    use_vl = has_bias and vl is not None
    bias_vl, token_ids, lo, hi = vl if use_vl else (None, None, 0, 0)
    if use_vl:
        if bias.dim() == 2 and bias.shape[0] > 1:
            raise NotImplementedError("sqrtsoftplus_route: vl takes a shared [E] bias")
        bias_vl, token_ids = bias_vl.float().contiguous(), token_ids.contiguous()
    if forced is not None:
        forced = forced if forced.stride(-1) == 1 else forced.contiguous()
    block = max(16, triton.next_power_of_2(e))
    _route_kernel[(t,)](logits, bias if has_bias else logits, bias_vl if use_vl else logits,
                        token_ids if use_vl else ids, forced if forced is not None else ids, ids, weights, e,
                        logits.stride(0), s_b, forced.stride(0) if forced is not None else 0, float(scale), int(lo),
                        int(hi), HAS_BIAS=has_bias, VL=use_vl, FORCED=forced is not None, K=k,
                        KP=max(2, triton.next_power_of_2(k)),
                        BLOCK=block, EXACT=EXACT, num_warps=_warps(block, t), enable_reflect_ftz=False,
                        enable_fp_fusion=False)
    return ids, weights
