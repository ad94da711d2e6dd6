"""The kernel interface of the model.

The model calls every op through this module. Backends: `reference` (torch; CPU and any device;
the oracle), `kernels_nvidia` and `kernels_ascend`. An op a device backend does not provide falls
back to the reference implementation, so a backend can grow one kernel at a time.
"""

from vllm_deepinfer.ops.reference import (  # noqa: F401
    apply_rope,
    grouped_output,
    hc_coefficients,
    hc_collapse,
    hc_expand,
    hc_head_weights,
    indexer_scores,
    rms_norm,
    rope_cos_sin,
    routed_experts,
    softmax_pool,
    sparse_attention,
    sqrtsoftplus_route,
    swiglu_clamped,
    topk_rows,
)
