"""Packed FP8 block linears on vLLM's bundled Marlin W8A16 GEMM (CUDA, bf16/fp16 activations).

This is the kernel vLLM's in-tree V4.1 runs for its linears on SM90 (`ModelOptLinearMethod` with MXFP8
weights -> `MarlinMxfp8LinearKernel`): E4M3 weights with one E8M0 scale per 1 x 32 group, dequantised in
registers, activations kept in the model dtype, fp32 accumulation. A DeepSeek block scale (one E8M0 byte
per B x B block, B a multiple of 32: 32 for V4.1, 128 for V4) is the MXFP8 scale of every 1 x 32 group in
its block, so the checkpoint converts exactly:

    w[r, c] * 2^(s[r // B, c // B] - 127)  ==  w[r, c] * 2^(mx[r, c // 32] - 127),  mx = `mx_scales(s)`.

vLLM is imported lazily: the module is importable (and `mx_scales` runs) on every platform.
"""

from __future__ import annotations

import torch
from torch import nn

MX_GROUP = 32  # MXFP8 scale group (elements along K)


def mx_scales(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """E8M0 block bytes [ceil(N/BN), ceil(K/BK)] (uint8) -> per-row MXFP8 bytes [N, K/32] (uint8)."""
    bn, bk = block
    if bk % MX_GROUP or k % MX_GROUP:
        raise NotImplementedError(f"MXFP8 needs K ({k}) and the K block ({bk}) to be multiples of {MX_GROUP}")
    rows = scale.repeat_interleave(bn, dim=0)[:n]
    return rows.repeat_interleave(bk // MX_GROUP, dim=1)[:, : k // MX_GROUP].contiguous()


def supported(device: torch.device, dtype: torch.dtype, k: int, block: tuple[int, int]) -> bool:
    """Whether `MarlinFP8` can serve a matrix with K inputs and `block` scales for activations of `dtype`."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if k % MX_GROUP or block[1] % MX_GROUP:
        return False
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import is_fp8_marlin_supported
    return is_fp8_marlin_supported()


def faster_than_triton(n: int, k: int, device: torch.device) -> bool:
    """Whether Marlin beats our Triton FP8 block GEMM (`kernels_nvidia.gemm`) on an [N, K] matrix: not on the
    thin ones, where the Triton kernel splits K (`split_k` > 1: its N tiles fill under half of the SMs, which
    leaves Marlin's grid as idle). H200, V4.1 widths, T = 1 / 16 / 64 rows (2026-12-02,
    benchmarks/results/gpu-1202/bench_linears.log): wq_a|wkv 11.0 / 11.0 / 12.0 us (Triton) vs 12.7 / 13.5 /
    21.7 (Marlin), indexer wq_b 7.3 / 7.3 / 8.4 vs 8.2 / 8.5 / 12.6; on every unsplit matrix Marlin wins
    (wq_b 17.4 vs 28.6 us, wo_b 19.5 vs 48.3, shared w1|w3 15.0 vs 30.6 at T = 1)."""
    import kernels_nvidia

    if not kernels_nvidia.available():
        return True
    from kernels_nvidia.gemm import split_k

    return split_k(n, k, device, fill=1.0) == 1


class MarlinFP8(nn.Module):
    """One FP8 matrix W [N, K] in Marlin's layout; `forward(x)`: x [T, K] -> x W^T [T, N] in x.dtype.
    Build with `from_packed` from the E4M3 codes and E8M0 block bytes."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, n: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # Marlin-repacked int32 codes
        self.scale = nn.Parameter(scale, requires_grad=False)     # Marlin-permuted E8M0 group scales
        self.n, self.k = n, k

    @classmethod
    def from_packed(cls, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    dtype: torch.dtype) -> "MarlinFP8":
        """w: E4M3 [N, K]; scale: E8M0 bytes [ceil(N/BN), ceil(K/BK)]; dtype: the activations' dtype."""
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import (
            prepare_mxfp8_layer_for_marlin,
        )

        n, k = w.shape
        holder = nn.Module()  # the layer interface vLLM's repacking reads and rewrites
        holder.weight = nn.Parameter(w.contiguous(), requires_grad=False)
        holder.weight_scale = nn.Parameter(mx_scales(scale, block, n, k), requires_grad=False)
        holder.input_size_per_partition, holder.output_size_per_partition = k, n
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # vLLM permutes the scales in the default dtype
        try:
            prepare_mxfp8_layer_for_marlin(holder)
        finally:
            torch.set_default_dtype(default)
        return cls(holder.weight.data, holder.weight_scale.data, n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import apply_mxfp8_marlin_linear

        return apply_mxfp8_marlin_linear(x, self.weight, self.scale, None, self.n, self.k)
