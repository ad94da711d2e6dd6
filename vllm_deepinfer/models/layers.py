"""Parameter holders of the torch path: dense linear and RMSNorm.

Checkpoint weights are dequantised once at load time (FP8 block / MXFP4 -> model dtype); the
quantised GPU kernels of `kernels_nvidia` replace these holders on that path.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_deepinfer import ops


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T with W: [out_features, in_features] (no bias in this model)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.weight.dtype) @ self.weight.t()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class HyperConnection(nn.Module):
    """mHC parameters of one sublayer (`hc_{attn,ffn}_{fn,base,scale}`, all fp32)."""

    def __init__(self, hc_mult: int, hidden: int, mix_width: int, rms_eps: float, hc_eps: float, iters: int):
        super().__init__()
        self.fn = _param(mix_width, hc_mult * hidden, dtype=torch.float32)
        self.base = _param(mix_width, dtype=torch.float32)
        self.scale = _param(3, dtype=torch.float32)
        self.rms_eps, self.hc_eps, self.iters = rms_eps, hc_eps, iters

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, h, D] -> pre [T, h], post [T, h], comb [T, h, h]."""
        return ops.hc_coefficients(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps, self.iters)
