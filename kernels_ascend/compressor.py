"""Compressor pooling (model-spec §3.6): per-dimension softmax over the S slots of a group, one Triton kernel.

A task is one group x BC channels: the [S, BC] logits and values in fp32, max-subtracted softmax over S
and the weighted sum, on the vector unit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend.common import grid, pow2

BC = 64


@triton.jit
def _softmax_pool_kernel(V, L, OUT, G, S, C, sv_g, sv_s, sl_g, sl_s, so_g,
                         SP: tl.constexpr, BC: tl.constexpr):
    n_cb = (C + BC - 1) // BC
    offs_s = tl.arange(0, SP)
    smask = offs_s < S
    for task in range(tl.program_id(0), G * n_cb, tl.num_programs(0)):
        g = task // n_cb
        offs_c = (task % n_cb) * BC + tl.arange(0, BC)
        m = smask[:, None] & (offs_c < C)[None, :]
        lg = tl.load(L + g * sl_g + offs_s[:, None] * sl_s + offs_c[None, :], mask=m, other=-1.0e30)
        v = tl.load(V + g * sv_g + offs_s[:, None] * sv_s + offs_c[None, :], mask=m, other=0.0)
        p = tl.where(m, tl.exp(lg - tl.max(lg, 0)[None, :]), 0.0)
        out = tl.sum(p * v, 0) / tl.maximum(tl.sum(p, 0), 1.0e-30)   # padded columns: 0 / 1e-30
        tl.store(OUT + g * so_g + offs_c, out, mask=offs_c < C)


def softmax_pool(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """values/logits [G, S, c] fp32 -> [G, c] fp32."""
    g, s, c = values.shape
    if values.dtype != torch.float32 or logits.dtype != torch.float32 or s > 512:
        raise NotImplementedError("softmax_pool takes fp32 values/logits with at most 512 slots")
    if values.stride(-1) != 1 or logits.stride(-1) != 1:
        values, logits = values.contiguous(), logits.contiguous()
    out = torch.empty(g, c, dtype=torch.float32, device=values.device)
    _softmax_pool_kernel[grid(g * triton.cdiv(c, BC), vector=True)](
        values, logits, out, g, s, c, values.stride(0), values.stride(1), logits.stride(0), logits.stride(1),
        out.stride(0), SP=pow2(s), BC=BC)
    return out
