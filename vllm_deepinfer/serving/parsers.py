"""Tool-call and reasoning parsers served by the plugin (`deepinfer_v41`, `deepinfer_v4`).

DeepSeek-V4.1 writes tool calls in spaced DSML (`<｜DSML｜ calls>` … `<｜DSML｜ invoke name="…">` …
`<｜DSML｜ parameter name="…" string="true|false">…</｜DSML｜ parameter>`), V4 in unspaced DSML
(`<｜DSML｜tool_calls>` …), both after an optional `<think>…</think>` block whose presence follows
the chat template's thinking mode (V4.1 default: thinking on, the prompt ends with `<think>`).

vLLM 0.32's own V4/V4.1 parser engine (`vllm/parser/deepseek_v4.py`, `deepseek_v41.py`) handles
this correctly when the markup arrives as the tokenizer's DSML/think tokens, which is what a real
model emits; we checked it end to end against the served plugin model (tests/test_serving.py):
streamed argument deltas carry only JSON, `reasoning`/`content` split at the `</think>` token,
no markup in content. So the plugin reuses it (subclassing the in-tree adapters) rather than
forking it, and pins the behaviour behind plugin-owned names so that a vLLM change is caught by
our tests rather than by users.

Known limit, kept on purpose (same as vLLM): in a token-id stream the *block* delimiters
(`<｜DSML｜ calls>`, `</think>`) count only as the special tokens; the same characters spelled out
from ordinary tokens are treated as text (quoted markup), so a grammar that forces the spelled-out
form streams that delimiter as content. Force the special token (xgrammar `{"type": "token"}`
element) instead — see `tool_call_structural_tag()` below.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.parser.engine.registered_adapters import (
    DeepSeekV4ParserReasoningAdapter,
    DeepSeekV4ParserToolAdapter,
    DeepSeekV41ParserReasoningAdapter,
    DeepSeekV41ParserToolAdapter,
)

V41_MARKUP = {
    "calls_start": "<｜DSML｜ calls>",
    "calls_end": "</｜DSML｜ calls>",
    "invoke": '<｜DSML｜ invoke name="{name}">',
    "invoke_end": "</｜DSML｜ invoke>",
    "param": '<｜DSML｜ parameter name="{name}" string="{is_str}">',
    "param_end": "</｜DSML｜ parameter>",
}
V4_MARKUP = {
    "calls_start": "<｜DSML｜tool_calls>",
    "calls_end": "</｜DSML｜tool_calls>",
    "invoke": '<｜DSML｜invoke name="{name}">',
    "invoke_end": "</｜DSML｜invoke>",
    "param": '<｜DSML｜parameter name="{name}" string="{is_str}">',
    "param_end": "</｜DSML｜parameter>",
}


class DeepInferV41ToolParser(DeepSeekV41ParserToolAdapter):  # type: ignore[valid-type, misc]
    structural_tag_model = "deepseek_v4_1"


class DeepInferV4ToolParser(DeepSeekV4ParserToolAdapter):  # type: ignore[valid-type, misc]
    structural_tag_model = "deepseek_v4"


class DeepInferV41ReasoningParser(DeepSeekV41ParserReasoningAdapter):  # type: ignore[valid-type, misc]
    pass


class DeepInferV4ReasoningParser(DeepSeekV4ParserReasoningAdapter):  # type: ignore[valid-type, misc]
    pass


def render_tool_calls(calls: list[tuple[str, dict[str, Any]]], v41: bool = True) -> str:
    """The DSML text a DeepSeek model writes for `calls` = [(name, {arg: value})]."""
    mk = V41_MARKUP if v41 else V4_MARKUP
    out = ["\n\n", mk["calls_start"], "\n"]
    for name, args in calls:
        out.append(mk["invoke"].format(name=name) + "\n")
        for key, value in args.items():
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            out.append(mk["param"].format(name=key, is_str="true" if is_str else "false") + text + mk["param_end"] + "\n")
        out.append(mk["invoke_end"] + "\n")
    out.append(mk["calls_end"])
    return "".join(out)


def tool_call_structural_tag(
    calls: list[tuple[str, dict[str, Any]]],
    token_ids: dict[str, int],
    v41: bool = True,
    reasoning: str | None = None,
) -> str:
    """An xgrammar structural tag (vLLM `structured_outputs.structural_tag`) forcing exactly the
    model output `[reasoning</think>]` + DSML `calls`, with the delimiters that are single tokens
    in `token_ids` (`tokenizer.get_added_vocab()`) forced as those tokens, as a real model emits
    them. String argument values may be given as `("regex", pattern)` to let the model choose.
    """
    elements: list[dict[str, Any]] = []

    def text(s: str) -> None:
        if s:
            if elements and elements[-1]["type"] == "const_string":
                elements[-1]["value"] += s
            else:
                elements.append({"type": "const_string", "value": s})

    def tok(s: str) -> None:
        if s in token_ids:
            elements.append({"type": "token", "token": token_ids[s]})
        else:
            text(s)

    if reasoning is not None:
        text(reasoning)
        tok("</think>")
    mk = V41_MARKUP if v41 else V4_MARKUP
    text("\n\n")
    tok(mk["calls_start"])
    text("\n")
    for name, args in calls:
        text(mk["invoke"].format(name=name) + "\n")
        for key, value in args.items():
            if isinstance(value, tuple) and value[0] == "regex":
                text(mk["param"].format(name=key, is_str="true"))
                elements.append({"type": "regex", "pattern": value[1]})
            else:
                is_str = isinstance(value, str)
                val = value if is_str else json.dumps(value, ensure_ascii=False)
                text(mk["param"].format(name=key, is_str="true" if is_str else "false") + val)
            text(mk["param_end"] + "\n")
        text(mk["invoke_end"] + "\n")
    tok(mk["calls_end"])
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}})
