"""Rotary tables of the two RoPE variants (model-spec §3.3): main (m = 0 layers) and compress (m > 0)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_deepinfer import ops
from vllm_deepinfer.config import ArchConfig


class RotaryTable(nn.Module):
    """Per-pair frequencies of one table; `cos_sin(positions)` gives fp32 [N, r/2] pairs."""

    def __init__(self, arch: ArchConfig, compressed: bool):
        super().__init__()
        freqs = arch.yarn_inv_freq() if compressed else arch.main_inv_freq()
        self.register_buffer("inv_freq", torch.tensor(freqs, dtype=torch.float64), persistent=False)

    def cos_sin(self, positions: torch.Tensor, scale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int (times `scale`, e.g. compressed group ids times the ratio) -> cos, sin [N, r/2]."""
        return ops.rope_cos_sin(positions, self.inv_freq, scale)
