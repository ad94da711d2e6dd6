"""The kernel set of `kernels_nvidia`, with the oracle's names and signatures (ops not listed here
fall back to the torch reference in `vllm_deepinfer.ops`)."""

from kernels_nvidia.attention import sparse_attention, sparse_attention_indexed  # noqa: F401
from kernels_nvidia.compressor import softmax_pool  # noqa: F401
from kernels_nvidia.indexer import indexer_scores, topk_rows  # noqa: F401
from kernels_nvidia.mhc import hc_coefficients, hc_collapse, hc_expand  # noqa: F401

OPS = ("sparse_attention", "sparse_attention_indexed", "softmax_pool", "indexer_scores", "topk_rows",
       "hc_coefficients", "hc_collapse", "hc_expand")
