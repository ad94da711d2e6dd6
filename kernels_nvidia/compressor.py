"""Compressor pooling (model-spec §3.5): per-dimension softmax over the slots of a group, fused.

`softmax_pool(values, logits)` reads values and logits once and writes the pooled row: one program per
(group, BC-wide column block), slots in registers, fixed order (batch-invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_pool_kernel(V, L, OUT, S, C, sv_g, sv_s, sl_g, sl_s, so_g,
                         SP: tl.constexpr, BC: tl.constexpr):
    g = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_s = tl.arange(0, SP)
    m = (offs_s[:, None] < S) & (offs_c[None, :] < C)
    lg = tl.load(L + g * sl_g + offs_s[:, None] * sl_s + offs_c[None, :], mask=m, other=float("-inf")).to(tl.float32)
    v = tl.load(V + g * sv_g + offs_s[:, None] * sv_s + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    e = tl.exp(lg - tl.max(lg, 0)[None, :])
    pooled = tl.sum(e * v, 0) / tl.sum(e, 0)
    tl.store(OUT + g * so_g + offs_c, pooled, mask=offs_c < C)


def softmax_pool(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """values/logits: [G, S, c] -> [G, c] fp32."""
    g, s, c = values.shape
    if values.stride(-1) != 1:
        values = values.contiguous()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(g, c, dtype=torch.float32, device=values.device)
    if g == 0:
        return out
    sp = max(2, triton.next_power_of_2(s))
    bc = max(16, min(256, 4096 // sp))
    _softmax_pool_kernel[(g, triton.cdiv(c, bc))](
        values, logits, out, s, c, values.stride(0), values.stride(1), logits.stride(0), logits.stride(1),
        out.stride(0), SP=sp, BC=bc, num_warps=4)
    return out
