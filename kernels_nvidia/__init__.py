"""NVIDIA (Hopper, SM100) kernels for vllm-deepinfer; a leaf package: imports torch/triton only."""
