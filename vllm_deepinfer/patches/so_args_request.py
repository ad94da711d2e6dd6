"""Accept DeepInfer's `so_args` in OpenAI-compatible requests (`vllm serve`).

Reason: DeepInfer clients send structured-output arguments as `so_args={...}`; vLLM 0.32's request
models allow extra fields (`OpenAIBaseModel`, `extra="allow"`) but silently *ignore* them, so an
`so_args` request would run unconstrained. There is no hook between request parsing and
`to_sampling_params`; the narrowest point is each request class's `extract_structured_outputs()`
(`vllm/entrypoints/openai/chat_completion/protocol.py:708`, `completion/protocol.py:336`,
`responses/protocol.py:476`), which builds the `StructuredOutputsParams` handed to the engine. The
wrapper maps `so_args` there (`vllm_deepinfer/serving/so_args.py`) and turns a bad `so_args` (unknown
key, several constraints, mixed with `structured_outputs`/`response_format`) into a
`VLLMValidationError`, i.e. an HTTP 400 naming the parameter. Requests without `so_args` are untouched.
"""

from __future__ import annotations

import functools

_PATCHED = "_deepinfer_so_args"


def _wrap(cls) -> None:
    original = cls.extract_structured_outputs
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def extract_structured_outputs(self):
        extra = getattr(self, "model_extra", None) or {}
        if "so_args" not in extra or extra["so_args"] is None:
            return original(self)
        from vllm.exceptions import VLLMValidationError

        from vllm_deepinfer.serving.so_args import to_structured_outputs

        fmt = getattr(self, "response_format", None)
        fmt_type = getattr(fmt, "type", None) if fmt is not None else None
        if getattr(self, "structured_outputs", None) is not None or fmt_type not in (None, "text"):
            raise VLLMValidationError(
                "give structured output either as so_args or as structured_outputs/response_format, not both",
                parameter="so_args",
            )
        try:
            return to_structured_outputs(extra["so_args"])
        except ValueError as exc:
            raise VLLMValidationError(f"invalid so_args: {exc}", parameter="so_args") from exc

    setattr(extract_structured_outputs, _PATCHED, True)
    cls.extract_structured_outputs = extract_structured_outputs


def apply() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    _wrap(ChatCompletionRequest)
    _wrap(CompletionRequest)
