"""CUDA graphs for DeepInfer models: full graphs for uniform decode only, never piecewise capture.

Reason: vLLM 0.32 auto-enables breakable CUDA graphs for the DeepSeek-V4/V4.1 architecture names
(`vllm/config/vllm.py` `DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES`, `_maybe_enable_breakable_cudagraph`)
and resolves the default mode to FULL_AND_PIECEWISE. The breakable PIECEWISE wrapper captures the
whole model with dummy one-token-per-request batches and replays that graph for any batch of up to
the largest capture size, including prefill and mixed batches (`vllm/v1/worker/gpu/cudagraph_utils.py`
dispatch; `compilation/breakable_cudagraph.py` splits only at ops marked for it). Our model's
fixed-shape per-token path serves only steps of at most 1 + k tokens per request (decode, or the
verification of up to k drafts); prefill and mixed steps take a per-request path with host
synchronisation, which must run eagerly. FULL_DECODE_ONLY is exactly that: full graphs for uniform
steps of vLLM's `uniform_decode_query_len` (1 + num_speculative_tokens), eager otherwise (no
descriptor for mixed batches). On the V1 runner a verification step whose drafts were trimmed
(varlen) is not uniform; `patches/varlen_graphs.py` sends it to a captured full graph.

Hook: `MODELS_CONFIG_MAP` (`vllm/model_executor/models/config.py`), called by
`VllmConfig.try_verify_and_update_config` before the compilation defaults are filled in. Our entry
keeps the in-tree class's model-config hook (FP8 quant-method rewrite) and sets the mode; a user
mode other than NONE / FULL_DECODE_ONLY is overridden with a warning. Only the architecture names the
plugin serves are touched, and only while the plugin is active (`DEEPINFER_DISABLE=1` leaves them).
"""

from __future__ import annotations

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)


def apply() -> None:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.model_executor.models import config as model_configs

    from vllm_deepinfer.registry import MODELS

    base = model_configs.MODELS_CONFIG_MAP["DeepseekV41ForCausalLM"]
    if getattr(base, "_deepinfer", False):
        return

    class DeepInferModelConfig(base):
        _deepinfer = True

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            super().verify_and_update_config(vllm_config)
            cc = vllm_config.compilation_config
            allowed = (None, CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY)
            if cc.cudagraph_mode not in allowed:
                logger.warning("DeepInfer models capture CUDA graphs for uniform decode only: cudagraph_mode %s "
                               "-> FULL_DECODE_ONLY (prefill and mixed steps run eagerly)", cc.cudagraph_mode)
            if cc.cudagraph_mode not in (CUDAGraphMode.NONE,):
                cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY

    for arch in MODELS:
        model_configs.MODELS_CONFIG_MAP[arch] = DeepInferModelConfig
