"""The kernel set of `kernels_nvidia`, with the oracle's names and signatures (ops not listed here
fall back to the torch reference in `vllm_deepinfer.ops`)."""

from kernels_nvidia.attention import (  # noqa: F401
    sparse_attention,
    sparse_attention_gathered,
    sparse_attention_indexed,
    sparse_attention_paged,
    sparse_attention_records,
)
from kernels_nvidia.compressor import softmax_pool  # noqa: F401
from kernels_nvidia.engram import engram_hash, engram_inject, fp8_rows  # noqa: F401
from kernels_nvidia.kv_records import kv_record_gather, kv_record_store  # noqa: F401
from kernels_nvidia.gemm import linear_fp32_out, linear_fp8_block  # noqa: F401
from kernels_nvidia.indexer import (  # noqa: F401
    indexer_scores,
    indexer_scores_paged,
    indexer_scores_ragged,
    topk_rows_packed,
)
from kernels_nvidia.mhc import hc_coefficients, hc_collapse, hc_expand  # noqa: F401
from kernels_nvidia.moe import routed_experts_packed  # noqa: F401
from kernels_nvidia.paging import range_slots, row_slots  # noqa: F401
from kernels_nvidia.router import sqrtsoftplus_route  # noqa: F401
from kernels_nvidia.rowwise import apply_rope, apply_rope_, rms_norm, rope_cos_sin, swiglu  # noqa: F401
from kernels_nvidia.topk import topk_rows  # noqa: F401

# topk_rows: the Triton radix select of `kernels_nvidia.topk` (bitwise the oracle's stable sort; reads a row
# over [0, n_valid) only). `indexer.topk_rows_packed` (packed-key torch.topk, 0.4-0.5x the stable sort on the
# H200) is not dispatched; it stays for the benchmark.
OPS = ("sparse_attention", "sparse_attention_indexed", "sparse_attention_paged", "sparse_attention_records",
       "kv_record_store", "kv_record_gather", "softmax_pool", "indexer_scores",
       "indexer_scores_paged", "indexer_scores_ragged",
       "hc_coefficients", "hc_collapse", "hc_expand", "linear_fp32_out", "linear_fp8_block",
       "routed_experts_packed", "rms_norm", "rope_cos_sin", "apply_rope", "apply_rope_", "row_slots", "range_slots",
       "topk_rows", "sqrtsoftplus_route", "fp8_rows", "engram_hash", "engram_inject")
