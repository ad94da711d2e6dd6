"""Which models and components the plugin provides to vLLM."""

from __future__ import annotations

import os

#: vLLM architecture name -> our target model implementation (lazy "module:Class" strings).
MODELS = {
    "DeepseekV4ForCausalLM": "vllm_deepinfer.models.deepseek:DeepseekV4ForCausalLM",
    "DeepseekV41ForCausalLM": "vllm_deepinfer.models.deepseek:DeepseekV41ForCausalLM",
}
MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
#: Draft architectures vLLM's speculative config gives our targets: `method="mtp"` on a deepseek_v4 target
#: (model_type rewritten to "deepseek_mtp") -> DeepSeekV4MTPModel; `method="dspark"` on deepseek_v41 ->
#: DSparkV41DraftModel (patches/drafters_v1.py lets the V1 runner run it).
DRAFT_MODELS = {
    "DeepSeekV4MTPModel": "vllm_deepinfer.spec_decode.mtp:DeepseekV4MTP",
    "DSparkV41DraftModel": "vllm_deepinfer.spec_decode.dspark:DSparkDrafter",
}

def plugin_disabled() -> bool:
    """DEEPINFER_DISABLE=1 leaves vLLM's own DeepSeek-V4/V4.1 in place."""
    return os.environ.get("DEEPINFER_DISABLE", "0").lower() in ("1", "true", "yes")


def is_deepinfer_model(model_config) -> bool:
    """Whether vLLM will build one of our target classes for this model config."""
    if plugin_disabled() or model_config is None:
        return False
    archs = getattr(model_config, "architectures", None) or getattr(model_config.hf_config, "architectures", [])
    return any(a in MODELS for a in archs or [])
