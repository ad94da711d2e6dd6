"""The kernel set of `kernels_ascend`, with the oracle's names and signatures (ops not listed here fall
back to the torch reference in `vllm_deepinfer.ops`, which on an NPU runs torch_npu's library ops)."""

from kernels_ascend.attention import (  # noqa: F401
    sparse_attention,
    sparse_attention_gathered,
    sparse_attention_indexed,
)
from kernels_ascend.compressor import softmax_pool  # noqa: F401
from kernels_ascend.gemm import linear_fp8_block  # noqa: F401
from kernels_ascend.indexer import indexer_scores, indexer_scores_gathered  # noqa: F401
from kernels_ascend.mhc import hc_coefficients, hc_collapse, hc_expand  # noqa: F401
from kernels_ascend.moe import routed_experts, routed_experts_packed  # noqa: F401

OPS = ("sparse_attention", "sparse_attention_indexed", "sparse_attention_gathered", "softmax_pool",
       "indexer_scores", "indexer_scores_gathered", "hc_coefficients", "hc_collapse", "hc_expand",
       "linear_fp8_block", "routed_experts", "routed_experts_packed")
