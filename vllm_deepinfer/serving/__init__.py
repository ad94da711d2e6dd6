"""Serving surface of the plugin (`vllm serve`): parsers, structured output, DeepInfer settings.

`register()` runs in every vLLM process (frontend, engine core, workers) from the general plugin:

* checks the `DEEPINFER_*` settings (`settings.py`): each is honoured, mapped to its vLLM
  equivalent, or rejected with the reason;
* registers the tool-call and reasoning parsers lazily (`parsers.py`) under the names
  `deepinfer_v41` and `deepinfer_v4` (vLLM's own `deepseek_v41` / `deepseek_v4` keep working too);
  registration in the engine core matters: the structured-output manager builds the reasoning
  parser there to gate grammars until `</think>`;
* installs the `so_args` bridge for the OpenAI-compatible server (`patches/so_args_request.py`).

`vllm_deepinfer.serving.SamplingParams` is vLLM's `SamplingParams` plus DeepInfer's
`so_args={...}` (see `sampling.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_deepinfer.serving.sampling import SamplingParams  # noqa: F401

_registered = False

TOOL_PARSERS = {
    "deepinfer_v41": ("vllm_deepinfer.serving.parsers", "DeepInferV41ToolParser"),
    "deepinfer_v4": ("vllm_deepinfer.serving.parsers", "DeepInferV4ToolParser"),
}
REASONING_PARSERS = {
    "deepinfer_v41": ("vllm_deepinfer.serving.parsers", "DeepInferV41ReasoningParser"),
    "deepinfer_v4": ("vllm_deepinfer.serving.parsers", "DeepInferV4ReasoningParser"),
}


def register() -> None:
    """Register serving components (called by the general plugin in every vLLM process)."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_deepinfer.serving import settings

    settings.apply()

    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for name, (module, cls) in TOOL_PARSERS.items():
        if name not in ToolParserManager.list_registered():
            ToolParserManager.register_lazy_module(name, module, cls)
    for name, (module, cls) in REASONING_PARSERS.items():
        if name not in ReasoningParserManager.list_registered():
            ReasoningParserManager.register_lazy_module(name, module, cls)


def __getattr__(name: str):
    if name == "SamplingParams":
        from vllm_deepinfer.serving.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
