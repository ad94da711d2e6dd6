"""Deterministic synthetic DeepSeek-style tokenizer (model-spec §5.5, §8.4 "synthetic" mode).

A byte-level BPE trained offline with the `tokenizers` library on the embedded English corpus of
`_corpus.py`, plus the DeepSeek special tokens. The vocabulary is the same for V4 and V4.1 (it carries the
DSML markers of both dialects); only `tokenizer_config.json` (its Jinja `chat_template`) differs per family.

Layout (``vocab_total = 8192`` by default):

* id 0 ``<｜begin▁of▁sentence｜>`` (BOS), id 1 ``<｜end▁of▁sentence｜>`` (EOS), id 2 ``<｜▁pad▁｜>`` (pad, the
  ``engram_pad_token_id``), then the 256 byte-level symbols and the BPE merges;
* then (if the corpus yields fewer merges than needed) reserved ``<｜place▁holder▁no▁k｜>`` tokens;
* then the added tokens of `ADDED_TOKENS`, ending with ``<｜deepseek_image｜>`` (image placeholder) and
  ``<｜dspark▁noise｜>`` (the DSpark noise / filler token). ``len(tokenizer) == vocab_total`` exactly.

Public API::

    build_tokenizer(vocab_total=8192) -> tokenizers.Tokenizer          # cached, deterministic
    write_tokenizer(out_dir, family, vocab_total=8192) -> TokenizerInfo  # tokenizer.json + tokenizer_config.json
    chat_template(family) -> str                                          # the Jinja template
    TokenizerInfo(vocab_size, bos_token_id, eos_token_id, pad_token_id, image_token_id, noise_token_id, special_ids)

`family` is ``"v4"`` or ``"v41"`` (also accepted: ``"v4-flash"``, ``"v4.1-flash"``, ``"deepseek_v4"``, ``"deepseek_v41"``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

__all__ = [
    "BOS", "EOS", "PAD", "IMAGE", "NOISE", "ADDED_TOKENS", "TokenizerInfo",
    "build_tokenizer", "write_tokenizer", "chat_template", "normalize_family",
]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
IMAGE = "<｜deepseek_image｜>"
NOISE = "<｜dspark▁noise｜>"
USER, ASSISTANT, SYSTEM, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
TASKS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
         "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>"}
DSML = "｜DSML｜"

#: (content, special). Non-special added tokens stay single tokens but survive
#: ``skip_special_tokens=True`` decoding, which the reasoning / tool parsers need.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (USER, True), (ASSISTANT, True), (SYSTEM, True), (REMINDER, True),
    (THINK, False), (END_THINK, False),
    *((t, True) for t in TASKS.values()),
    # DSML tool-call markers: V4 `<｜DSML｜tool_calls>` blocks, V4.1 `<｜DSML｜ calls>` blocks, and the bare marker.
    (f"<{DSML}tool_calls>", False), (f"</{DSML}tool_calls>", False),
    (f"<{DSML} calls>", False), (f"</{DSML} calls>", False),
    (DSML, False),
    (IMAGE, True),
    (NOISE, True),
)

_TOKENIZER_VERSION = "deepinfer-synthetic-bpe-1"


def normalize_family(family: str) -> str:
    f = family.lower().replace("deepseek_", "").replace("deepseek-", "").replace("-flash", "").replace(".", "")
    if f in ("v4", "v41"):
        return f
    raise ValueError(f"unknown model family {family!r}; expected v4 or v4.1")


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int          # len(tokenizer), including added tokens
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    image_token_id: int
    noise_token_id: int
    special_ids: dict        # content -> id for every added / special token


@functools.lru_cache(maxsize=4)
def _build_json(vocab_total: int) -> str:
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    from ._corpus import corpus_lines

    n_added = len(ADDED_TOKENS)
    target = vocab_total - n_added
    if target < 3 + 256 + 64:
        raise ValueError(f"vocab_total={vocab_total} is too small")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target, min_frequency=1, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_lines() + _format_lines() * 20, trainer)
    base = tok.get_vocab_size(with_added_tokens=True)
    if base > target:
        raise RuntimeError(f"BPE trainer produced {base} tokens, more than the {target} requested")
    # Reserved placeholders fill any shortfall so that the added tokens always sit at the top of the vocabulary.
    fill = [AddedToken(f"<｜place▁holder▁no▁{k}｜>", special=True, normalized=False) for k in range(target - base)]
    if fill:
        tok.add_special_tokens(fill)
    for content, special in ADDED_TOKENS:
        at = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([at])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_total, tok.get_vocab_size(with_added_tokens=True)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1 and tok.token_to_id(PAD) == 2
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 0)])
    return tok.to_str(pretty=False)


def _format_lines() -> list[str]:
    """Fixed prompt texts of the chat formats (reasoning-effort prefixes, tool instructions), so that they tokenise
    compactly."""
    tools = [_TOOLS_TEXT.replace("@B", DSML + b).replace("@I", DSML + i).replace("@P", DSML + p) + _TOOLS_TAIL
             for b, i, p in (("tool_calls", "invoke", "parameter"), (" calls", " invoke", " parameter"))]
    v41_effort = [f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)"
                  for n in (50, 75, 100)]
    return list(_V4_EFFORT_TEXT.values()) + tools + v41_effort


def build_tokenizer(vocab_total: int = 8192):
    """The synthetic `tokenizers.Tokenizer` (fresh object; training is cached per process)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_build_json(vocab_total))


def _info(tok) -> TokenizerInfo:
    ids = {BOS: 0, EOS: 1, PAD: 2}
    for content, _ in ADDED_TOKENS:
        ids[content] = tok.token_to_id(content)
    return TokenizerInfo(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), bos_token_id=0, eos_token_id=1, pad_token_id=2,
        image_token_id=ids[IMAGE], noise_token_id=ids[NOISE], special_ids=ids)


def write_tokenizer(out_dir: str | os.PathLike, family: str, vocab_total: int = 8192) -> TokenizerInfo:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the family's chat template) to `out_dir`."""
    fam = normalize_family(family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = _build_json(vocab_total)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    info = _info(tok)
    added_decoder = {}
    for tid in range(info.vocab_size):
        content = tok.id_to_token(tid)
        if content in info.special_ids or content.startswith("<｜place▁holder▁no▁"):
            special = dict(ADDED_TOKENS).get(content, True)
            added_decoder[str(tid)] = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": special}
    cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_decoder,
        "chat_template": chat_template(fam),
        "deepinfer_tokenizer": _TOKENIZER_VERSION,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return info


# ============================================================================== chat templates
_V4_EFFORT_TEXT = {
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
        "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
        "scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
        "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"),
    "max": (
        "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
        "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
        "resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
        "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"),
}

_TOOLS_TEXT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<@B>" block like the following:

<@B>
<@I name="$TOOL_NAME">
<@P name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</@P>
...
</@I>
<@I name="$TOOL_NAME2">
...
</@I>
</@B>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def _lit(s: str) -> str:
    """A Jinja string literal for `s`."""
    return json.dumps(s, ensure_ascii=False)


def chat_template(family: str) -> str:
    """Jinja chat template rendering the V4 / V4.1 prompt format for non-vLLM consumers.

    It mirrors vLLM 0.32's `deepseek_v4` / `deepseek_v41` encoders for system / developer / user / assistant /
    tool / latest_reminder messages, text and image content parts, tools (attached to the first system
    message), assistant tool calls with dict arguments, reasoning, and the thinking switches
    (``thinking`` / ``enable_thinking``, default on; ``reasoning_effort``; ``drop_thinking``, default on).
    Like vLLM, the assistant header is always appended after a trailing user turn (``add_generation_prompt``
    is implied). Not reproduced: reordering of several tool results by call id, JSON-string tool arguments
    (rendered as one ``arguments`` string parameter) and internal task tokens.
    """
    fam = normalize_family(family)
    v41 = fam == "v41"
    blk, inv, par = (" calls", " invoke", " parameter") if v41 else ("tool_calls", "invoke", "parameter")
    tools_text = (_TOOLS_TEXT.replace("@B", DSML + blk).replace("@I", DSML + inv).replace("@P", DSML + par))
    L = _lit
    t = []
    a = t.append
    # ---------------------------------------------------------------- switches
    a("{%- if thinking is defined or enable_thinking is defined -%}"
      "{%- set think = (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) -%}"
      "{%- else -%}{%- set think = true -%}{%- endif -%}")
    a("{%- set effort = reasoning_effort if reasoning_effort is defined else none -%}")
    if v41:
        a("{%- if effort == 'none' -%}{%- set think = false -%}{%- set effort = none -%}{%- endif -%}")
        a("{%- if effort is none -%}{%- set effort = 'high' -%}{%- endif -%}")
        a("{%- set effort_map = {'low': 50, 'high': 75, 'xhigh': 75, 'max': 100} -%}")
        a("{%- if effort is string -%}{%- set effort = effort_map[effort] -%}{%- endif -%}")
        a("{%- set effort_text = 'Reasoning Effort: ' ~ effort ~ "
          + L(" (range 1-100, the higher the value, the more thorough the reasoning)\n\n") + " -%}")
    else:
        a("{%- if effort is not string -%}{%- set effort = 'high' if think else 'low' -%}"
          "{%- elif effort == 'none' -%}{%- set think = false -%}{%- set effort = 'low' -%}"
          "{%- elif effort == 'max' -%}{%- set effort = 'max' -%}"
          "{%- elif effort in ['low', 'minimal', 'medium'] -%}{%- set effort = 'low' -%}"
          "{%- else -%}{%- set effort = 'high' -%}{%- endif -%}")
        a("{%- set effort_texts = {'low': '', 'high': " + L(_V4_EFFORT_TEXT["high"]) + ", 'max': "
          + L(_V4_EFFORT_TEXT["max"]) + "} -%}")
        a("{%- set effort_text = effort_texts[effort] -%}")
    a("{%- set drop = drop_thinking if drop_thinking is defined else true -%}")
    # ---------------------------------------------------------------- pass 1: normalise, attach tools, merge
    a("{%- set ns = namespace(msgs=[], sys_done=false, has_tools=false) -%}")
    a("{%- set src = messages -%}")
    a("{%- if tools is defined and tools -%}"
      "{%- set ns.has_tools = true -%}"
      "{%- if (messages | selectattr('role', 'equalto', 'system') | list | length) == 0 -%}"
      "{%- set src = [{'role': 'system', 'content': ''}] + messages -%}{%- endif -%}{%- endif -%}")
    a("{%- for m in src -%}")
    a("{%- if m.content is string -%}{%- set text = m.content -%}"
      "{%- elif m.content is none or m.content is not defined -%}{%- set text = none -%}"
      "{%- else -%}{%- set pns = namespace(parts=[]) -%}{%- for p in m.content -%}"
      "{%- if p.type in ['image', 'image_url', 'input_image', 'image_pil'] -%}{%- set pns.parts = pns.parts + ["
      + L(IMAGE) + "] -%}"
      "{%- else -%}{%- set pns.parts = pns.parts + [p.text if p.text is defined else ''] -%}{%- endif -%}"
      "{%- endfor -%}{%- set text = pns.parts | join('\\n\\n') -%}{%- endif -%}")
    a("{%- set mtools = none -%}")
    a("{%- if m.role == 'system' and ns.has_tools and not ns.sys_done -%}{%- set mtools = tools -%}"
      "{%- set ns.sys_done = true -%}{%- elif m.tools is defined and m.tools -%}{%- set mtools = m.tools -%}{%- endif -%}")
    a("{%- set last = ns.msgs[-1] if ns.msgs else none -%}")
    a("{%- if m.role == 'tool' -%}"
      "{%- set blk = {'type': 'tool_result', 'text': text if text is not none else ''} -%}"
      "{%- if last is not none and last.role == 'user' -%}"
      "{%- set ns.msgs = ns.msgs[:-1] + [{'role': 'user', 'blocks': last.blocks + [blk], 'task': last.task}] -%}"
      "{%- else -%}{%- set ns.msgs = ns.msgs + [{'role': 'user', 'blocks': [blk], 'task': none}] -%}{%- endif -%}"
      "{%- elif m.role == 'user' -%}"
      "{%- set blk = {'type': 'text', 'text': text if text is not none else ''} -%}"
      "{%- if last is not none and last.role == 'user' and last.task is none -%}"
      "{%- set ns.msgs = ns.msgs[:-1] + [{'role': 'user', 'blocks': last.blocks + [blk], 'task': none}] -%}"
      "{%- else -%}{%- set ns.msgs = ns.msgs + [{'role': 'user', 'blocks': [blk], "
      "'task': m.task if m.task is defined else none}] -%}{%- endif -%}"
      "{%- else -%}")
    if v41:
        a("{%- set rc = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none "
          "else (m.reasoning if m.reasoning is defined else none) -%}")
    else:
        a("{%- set rc = m.reasoning if m.reasoning is defined and m.reasoning is not none "
          "else (m.reasoning_content if m.reasoning_content is defined else none) -%}")
    a("{%- set ns.msgs = ns.msgs + [{'role': m.role, 'content': text, 'tools': mtools, "
      "'response_format': m.response_format if m.response_format is defined else none, "
      "'tool_calls': m.tool_calls if m.tool_calls is defined else none, 'reasoning': rc, "
      "'task': m.task if m.task is defined else none}] -%}")
    a("{%- endif -%}{%- endfor -%}")
    a("{%- if ns.has_tools or (ns.msgs | selectattr('tools') | list | length) > 0 -%}{%- set drop = false -%}{%- endif -%}")
    # ---------------------------------------------------------------- pass 2: drop earlier thinking
    if v41:
        is_user = "(mm.role in ['user', 'developer'] or (mm.role == 'system' and loop.index0 > 0))"
    else:
        is_user = "mm.role in ['user', 'developer']"
    a("{%- set lu = namespace(i=-1) -%}{%- for mm in ns.msgs -%}{%- if " + is_user
      + " -%}{%- set lu.i = loop.index0 -%}{%- endif -%}{%- endfor -%}")
    a("{%- if think and drop -%}{%- set dn = namespace(msgs=[]) -%}{%- for mm in ns.msgs -%}"
      "{%- if mm.role in ['user', 'system', 'tool', 'latest_reminder'] or loop.index0 >= lu.i -%}"
      "{%- set dn.msgs = dn.msgs + [mm] -%}"
      "{%- elif mm.role == 'assistant' -%}{%- set dn.msgs = dn.msgs + [{'role': 'assistant', 'content': mm.content, "
      "'tools': mm.tools, 'response_format': mm.response_format, 'tool_calls': mm.tool_calls, 'reasoning': none, "
      "'task': mm.task}] -%}{%- endif -%}{%- endfor -%}{%- set msgs = dn.msgs -%}"
      "{%- else -%}{%- set msgs = ns.msgs -%}{%- endif -%}")
    a("{%- set lu = namespace(i=-1) -%}{%- for mm in msgs -%}{%- if " + is_user
      + " -%}{%- set lu.i = loop.index0 -%}{%- endif -%}{%- endfor -%}")
    # ---------------------------------------------------------------- pass 3: render
    a("{{- " + L(BOS) + " -}}")
    a("{%- for m in msgs -%}{%- set i = loop.index0 -%}")
    # tools / response format suffix
    a("{%- set suffix = namespace(s='') -%}"
      "{%- if m.tools -%}{%- set tns = namespace(j=[]) -%}{%- for tl in m.tools -%}"
      "{%- set tns.j = tns.j + [(tl.function if tl.function is defined else tl) | tojson] -%}{%- endfor -%}"
      "{%- set suffix.s = suffix.s ~ '\\n\\n' ~ " + L(tools_text) + " ~ (tns.j | join('\\n')) ~ " + L(_TOOLS_TAIL)
      + " -%}{%- endif -%}"
      "{%- if m.response_format -%}{%- set suffix.s = suffix.s ~ '\\n\\n' ~ "
      + L("## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n")
      + " ~ (m.response_format | tojson) -%}{%- endif -%}")
    if v41:
        a("{%- set ep = effort_text if (i == 0 and think) else '' -%}")
        a("{%- if i == 0 and (ep or m.role == 'system') -%}{{- " + L(SYSTEM) + " -}}{%- endif -%}{{- ep -}}")
    else:
        a("{%- if i == 0 and think -%}{{- effort_text -}}{%- endif -%}")
    a("{%- if m.role == 'system' -%}")
    if v41:
        a("{%- if i > 0 -%}{{- " + L(SYSTEM) + " -}}{%- endif -%}")
    a("{{- (m.content or '') ~ suffix.s -}}")
    a("{%- elif m.role == 'developer' -%}{{- " + L(USER) + " ~ (m.content or '') ~ suffix.s -}}")
    a("{%- elif m.role == 'user' -%}{{- " + L(USER) + " -}}{%- set pns = namespace(parts=[]) -%}"
      "{%- for b in m.blocks -%}{%- if b.type == 'tool_result' -%}"
      "{%- set pns.parts = pns.parts + ['<tool_result>' ~ b.text ~ '</tool_result>'] -%}"
      "{%- else -%}{%- set pns.parts = pns.parts + [b.text] -%}{%- endif -%}{%- endfor -%}"
      "{{- pns.parts | join('\\n\\n') -}}")
    a("{%- elif m.role == 'latest_reminder' -%}{{- " + L(REMINDER) + " ~ (m.content or '') -}}")
    a("{%- elif m.role == 'assistant' -%}")
    a("{%- set tc = namespace(s='', calls=[]) -%}{%- if m.tool_calls -%}{%- for call in m.tool_calls -%}"
      "{%- set f = call.function if call.function is defined else call -%}"
      "{%- set pn = namespace(ps=[]) -%}"
      "{%- if f.arguments is mapping -%}{%- for k, v in f.arguments.items() -%}"
      "{%- set pn.ps = pn.ps + ['<" + DSML + par + " name=\"' ~ k ~ '\" string=\"' ~ ('true' if v is string else 'false') "
      "~ '\">' ~ (v if v is string else (v | tojson)) ~ '</" + DSML + par + ">'] -%}{%- endfor -%}"
      "{%- else -%}{%- set pn.ps = ['<" + DSML + par + " name=\"arguments\" string=\"true\">' ~ f.arguments ~ '</"
      + DSML + par + ">'] -%}{%- endif -%}"
      "{%- set tc.calls = tc.calls + ['<" + DSML + inv + " name=\"' ~ f.name ~ '\">\\n' ~ (pn.ps | join('\\n')) ~ '\\n</"
      + DSML + inv + ">'] -%}{%- endfor -%}"
      "{%- set tc.s = '\\n\\n<" + DSML + blk + ">\\n' ~ (tc.calls | join('\\n')) ~ '\\n</" + DSML + blk + ">' -%}"
      "{%- endif -%}")
    a("{%- set prev_task = i > 0 and msgs[i - 1].task is not none -%}")
    a("{%- if think and not prev_task and ((not drop) or i > lu.i) -%}{{- (m.reasoning or '') ~ "
      + L(END_THINK) + " -}}{%- endif -%}")
    a("{{- (m.content or '') ~ tc.s ~ " + L(EOS) + " -}}")
    a("{%- endif -%}")
    # transition
    a("{%- set nxt = msgs[i + 1] if i + 1 < (msgs | length) else none -%}")
    a("{%- if nxt is none or nxt.role in ['assistant', 'latest_reminder'] -%}")
    a("{%- if m.task is not none -%}{%- set tasks = " + json.dumps(TASKS, ensure_ascii=False) + " -%}"
      "{%- if m.task != 'action' -%}{{- tasks[m.task] -}}{%- else -%}{{- " + L(ASSISTANT) + " ~ ("
      + L(THINK) + " if think else " + L(END_THINK) + ") ~ tasks['action'] -}}{%- endif -%}")
    if v41:
        a("{%- elif m.role in ['user', 'developer'] or (m.role == 'system' and i > 0) -%}")
    else:
        a("{%- elif m.role in ['user', 'developer'] or (m.role == 'system' and (nxt is none or nxt.role == 'assistant')) -%}")
    a("{{- " + L(ASSISTANT) + " -}}{%- if (not drop and think) or (drop and think and i >= lu.i) -%}{{- "
      + L(THINK) + " -}}{%- else -%}{{- " + L(END_THINK) + " -}}{%- endif -%}")
    a("{%- endif -%}{%- endif -%}")
    a("{%- endfor -%}")
    return "".join(t)
