"""Reject chat requests with no messages (HTTP 400) instead of generating from an empty prompt.

Reason: vLLM 0.32 accepts `"messages": []` on /v1/chat/completions (and /v1/messages, which is
converted to a chat request): the DeepSeek V4/V4.1 encoder renders it as a bare BOS, so the server
answers 200 with text continued from nothing — a client bug turned into a silent success. OpenAI
and Anthropic both reject it. The narrowest point is `OpenAIServingChat.render_chat_request`
(`vllm/entrypoints/openai/chat_completion/serving.py:258`), which already returns an
`ErrorResponse` for other request errors; the wrapper returns one for an empty list.
"""

from __future__ import annotations

import functools

_PATCHED = "_deepinfer_empty_messages"


def apply() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    original = OpenAIServingChat.render_chat_request
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    async def render_chat_request(self, request):
        if not request.messages:
            return self.create_error_response(
                "messages must contain at least one message", param="messages"
            )
        return await original(self, request)

    setattr(render_chat_request, _PATCHED, True)
    OpenAIServingChat.render_chat_request = render_chat_request
