"""Parameter holders of the torch path: dense linear and RMSNorm.

Checkpoint weights are dequantised once at load time (FP8 block / MXFP4 -> model dtype), except the
FP8 block linears when packed storage is selected (`DEEPINFER_FP8_LINEARS=packed`, `pack_fp8_linears`):
those keep the checkpoint's E4M3 codes and E8M0 scale bytes and multiply through `ops.linear_fp8_block`.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_deepinfer import ops
from vllm_deepinfer.ops import quant

#: Linears whose activations vLLM's in-tree V4 path quantises to FP8 (DeepGEMM W8A8, 1x128 UE8M0),
#: by module-name suffix. The grouped `wo_a` does not go through `Linear.forward` (its call site applies
#: `quant.act_roundtrip` itself); `wo_b` and the shared expert's `w1/w3/w2` are called as Linears by their
#: call sites when `act_block` is set (the fused reference ops take raw weights and would skip the quantiser).
V4_FP8_ACT_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "indexer.wq_b",
                      "shared_experts.w1", "shared_experts.w2", "shared_experts.w3", "e_proj", "h_proj")


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T with W: [out_features, in_features] (no bias in this model).

    Storage: `weight` in the model dtype, or after `pack_fp8(B)` the E4M3 codes `weight` [N, K] and the
    E8M0 scale bytes `scale` (uint8) [ceil(N/B), ceil(K/B)] of model-spec §4.2."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.scale: nn.Parameter | None = None
        self.block: tuple[int, int] | None = None
        self._packed_dtype: torch.dtype | None = None
        # Parity numerics: FP8 activation quantisation block (None = off, the default).
        self.act_block: int | None = None

    def pack_fp8(self, block: int) -> None:
        """Switch to FP8 block storage (filled by the loader). The scales start at byte 127 (1.0): vLLM's
        dummy weights leave non-float parameters untouched, and byte 0xFF would be NaN."""
        n, k = self.weight.shape
        dev, self._packed_dtype = self.weight.device, self.weight.dtype
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False)
        self.scale = nn.Parameter(torch.full((-(-n // block), -(-k // block)), 127, dtype=torch.uint8, device=dev),
                                  requires_grad=False)
        self.block = (block, block)

    @property
    def act_dtype(self) -> torch.dtype:
        """Dtype of the inputs and outputs (the model dtype)."""
        return self.weight.dtype if self.scale is None else self._packed_dtype

    def matmul(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """x [T, G*K] -> x W^T [T, N] without activation quantisation; groups = G > 1: the block-diagonal
        product of `ops.linear` (x group g times rows g*N/G.. of W)."""
        if self.scale is not None:
            return ops.linear_fp8_block(x, self.weight, self.scale, self.block, groups)
        return ops.linear(x, self.weight, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.act_dtype)
        if self.act_block is not None:
            x = quant.act_roundtrip(x, self.act_block)
        return self.matmul(x)


def pack_fp8_linears(model: nn.Module, fp8_weights: set[str], block: int) -> list[str]:
    """Packed FP8 storage for every Linear of `model` whose `<name>.weight` is in `fp8_weights` (the
    checkpoint's block-FP8 tensors, named relative to `model`). Returns the names packed."""
    done = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and f"{name}.weight" in fp8_weights:
            module.pack_fp8(block)
            done.append(name)
    return done


def enable_activation_quant(model: nn.Module, names: tuple[str, ...] = V4_FP8_ACT_LINEARS,
                            block: int = 128) -> list[str]:
    """Parity numerics (V4 only): quantise the inputs of the FP8 block linears like DeepGEMM W8A8.
    Returns the qualified names of the linears switched on."""
    done = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.endswith(names):
            module.act_block = block
            done.append(name)
    return done


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
        self.tf32 = quant.enabled("tf32")  # parity: vLLM's mHC pre-norm GEMM runs in TF32

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, h, D] -> pre [T, h], post [T, h], comb [T, h, h]."""
        fn = quant.tf32_truncate(self.fn) if self.tf32 else self.fn
        return ops.hc_coefficients(streams, fn, self.base, self.scale, self.rms_eps, self.hc_eps, self.iters)
