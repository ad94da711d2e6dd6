"""Mixture of experts of DeepSeek-V4 / V4.1 (model-spec §3.8).

Router: sqrt(softplus(logits)); selection on score + `gate.bias` (V4.1 image-span tokens use
`gate.bias_vl`), or the fixed `tid2eid` row of the token id on V4 hash layers; weights are the
unbiased scores renormalised to `routed_scaling_factor`. Routed and shared experts use the
clamped SwiGLU. Routed experts are stacked: w13 [E, 2I, D] (w1 rows then w3 rows), w2 [E, D, I], in bf16
or as packed MXFP4 codes + scales (`RoutedExperts`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from vllm_deepinfer import ops
from vllm_deepinfer.checkpoint.formats import MX_BLOCK
from vllm_deepinfer.models.layers import Linear, _param
from vllm_deepinfer.ops import quant

IMAGE_TOKEN_SPAN = 5  # ids [image_token_id, +5) route with bias_vl (vLLM's range, spec §7 Q17)


class Gate(nn.Module):
    def __init__(self, hidden: int, n_experts: int, vocab: int, topk: int, hash_routed: bool, with_bias_vl: bool):
        super().__init__()
        self.weight = _param(n_experts, hidden)
        self.bias = self.bias_vl = None
        self.register_buffer("tid2eid", torch.zeros(vocab, topk, dtype=torch.long) if hash_routed else None,
                             persistent=False)
        if not hash_routed:
            self.bias = _param(n_experts, dtype=torch.float32)
            if with_bias_vl:
                self.bias_vl = _param(n_experts, dtype=torch.float32)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(hidden, inter), Linear(inter, hidden), Linear(hidden, inter)


class RoutedExperts(nn.Module):
    """Stacked routed experts, bf16 (dequantised at load) or, with `packed`, the stored MXFP4 codes:
    w13 uint8 [E, 2I, D/2] + w13_scale E8M0 bytes [E, 2I, D/32], w2 uint8 [E, D, I/2] + w2_scale [E, D, I/32]
    (`ops.routed_experts_packed`). Packed params start as zero codes with scale 1.0 (byte 127), so weights
    that no checkpoint writes (vLLM's dummy load leaves integer params alone) are finite."""

    def __init__(self, n_experts: int, hidden: int, inter: int, packed: bool = False):
        super().__init__()
        self.fmt = "mxfp4" if packed else None
        if not packed:
            self.w13 = _param(n_experts, 2 * inter, hidden)
            self.w2 = _param(n_experts, hidden, inter)
            return
        u8 = functools.partial(torch.full, dtype=torch.uint8)
        self.w13 = nn.Parameter(u8((n_experts, 2 * inter, hidden // 2), 0), requires_grad=False)
        self.w13_scale = nn.Parameter(u8((n_experts, 2 * inter, hidden // MX_BLOCK), 127), requires_grad=False)
        self.w2 = nn.Parameter(u8((n_experts, hidden, inter // 2), 0), requires_grad=False)
        self.w2_scale = nn.Parameter(u8((n_experts, hidden, inter // MX_BLOCK), 127), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
        """x: [T, D]; ids, weights: [T, K] -> [T, D] (weighted sum of the routed experts)."""
        if self.fmt is None:
            return ops.routed_experts(x, ids, weights, self.w13, self.w2, limit)
        return ops.routed_experts_packed(x, ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale, limit,
                                         self.fmt)


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, n_experts: int, topk: int, n_shared: int, vocab: int,
                 hash_routed: bool, route_scale: float, swiglu_limit: float, image_token_id: int = -1,
                 packed_experts: bool = False):
        super().__init__()
        self.topk, self.route_scale, self.limit, self.image_token_id = topk, route_scale, swiglu_limit, image_token_id
        self.gate = Gate(hidden, n_experts, vocab, topk, hash_routed, with_bias_vl=image_token_id >= 0)
        self.experts = RoutedExperts(n_experts, hidden, inter, packed_experts)
        self.shared_experts = SharedExpert(hidden, inter * n_shared) if n_shared else None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D] (normalised FFN input); token_ids: [T] -> [T, D]."""
        logits = x.float() @ self.gate.weight.float().t()
        forced = bias = None
        if self.gate.tid2eid is not None:
            forced = self.gate.tid2eid[token_ids.long()]
        else:
            bias = self.gate.bias
            if self.gate.bias_vl is not None:
                is_image = (token_ids >= self.image_token_id) & (token_ids < self.image_token_id + IMAGE_TOKEN_SPAN)
                bias = torch.where(is_image.unsqueeze(-1), self.gate.bias_vl, self.gate.bias)
        ids, weights = ops.sqrtsoftplus_route(logits, bias, self.topk, self.route_scale, forced)
        y = self.experts(x, ids, weights, self.limit)
        if self.shared_experts is not None:
            s = self.shared_experts
            act = None
            if s.w1.act_block is not None:  # parity: W8A8, both GEMM inputs quantised per 1x128
                act = functools.partial(quant.act_roundtrip, block=s.w1.act_block)
            y = y + ops.swiglu_clamped(x, s.w1.matmul, s.w3.matmul, s.w2.matmul, self.limit, act=act)
        return y
