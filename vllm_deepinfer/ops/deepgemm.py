"""mHC coefficient GEMM on DeepGEMM's tf32 prenorm GEMM, as vLLM's CUDA build ships it (`vllm.utils.deep_gemm`).

`ops.hc_coefficients` reduces the h*D-wide streams against fn ((2+h)h rows) and sums their squares; DeepGEMM's
`tf32_hc_prenorm_gemm` computes exactly those split-K partials (out [S, T, (2+h)h], sqrsum [S, T]), and
`kernels_nvidia.mhc.hc_coefficients_from_partials` finishes them (split sums in order, RMS scale, sigmoids,
Sinkhorn). vLLM's in-tree V4.1 runs it (2026-12-03 H200 profile, 4 x 1024 prefill: 0.5 ms for 8 layers against
3.9 ms for our split-K Triton partials).

Off by default until measured end to end on the H200 (`VLLM_DEEPINFER_DEEPGEMM_HC=1`); not in batch-invariant
mode (the split count follows the token count). bf16 streams on CUDA only; a failing call falls back to the
Triton kernels (`ops.library.LibraryKernel`).
"""

from __future__ import annotations

import torch

from vllm_deepinfer.ops.library import LibraryKernel

BLOCK_K = 64  # K block of the DeepGEMM kernel (split-count heuristic below, as vLLM sizes it)


def _load():
    from vllm.utils.deep_gemm import is_deep_gemm_supported, tf32_hc_prenorm_gemm

    return tf32_hc_prenorm_gemm if is_deep_gemm_supported() else None


KERNEL = LibraryKernel("DeepGEMM tf32 prenorm GEMM", "VLLM_DEEPINFER_DEEPGEMM_HC", _load)


def takes(streams: torch.Tensor) -> bool:
    return not KERNEL.off and streams.is_cuda and streams.dtype == torch.bfloat16 and streams.shape[0] > 0


def num_splits(t: int, k: int, device: torch.device) -> int:
    """Split-K count: fill the SMs with ceil(T / 64) token blocks, at most a quarter of the K blocks per split,
    then bounded to 1, 4 or 16 as vLLM 0.32 bounds it for this kernel (`compute_mhc_pre_num_splits`, not imported:
    its module needs tilelang), so DeepGEMM's JIT and our finalize kernel (split count constexpr) build three
    variants instead of one per token count."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    s = max(1, min(sms // -(-t // 64), -(-k // BLOCK_K) // 4))
    return 1 if s == 1 else 4 if s <= 4 else 16


def hc_coefficients(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters):
    """`ops.hc_coefficients` (same signature) with DeepGEMM's partials, or None (not served)."""
    if KERNEL.get() is None:
        return None
    t, h, d = streams.shape
    k, m = h * d, fn.shape[0]
    s = num_splits(t, k, streams.device)
    part = torch.empty(s, t, m, dtype=torch.float32, device=streams.device)
    sq = torch.empty(s, t, dtype=torch.float32, device=streams.device)
    KERNEL.run(streams.reshape(t, k).contiguous(), fn.float().contiguous(), part, sq, s)  # fills part, sq
    if KERNEL.off:  # the call failed
        return None
    from kernels_nvidia.mhc import hc_coefficients_from_partials

    return hc_coefficients_from_partials(part, sq, base, scale, k, rms_eps, hc_eps, sinkhorn_iters, h)
