"""Serving surface of the plugin (`vllm serve`): parsers, structured output, DeepInfer settings."""


def register() -> None:
    """Register serving components (called by the general plugin in every vLLM process)."""
