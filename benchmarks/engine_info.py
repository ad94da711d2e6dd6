"""What a running vLLM engine serves: shared by the device benchmark scripts."""

from __future__ import annotations


def describe(llm) -> dict[str, str | None]:
    """The resolved architecture and the class that serves it (the plugin's or vLLM's in-tree one)."""
    mc = llm.llm_engine.model_config
    info: dict[str, str | None] = {"architecture": getattr(mc, "architecture", None)}
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        info["model_class"] = str(ModelRegistry._try_load_model_cls(mc.architecture))
    except Exception as e:  # noqa: BLE001 - informational only
        info["model_class"] = f"? {e!r}"
    return info
