"""vLLM general plugin: registers DeepInfer's components in every vLLM process.

Idempotent and cheap (no device initialisation): vLLM calls it in the frontend, the registry
inspection subprocess, the engine core and every worker, each a fresh spawned interpreter.
"""

from __future__ import annotations

from vllm_deepinfer.log import get_logger
from vllm_deepinfer.registry import DRAFT_MODELS, MODELS, plugin_disabled

logger = get_logger(__name__)
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    if plugin_disabled():
        logger.info("DeepInfer plugin disabled by DEEPINFER_DISABLE; vLLM's own DeepSeek models stay in place")
        return
    from vllm import ModelRegistry

    from vllm_deepinfer import patches

    patches.apply_all()
    import vllm_deepinfer.models.quant_config  # noqa: F401  (registers deepinfer_fp8)

    for arch, target in {**MODELS, **DRAFT_MODELS}.items():
        ModelRegistry.register_model(arch, target)

    from vllm_deepinfer import serving

    serving.register()
