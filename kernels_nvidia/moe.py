"""Routed experts reading MXFP4 weights directly (weight-only W4A16 grouped GEMMs, Triton).

Same semantics as the oracle `routed_experts_packed` (`vllm_deepinfer.ops.reference`): the weights are
the stored MXFP4 codes (model-spec §4.3), never dequantised to memory:

    w13: uint8 [E, 2I, D/2], w13_scale: uint8 (E8M0) [E, 2I, D/32]   (rows 0..I-1 = w1, I..2I-1 = w3)
    w2:  uint8 [E, D, I/2],  w2_scale:  uint8 (E8M0) [E, D, I/32]
    W[n, k] = e2m1(nibble(w[n, k // 2], k % 2)) * 2**(scale[n, k // 32] - 127), even k = low nibble

Steps (no host sync, shapes fixed by T and K only, so CUDA-graph capturable):
  1. the T*K (token, expert) pairs, each token's experts ascending, stably sorted by expert (up to
     PAIRS_KERNEL_MAX pairs one program, `_pairs_kernel`; above, ~14 torch ops giving the same permutation);
     ends[e] = #pairs with expert <= e; per-expert tiles of BM rows (`row_tile`: 16 at decode, up to 128 when
     each expert has many pairs), tile_ends[e] = #tiles of experts <= e.
     The grid holds min(T*K, T*K // BM + E) row tiles, an upper bound of sum_e ceil(n_e / BM);
     programs past the last tile return at once.
  2. `_gate_up_kernel`: per (row tile, BN columns of I): a = x W1^T, b = x W3^T with fp32 accumulation,
     each rounded to x.dtype (the oracle's grouped-GEMM output), then h = x.dtype(silu(min(a, l)) * clamp(b, -l, l))
     in fp32, the oracle's `swiglu_clamped` rounding points.
  3. `_down_kernel`: y = h W2^T per pair, fp32 accumulation, stored in x.dtype.
  4. `_combine_kernel`: out[t] = x.dtype(sum_k w[t, k] * y[t, k]) in fp32, k in ascending expert order
     (a fixed order, no atomics).
Every dot product of a row runs over K in the same fixed BK chunks with the same weight tile [BN, BK] (the
tensor-core M dimension: BN and BK are constants), and a pair's row does not depend on the other rows of its
tile, so a token's result is bitwise independent of the batch. The GEMMs are "swap AB": the dequantised weight
tile is the left operand, the gathered activations [BK, BM] the right one, so the row tile BM is the MMA's N
dimension; it is chosen from the batch (fewer weight re-reads when experts have many pairs) because an output
element's k-ordered accumulation does not depend on N: on an H100 (triton 3.6, wgmma) BM 16 / 32 / 64 / 128 gave
bitwise equal rows at T 64 - 4,096, while a BN of 32 (mma.sync instead of wgmma) changed them
(benchmarks/results/gpu-1207e; tests/gpu/test_moe_kernels.py checks it on every GPU run).

Dequantisation in registers: a nibble s|e1 e0|m is placed into an fp16 (sign -> bit 15, e1 e0 m -> bits
11..9), whose value is exactly e2m1 * 2**-14 (code 1 becomes the fp16 subnormal 2**-15; the conversion to
fp32 is exact), then multiplied by 2**(scale - 113) in fp32. Exact for scale bytes 1..240 (weights below
2**114); byte 0 (2**-127) decodes as 0. Scale bytes are validated at load (0xFF is rejected).
(`tl.dot_scaled` on the stored bytes was tried, 2026-12-07: fewer instructions in the sm_90 PTX, yet on an H100
(host triton 3.6, release expert count) 1.1-1.2x slower at its best tiles than this path at its best.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Output columns and reduction chunk (a multiple of 32): fixed. BN 64 keeps the weight tile on wgmma.
BN, BK = 64, 128
# Pairs per row tile by the batch's mean pairs per expert (T*K/E): (below this mean, BM). H100 (host triton 3.6,
# E=384 top-6, D 5120, I 2304; benchmarks/results/gpu-1207b, gpu-1207e): BM 16 is best up to T 256 (1,569 /
# 4,068 / 6,340 us at T 16 / 64 / 256 against 2,134 / 5,713 / 8,854 with BM 64), BM 32 at T 1,024 (8,384 against
# 9,067 us with BM 16), BM 128 at T 4,096 (13,569 against 26,956 with BM 16 and 14,523 with BM 64).
ROW_TILES = ((8, 16), (32, 32), (48, 64))
BM_LARGE = 128
BM: int | None = None  # a fixed row tile instead (benchmark sweeps)
BD_COMBINE = 512
PAIRS_KERNEL_MAX = 512  # pairs whose routing glue is one program (decode: T 1-85 at top-6)
WARPS = 4
# Pipeline depth by row tile (2 where absent): H100 (2026-12-08, E=384 top-6, host triton 3.6), BM 16 at 3 stages
# 1.08-1.17x over 2 at T 1 / 16 / 64 / 256 (135 / 1,453 / 3,666 / 5,758 us), same bits; 4 stages no better.
ROW_STAGES = {16: 3}
STAGES: int | None = None  # a fixed depth instead (benchmark sweeps)


def row_tile(pairs: int, experts: int) -> int:
    """Row tile BM for `pairs` (token, expert) pairs over `experts` experts."""
    if BM is not None:
        return BM
    return next((bm for below, bm in ROW_TILES if pairs < below * experts), BM_LARGE)


def stages(bm: int) -> int:
    """Pipeline depth of the expert kernels at row tile `bm` (the pipeline does not change a row's bits)."""
    return STAGES if STAGES is not None else ROW_STAGES.get(bm, 2)


@triton.jit
def _pairs_kernel(ids_ptr, w_ptr, ws_ptr, e_ptr, order_ptr, ends_ptr, tile_ends_ptr, pos_ptr, P, E, bm,
                  K: tl.constexpr, K_POW2: tl.constexpr, P_POW2: tl.constexpr, E_POW2: tl.constexpr,
                  CHUNK: tl.constexpr):
    """One program: the routing glue of `routed_experts_packed` for P = T*K pairs, as its torch path computes it.

    Pair q = t*K + r is token t's r-th expert in ascending order (stable), e[q] that expert (scratch), ws[q] its
    weight; pos[q] its row when the pairs are stably sorted by expert, order[pos[q]] = q; ends[e] = #pairs with
    expert <= e; tile_ends[e] = #row tiles of bm rows of experts <= e."""
    q = tl.arange(0, P_POW2)
    ok = q < P
    t, r = q // K, q % K
    j = tl.arange(0, K_POW2)
    row_ok = ok[:, None] & (j < K)[None, :]
    e_tok = tl.load(ids_ptr + t[:, None] * K + j[None, :], mask=row_ok, other=E).to(tl.int32)  # token t's experts
    w_tok = tl.load(w_ptr + t[:, None] * K + j[None, :], mask=row_ok, other=0.0)
    rank = tl.zeros([P_POW2, K_POW2], tl.int32)  # of each of them among the K: smaller, or equal and listed first
    for i in tl.static_range(K):
        e_i = tl.load(ids_ptr + t * K + i, mask=ok, other=E).to(tl.int32)
        rank += ((e_i[:, None] < e_tok) | ((e_i[:, None] == e_tok) & (i < j)[None, :])).to(tl.int32)
    pick = row_ok & (rank == r[:, None])
    e = tl.where(ok, tl.sum(tl.where(pick, e_tok, 0), axis=1), E)
    tl.store(e_ptr + q, e, mask=ok)
    tl.store(ws_ptr + q, tl.sum(tl.where(pick, w_tok, 0.0), axis=1).to(ws_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()
    es = tl.arange(0, E_POW2)
    within = tl.zeros([P_POW2], tl.int32)  # pairs before q with q's expert
    count = tl.zeros([E_POW2], tl.int32)   # pairs per expert
    for c0 in range(0, P, CHUNK):
        qc = c0 + tl.arange(0, CHUNK)
        e_c = tl.load(e_ptr + qc, mask=qc < P, other=E)
        within += tl.sum(((e_c[None, :] == e[:, None]) & (qc[None, :] < q[:, None])).to(tl.int32), axis=1)
        count += tl.sum((e_c[None, :] == es[:, None]).to(tl.int32), axis=1)
    ends = tl.cumsum(count, axis=0)
    tl.store(ends_ptr + es, ends, mask=es < E)
    tl.store(tile_ends_ptr + es, tl.cumsum((count + bm - 1) // bm, axis=0), mask=es < E)
    tl.debug_barrier()
    row = tl.load(ends_ptr + e - 1, mask=ok & (e > 0), other=0) + within  # pairs of smaller experts first
    tl.store(pos_ptr + q, row.to(tl.int64), mask=ok)
    tl.store(order_ptr + row, q, mask=ok)


@triton.jit
def _row_tile(tile_ends_ptr, ends_ptr, order_ptr, E: tl.constexpr, E_POW2: tl.constexpr, K_TOP,
              BM: tl.constexpr):
    """Expert, sorted row ids [BM], validity [BM] and token ids [BM] of row tile program_id(0)."""
    pid = tl.program_id(0)
    es = tl.arange(0, E_POW2)
    tile_ends = tl.load(tile_ends_ptr + es, mask=es < E, other=2147483647)
    e = tl.sum((tile_ends <= pid).to(tl.int32), axis=0)  # first expert whose tiles end after pid
    e_c = tl.minimum(e, E - 1)
    prev = tl.maximum(e_c - 1, 0)  # the expert before (its ends), none for expert 0
    tile0 = tl.where(e_c > 0, tl.load(tile_ends_ptr + prev), 0)
    row0 = tl.where(e_c > 0, tl.load(ends_ptr + prev), 0)
    row_end = tl.load(ends_ptr + e_c)
    rows = row0 + (pid - tile0) * BM + tl.arange(0, BM)
    valid = rows < tl.where(e < E, row_end, 0)  # rows >= 0: none past the last expert
    pair = tl.load(order_ptr + rows, mask=valid, other=0)
    return e, e_c.to(tl.int64), rows, valid, pair // K_TOP


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, n, n_ok, k0, KD, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr):
    """Dequantised fp32 tile W[n, k0:k0+BK] ([BN, BK]) of one expert's packed bytes [N, KD/2] and E8M0
    bytes [N, KD/32]; columns past KD (a multiple of 32) and rows with n_ok false are 0."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    kg = k0 // 32 + tl.arange(0, BK // 32)
    b = tl.load(w_ptr + n[:, None] * stride_wn + kb[None, :], mask=n_ok[:, None] & (kb < KD // 2)[None, :],
                other=0).to(tl.int32)
    s = tl.load(s_ptr + n[:, None] * stride_sn + kg[None, :], mask=n_ok[:, None] & (kg < KD // 32)[None, :],
                other=0).to(tl.int32)
    lo = ((b & 0x08) << 12) | ((b & 0x07) << 9)  # fp16 bits of e2m1(low nibble) * 2**-14
    hi = ((b & 0x80) << 8) | ((b & 0x70) << 5)  # same for the high nibble
    w = tl.interleave(lo.to(tl.int16).to(tl.float16, bitcast=True),
                      hi.to(tl.int16).to(tl.float16, bitcast=True)).to(tl.float32)  # even element = low nibble
    scale = tl.where(s > 0, ((s + 14) << 23).to(tl.float32, bitcast=True), 0.0)  # 2**(s - 127) * 2**14
    return tl.reshape(tl.reshape(w, (BN, BK // 32, 32)) * scale[:, :, None], (BN, BK))


@triton.jit
def _dot(w, xt, acc, IEEE: tl.constexpr):
    """acc + w [BN, BK] @ xt [BK, BM]: fp32 accumulation; w is rounded to xt's dtype (exact for MXFP4 values)."""
    if IEEE:
        return tl.dot(w, xt, acc, input_precision="ieee")
    return tl.dot(w.to(xt.dtype), xt, acc)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, order_ptr, ends_ptr, tile_ends_ptr, K_TOP, D, I, limit,
                    stride_x, stride_we, stride_wn, stride_se, stride_sn,
                    E: tl.constexpr, E_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    IEEE: tl.constexpr):
    """h[r, n] = swiglu(x[token(r)] . w1[e, n], x[token(r)] . w3[e, n]) for the BM sorted pairs r of a row tile."""
    e, e64, rows, valid, tok = _row_tile(tile_ends_ptr, ends_ptr, order_ptr, E, E_POW2, K_TOP, BM)
    if e >= E:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < I
    w_e, s_e = w_ptr + e64 * stride_we, s_ptr + e64 * stride_se
    acc_a = tl.zeros((BN, BM), tl.float32)
    acc_b = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + tok[None, :].to(tl.int64) * stride_x + k[:, None],
                     mask=valid[None, :] & (k < D)[:, None], other=0.0)  # [BK, BM]
        acc_a = _dot(_mxfp4_tile(w_e, s_e, n, n_ok, k0, D, stride_wn, stride_sn, BN, BK), xt, acc_a, IEEE)
        acc_b = _dot(_mxfp4_tile(w_e, s_e, n + I, n_ok, k0, D, stride_wn, stride_sn, BN, BK), xt, acc_b, IEEE)
    dt = h_ptr.dtype.element_ty
    a = tl.minimum(acc_a.to(dt).to(tl.float32), limit)
    b = tl.minimum(tl.maximum(acc_b.to(dt).to(tl.float32), -limit), limit)
    h = a / (1.0 + tl.exp(-a)) * b
    tl.store(h_ptr + rows[None, :].to(tl.int64) * I + n[:, None], h.to(dt), mask=valid[None, :] & n_ok[:, None])


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, order_ptr, ends_ptr, tile_ends_ptr, K_TOP, D, I,
                 stride_we, stride_wn, stride_se, stride_sn,
                 E: tl.constexpr, E_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 IEEE: tl.constexpr):
    """y[r, n] = h[r] . w2[e, n] for the BM sorted pairs r of a row tile (rows of h are in sorted order)."""
    e, e64, rows, valid, tok = _row_tile(tile_ends_ptr, ends_ptr, order_ptr, E, E_POW2, K_TOP, BM)
    if e >= E:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < D
    w_e, s_e = w_ptr + e64 * stride_we, s_ptr + e64 * stride_se
    acc = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)
        ht = tl.load(h_ptr + rows[None, :].to(tl.int64) * I + k[:, None],
                     mask=valid[None, :] & (k < I)[:, None], other=0.0)  # [BK, BM]
        acc = _dot(_mxfp4_tile(w_e, s_e, n, n_ok, k0, I, stride_wn, stride_sn, BN, BK), ht, acc, IEEE)
    tl.store(y_ptr + rows[None, :].to(tl.int64) * D + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=valid[None, :] & n_ok[:, None])


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, K_TOP, D, BD: tl.constexpr):
    """out[t, d] = sum over k = 0..K-1 in order of w[t, k] * y[pos[t, k], d], fp32, stored in out's dtype."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = d < D
    acc = tl.zeros((BD,), tl.float32)
    for k in range(0, K_TOP):
        r = tl.load(pos_ptr + t * K_TOP + k).to(tl.int64)
        wk = tl.load(w_ptr + t * K_TOP + k).to(tl.float32)
        acc += tl.load(y_ptr + r * D + d, mask=ok, other=0.0).to(tl.float32) * wk
    tl.store(out_ptr + t.to(tl.int64) * D + d, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _pairs(ids: torch.Tensor, weights: torch.Tensor, E: int, bm: int):
    """ids, weights [T, K] -> each token's weights in ascending expert order [T, K]; order int32 [T*K] (pairs
    stably sorted by expert; pair t*K+r = token t's r-th smallest expert); ends, tile_ends int32 [E]; pos int64
    [T*K] (pair -> sorted row). One kernel up to PAIRS_KERNEL_MAX pairs, torch above (same permutation)."""
    T, K = ids.shape
    P, dev = T * K, ids.device
    if P <= PAIRS_KERNEL_MAX:
        ids, weights = ids.contiguous(), weights.contiguous()
        ws = torch.empty_like(weights)
        e, order = (torch.empty(P, dtype=torch.int32, device=dev) for _ in range(2))
        ends, tile_ends = (torch.empty(E, dtype=torch.int32, device=dev) for _ in range(2))
        pos = torch.empty(P, dtype=torch.int64, device=dev)
        _pairs_kernel[(1,)](ids, weights, ws, e, order, ends, tile_ends, pos, P, E, bm, K=K,
                            K_POW2=triton.next_power_of_2(K), P_POW2=max(16, triton.next_power_of_2(P)),
                            E_POW2=triton.next_power_of_2(E), CHUNK=16, num_warps=WARPS)
        return ws, order, ends, tile_ends, pos
    ids, slot = ids.sort(dim=1, stable=True)  # each token's experts ascending: the order of the sum
    weights = weights.gather(1, slot).contiguous()
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # [T*K] pair t*K+k, grouped by expert
    ends = torch.searchsorted(flat[order], torch.arange(1, E + 1, device=dev), out_int32=True)
    tiles = torch.diff(ends, prepend=ends.new_zeros(1)).add_(bm - 1).div_(bm, rounding_mode="floor")
    tile_ends = tiles.cumsum(0, dtype=torch.int32)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(P, device=dev))  # pair -> sorted row
    return weights, order.to(torch.int32), ends, tile_ends, pos


def routed_experts_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                          w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                          fmt: str = "mxfp4") -> torch.Tensor:
    """x: [T, D] (bf16 or fp32); ids, weights: [T, K]; packed weights as in the module docstring -> [T, D]."""
    if (fmt != "mxfp4" or x.dtype not in (torch.bfloat16, torch.float32)
            or any(t.stride(-1) != 1 for t in (w13, w13_scale, w2, w2_scale))):
        raise NotImplementedError(f"routed_experts_packed: format {fmt}, activations {x.dtype}")
    T, K = ids.shape
    E, I, D = w13.shape[0], w2.shape[2] * 2, x.shape[1]
    if T == 0:
        return x.new_empty(0, D)
    x = x.contiguous()
    w13, w13_scale, w2, w2_scale = (t.view(torch.uint8) for t in (w13, w13_scale, w2, w2_scale))
    bm = row_tile(T * K, E)
    weights, order, ends, tile_ends, pos = _pairs(ids, weights, E, bm)
    n_tiles = min(T * K, T * K // bm + E)
    common = dict(E=E, E_POW2=triton.next_power_of_2(E), BM=bm, BN=BN, BK=BK, IEEE=x.dtype == torch.float32,
                  num_warps=WARPS, num_stages=stages(bm))
    h = x.new_empty(T * K, I)
    _gate_up_kernel[(n_tiles, triton.cdiv(I, BN))](
        x, w13, w13_scale, h, order, ends, tile_ends, K, D, I, float(limit), x.stride(0),
        w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), **common)
    y = x.new_empty(T * K, D)
    _down_kernel[(n_tiles, triton.cdiv(D, BN))](
        h, w2, w2_scale, y, order, ends, tile_ends, K, D, I,
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), **common)
    out = x.new_empty(T, D)
    _combine_kernel[(T, triton.cdiv(D, BD_COMBINE))](y, pos, weights, out, K, D, BD=BD_COMBINE, num_warps=WARPS)
    return out
