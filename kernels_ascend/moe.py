"""Routed experts (model-spec §3.8): dispatch, expert GEMMs with the clamped SwiGLU, and the weighted
combine, as three Triton kernels over the T*K (token, expert) pairs.

1. torch (dispatch order): each token's K experts sorted ascending (stable), the weights with them;
   pair p = t*K + k reads x[t] directly (no copy of the rows).
2. `_expert_up_kernel`, a task = one pair x BI intermediate columns: a = x W1^T and b = x W3^T in fp32,
   rounded to x.dtype (as the oracle's GEMM output), h = silu(min(a, l)) * clamp(b, -l, l) -> x.dtype.
3. `_expert_down_kernel`, a task = one pair x BO output columns: y = h W2^T -> x.dtype.
4. `_combine_kernel`, a task = one token x BO columns: out = sum_k w[t, k] y[t, k] in fp32, k in
   ascending expert order (fixed: batch-invariant, no atomics) -> x.dtype.
Weights are bf16 [E, 2I, D] / [E, D, I] or MXFP4 (E2M1 nibble pairs + one E8M0 scale per 32 inputs:
[E, 2I, D/2] + [E, 2I, D/32], [E, D, I/2] + [E, D, I/32]), decoded in the vector unit, exactly.

The GEMMs are matrix-vector products per pair (vector unit): right for decode, where the K pairs of a
token hit distinct experts and each expert's weights are read once per pair anyway; prefill with many
tokens per expert wants a grouped cube GEMM over expert-sorted rows (torch_npu's grouped matmul or a
Triton tile kernel), not written yet. Expert parallelism across NPUs is vLLM's all2all manager
(allgather/reduce-scatter over HCCL, `NPUCommunicator`); these kernels run on the local experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend.common import e2m1, e8m0, grid

BI, BO, BKD = 64, 64, 128  # intermediate / output columns per task, reduction chunk (a multiple of 32)


@triton.jit
def _weight_tile(Wp, Sp, rows, rmask, k0, K, sw_e, sw_r, ss_r, MX: tl.constexpr, BK: tl.constexpr):
    """fp32 weight tile [R, BK] of rows `rows`, inputs k0 .. k0+BK, of one expert (Wp/Sp: its base pointers).

    MX: Wp holds E2M1 nibble pairs (input 2j in the low nibble of byte j), Sp one E8M0 per 32 inputs."""
    offs_k = k0 + tl.arange(0, BK)
    m = rmask[:, None] & (offs_k < K)[None, :]
    if MX:
        b = tl.load(Wp + rows[:, None] * sw_r + offs_k[None, :] // 2, mask=m, other=0).to(tl.int32)
        nib = tl.where((offs_k % 2)[None, :] == 0, b & 15, b >> 4)
        sc = e8m0(tl.load(Sp + rows[:, None] * ss_r + offs_k[None, :] // 32, mask=m, other=127))
        return e2m1(nib) * sc
    return tl.load(Wp + rows[:, None] * sw_r + offs_k[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _expert_up_kernel(X, IDS, W13, S13, H, P, KSEL, D, I, limit, sx_t, sw_e, sw_r, ss_e, ss_r, sh_p,
                      MX: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr):
    n_ib = (I + BI - 1) // BI
    for task in range(tl.program_id(0), P * n_ib, tl.num_programs(0)):
        p = task // n_ib
        offs_i = (task % n_ib) * BI + tl.arange(0, BI)
        imask = offs_i < I
        e = tl.load(IDS + p).to(tl.int64)
        t = p // KSEL
        wp = W13 + e * sw_e
        sp = S13 + e * ss_e
        a = tl.full([BI], 0.0, tl.float32)
        b = tl.full([BI], 0.0, tl.float32)
        for k0 in range(0, D, BK):
            offs_k = k0 + tl.arange(0, BK)
            x = tl.load(X + t * sx_t + offs_k, mask=offs_k < D, other=0.0).to(tl.float32)
            a += tl.sum(_weight_tile(wp, sp, offs_i, imask, k0, D, sw_e, sw_r, ss_r, MX, BK) * x[None, :], 1)
            b += tl.sum(_weight_tile(wp, sp, I + offs_i, imask, k0, D, sw_e, sw_r, ss_r, MX, BK) * x[None, :], 1)
        a = tl.minimum(a.to(H.dtype.element_ty).to(tl.float32), limit)
        b = tl.minimum(tl.maximum(b.to(H.dtype.element_ty).to(tl.float32), -limit), limit)
        h = a / (1.0 + tl.exp(-a)) * b
        tl.store(H + p * sh_p + offs_i, h.to(H.dtype.element_ty), mask=imask)


@triton.jit
def _expert_down_kernel(Hs, IDS, W2, S2, Y, P, D, I, sh_p, sw_e, sw_r, ss_e, ss_r, sy_p,
                        MX: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr):
    n_ob = (D + BO - 1) // BO
    for task in range(tl.program_id(0), P * n_ob, tl.num_programs(0)):
        p = task // n_ob
        offs_o = (task % n_ob) * BO + tl.arange(0, BO)
        omask = offs_o < D
        e = tl.load(IDS + p).to(tl.int64)
        acc = tl.full([BO], 0.0, tl.float32)
        for k0 in range(0, I, BK):
            offs_k = k0 + tl.arange(0, BK)
            h = tl.load(Hs + p * sh_p + offs_k, mask=offs_k < I, other=0.0).to(tl.float32)
            acc += tl.sum(_weight_tile(W2 + e * sw_e, S2 + e * ss_e, offs_o, omask, k0, I, sw_e, sw_r, ss_r,
                                       MX, BK) * h[None, :], 1)
        tl.store(Y + p * sy_p + offs_o, acc.to(Y.dtype.element_ty), mask=omask)


@triton.jit
def _combine_kernel(Y, WT, OUT, T, D, sy_p, so_t, KSEL: tl.constexpr, BO: tl.constexpr):
    n_ob = (D + BO - 1) // BO
    for task in range(tl.program_id(0), T * n_ob, tl.num_programs(0)):
        t = task // n_ob
        offs_o = (task % n_ob) * BO + tl.arange(0, BO)
        omask = offs_o < D
        acc = tl.full([BO], 0.0, tl.float32)
        for k in tl.static_range(KSEL):
            w = tl.load(WT + t * KSEL + k)
            acc += tl.load(Y + (t * KSEL + k) * sy_p + offs_o, mask=omask, other=0.0).to(tl.float32) * w
        tl.store(OUT + t * so_t + offs_o, acc.to(OUT.dtype.element_ty), mask=omask)


def _run(x, ids, weights, w13, s13, w2, s2, limit: float, mx: bool, inter: int) -> torch.Tensor:
    t, d = x.shape
    ksel = ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids, slot = ids.sort(dim=1, stable=True)             # each token's experts ascending: the combine order
    wts = weights.float().gather(1, slot).contiguous()
    ids = ids.to(torch.int32).contiguous()
    p = t * ksel
    h = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(p, d, dtype=x.dtype, device=x.device)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    s13 = w13 if s13 is None else s13                      # unused pointers when not MX
    s2 = w2 if s2 is None else s2
    _expert_up_kernel[grid(p * triton.cdiv(inter, BI), vector=True)](
        x, ids, w13, s13, h, p, ksel, d, inter, float(limit), x.stride(0), w13.stride(0), w13.stride(1),
        s13.stride(0), s13.stride(1), h.stride(0), MX=mx, BI=BI, BK=BKD)
    _expert_down_kernel[grid(p * triton.cdiv(d, BO), vector=True)](
        h, ids, w2, s2, y, p, d, inter, h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        y.stride(0), MX=mx, BO=BO, BK=BKD)
    _combine_kernel[grid(t * triton.cdiv(d, BO), vector=True)](
        y, wts, out, t, d, y.stride(0), out.stride(0), KSEL=ksel, BO=BO)
    return out


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, limit: float) -> torch.Tensor:
    """x [T, D]; ids/weights [T, K]; w13 [E, 2I, D]; w2 [E, D, I] (bf16/fp16/fp32) -> [T, D] in x.dtype."""
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise NotImplementedError("expert weights must be contiguous in their input dim")
    return _run(x, ids, weights, w13, None, w2, None, limit, mx=False, inter=w2.shape[2])


def routed_experts_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                          w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                          fmt: str = "mxfp4") -> torch.Tensor:
    """`routed_experts` on MXFP4 weights: w13 uint8 [E, 2I, D/2] + E8M0 [E, 2I, D/32]; w2 uint8 [E, D, I/2]
    + E8M0 [E, D, I/32]."""
    if fmt != "mxfp4":
        raise ValueError(f"routed_experts_packed: unknown expert format {fmt!r}")
    u8 = [t.view(torch.uint8) for t in (w13, w13_scale, w2, w2_scale)]
    if any(t.stride(-1) != 1 for t in u8):
        raise NotImplementedError("packed expert weights must be contiguous in their input dim")
    return _run(x, ids, weights, u8[0], u8[1], u8[2], u8[3], limit, mx=True, inter=w2.shape[2] * 2)
