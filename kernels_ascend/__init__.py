"""Ascend 950 kernels and platform entry for vllm-deepinfer (import-safe without CANN/torch_npu)."""
