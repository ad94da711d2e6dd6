"""`vllm serve` with the plugin: real server process on loopback, real `openai` / `anthropic` clients.

One server per module (start-up ~50 s on CPU). The tiny model has random weights, so tests that need
realistic output (tool calls, reasoning) force it with xgrammar structural tags: the DSML and
`</think>` delimiters are forced as the tokenizer's special tokens (what a real model emits), the
rest as text or a regex the model fills in. `enable_in_reasoning` lets the grammar drive the
thinking part too. Several token-element grammars in one server is what
`vllm_deepinfer/patches/xgrammar_token_cache.py` makes work (xgrammar 0.2.8 served one grammar's
token mask to the next); `test_token_grammars_one_compiler` checks it without a server.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from tests.conftest import Server, free_port, tiny_checkpoint  # noqa: E402
from vllm_deepinfer.serving.parsers import tool_call_structural_tag  # noqa: E402

MAX_MODEL_LEN = 4096
STRESS_SECONDS = float(os.environ.get("DEEPINFER_STRESS_SECONDS", "30"))
MARKUP = re.compile(r"DSML|<｜|｜>|</?think>")
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def _tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants (MiB), from /proc."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    total, todo = 0, [pid]
    while todo:
        q = todo.pop()
        todo.extend(children.get(q, []))
        try:
            for line in Path(f"/proc/{q}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


@pytest.fixture(scope="module")
def server(ckpt_root, tmp_path_factory):
    model = tiny_checkpoint(ckpt_root, "v4.1-flash")
    srv = Server(model, free_port(), tmp_path_factory.mktemp("serve") / "server.log", [
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
        "--enable-auto-tool-choice", "--tool-call-parser", "deepinfer_v41", "--reasoning-parser", "deepinfer_v41",
        "--structured-outputs-config",
        json.dumps({"backend": "xgrammar", "enable_in_reasoning": True, "disable_any_whitespace": True})])
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def special_ids(server):
    tok = json.loads((Path(server.model) / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in tok["added_tokens"]}


def _reasoning_tag(reasoning: str, content: str, ids: dict[str, int]) -> str:
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": reasoning},
        {"type": "token", "token": ids["</think>"]},
        {"type": "const_string", "value": content},
    ]}})


# ── Chat Completions ─────────────────────────────────────────────────────────


def test_chat_non_streaming(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=16, extra_body=NO_THINK)
    ch = r.choices[0]
    assert ch.finish_reason in ("length", "stop")
    assert ch.message.content and ch.message.role == "assistant"
    assert r.usage.completion_tokens == 16 or ch.finish_reason == "stop"
    # Thinking mode (V4.1 default): the generation prompt ends with <think>, so an answer the model
    # never closes is reasoning.
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=8)
    assert r.choices[0].message.reasoning and not r.choices[0].message.content


def test_chat_streaming(client, model_name):
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=16, stream=True, extra_body=NO_THINK,
                                            stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text and finish in ("length", "stop")
    assert usage is not None and usage.completion_tokens <= 16


# Order matters and is kept on purpose: the thinking case compiles a second token-element grammar (`</think>`
# first) after the non-thinking one on the same server — the case xgrammar 0.2.8's cross-grammar cache got
# wrong (patches/xgrammar_token_cache.py).
@pytest.mark.parametrize("thinking", [False, True])
def test_tool_call(client, model_name, special_ids, thinking):
    tag = tool_call_structural_tag(
        [("get_weather", {"city": ("regex", "[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?"), "days": 3})],
        special_ids, v41=True, reasoning="The user wants weather, call the tool." if thinking else None)
    body = {"chat_template_kwargs": {"thinking": thinking}, "structured_outputs": {"structural_tag": tag}}
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
              tools=TOOLS, max_tokens=200, extra_body=body)

    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    args = json.loads(msg.tool_calls[0].function.arguments)
    assert set(args) == {"city", "days"} and args["days"] == 3 and re.fullmatch(r"[A-Z][a-z]+( [A-Z][a-z]+)?", args["city"])
    assert not (msg.content or "").strip()
    if thinking:
        assert msg.reasoning == "The user wants weather, call the tool."

    arg_deltas, names, content, reasoning, finish = [], [], "", "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning", None) or ""
            for tc in d.tool_calls or []:
                assert tc.index == 0
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                if tc.function and tc.function.arguments:
                    arg_deltas.append(tc.function.arguments)
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    for delta in arg_deltas:
        assert not MARKUP.search(delta), f"tool-call markup in streamed arguments: {delta!r}"
    streamed = json.loads("".join(arg_deltas))
    assert streamed["days"] == 3 and set(streamed) == {"city", "days"}
    assert not MARKUP.search(content) and not content.strip()
    if thinking:
        assert reasoning == "The user wants weather, call the tool."


def test_reasoning_split(client, model_name, special_ids):
    tag = _reasoning_tag("Let me think. 2 plus 2 is 4.", "The answer is 4.", special_ids)
    kw = dict(model=model_name, messages=[{"role": "user", "content": "2+2?"}], max_tokens=100,
              extra_body={"structured_outputs": {"structural_tag": tag}})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning == "Let me think. 2 plus 2 is 4."
    assert msg.content == "The answer is 4."
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning", None) or ""
            content += c.delta.content or ""
    assert reasoning == "Let me think. 2 plus 2 is 4." and content == "The answer is 4."


# ── Responses and Anthropic Messages ─────────────────────────────────────────


def test_responses_api(client, model_name):
    r = client.responses.create(model=model_name, input="Hello", max_output_tokens=12)
    assert r.status in ("completed", "incomplete") and r.output
    assert any(item.type in ("message", "reasoning") for item in r.output)
    events = [e.type for e in client.responses.create(model=model_name, input="Hello", max_output_tokens=12,
                                                      stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")


def test_anthropic_messages(server, model_name):
    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    r = a.messages.create(model=model_name, max_tokens=12, messages=[{"role": "user", "content": "Hello"}])
    assert r.role == "assistant" and r.stop_reason in ("max_tokens", "end_turn") and r.content
    assert r.usage.output_tokens <= 12
    kinds = []
    with a.messages.stream(model=model_name, max_tokens=12, messages=[{"role": "user", "content": "Hello"}]) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds and final.stop_reason in ("max_tokens", "end_turn")


# ── Structured output over HTTP ──────────────────────────────────────────────

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False,
}


def test_json_schema(client, model_name):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "A person"}], max_tokens=200, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    # xgrammar 0.2.8's JSON grammar lets raw control characters into strings (not strict JSON)
    jsonschema.validate(json.loads(r.choices[0].message.content, strict=False), SCHEMA)


def test_regex_ebnf_and_so_args(client, model_name):
    def ask(**body):
        r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=60, extra_body={**NO_THINK, **body})
        return r.choices[0].message.content
    assert re.fullmatch(r"[a-f]{4}-[0-9]{2,4}", ask(structured_outputs={"regex": "[a-f]{4}-[0-9]{2,4}"}))
    out = ask(structured_outputs={"grammar": 'root ::= "yes" | "no" | ("maybe " [0-9])'})
    assert re.fullmatch(r"yes|no|maybe [0-9]", out)
    assert re.fullmatch(r"[xyz]{3,5}", ask(so_args={"regex": "[xyz]{3,5}"}))
    assert ask(so_args={"choice": ["red", "green"]}) in ("red", "green")
    assert re.fullmatch(r"(ab)+", ask(so_args={"ebnf": 'root ::= ("ab")+'}))


# ── Bad input: 4xx with a clear message, and the server keeps answering ───────


BAD = {
    "oov_token_ids": ("completions", {"prompt": [5, 10**6], "max_tokens": 4}, r"out of vocabulary"),
    "empty_messages": ("chat", {"messages": [], "max_tokens": 4}, r"at least one message"),
    "prompt_too_long": ("chat", {"messages": [{"role": "user", "content": "hello " * 5000}], "max_tokens": 4},
                        r"maximum context length"),
    "invalid_json_schema": ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": {"type": "objectz"}}}},
                            r"objectz|schema|[Gg]rammar"),
    "invalid_regex": ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                               "structured_outputs": {"regex": "(abc"}}, r"regex"),
    "invalid_ebnf": ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                              "structured_outputs": {"grammar": 'root ::= "a" |'}}, r"[Gg]rammar"),
    "unknown_so_args_key": ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                     "so_args": {"jsn": {}}}, r"unknown so_args key.*jsn"),
    "negative_max_tokens": ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                            r"max_tokens"),
    "malformed_tool": ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                "tools": [{"type": "function", "function": {"description": "no name"}}]}, r"name"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input(server, model_name, case):
    endpoint, body, pattern = BAD[case]
    url = server.url + ("/v1/completions" if endpoint == "completions" else "/v1/chat/completions")
    r = httpx.post(url, json={"model": model_name, **body}, timeout=120)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    msg = r.json()["error"]["message"]
    assert re.search(pattern, msg), msg
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": model_name, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]


# ── Concurrency: 32 streaming clients with random aborts ─────────────────────


def test_concurrent_streams_with_aborts(server, model_name):
    import asyncio

    rss_start = _tree_rss_mb(server.proc.pid)
    stats = {"completed": 0, "aborted": 0, "bad": []}

    async def worker(wid: int, deadline: float) -> None:
        rng = random.Random(wid)
        # One connection per request ("Connection: close"): the stress is on the engine, not on HTTP keep-alive
        # (a pooled connection the server's 5 s keep-alive timer closes as it is reused reads as a ReadError).
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300,
                                     default_headers={"Connection": "close"})
        mine = 0  # this worker's completed streams: the count bounds the work, the deadline only extends it
        while time.time() < deadline or mine < 2:
            max_tokens = rng.randint(4, 48)
            abort_after = rng.randint(1, 8) if rng.random() < 0.3 else None
            prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(rng.randint(3, 60)))
            stream = await aclient.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                stream=True, extra_body=NO_THINK if rng.random() < 0.5 else None)
            n, finish, ids = 0, None, set()
            try:
                async for chunk in stream:
                    ids.add(chunk.id)
                    for c in chunk.choices:
                        finish = c.finish_reason or finish
                    n += 1
                    if abort_after is not None and n >= abort_after:
                        break
            finally:
                await stream.close()
            if abort_after is not None and finish is None:
                stats["aborted"] += 1
            elif finish in ("length", "stop") and len(ids) == 1:
                stats["completed"] += 1
                mine += 1
            else:
                stats["bad"].append((wid, finish, len(ids), n))
        await aclient.close()

    async def main() -> None:
        deadline = time.time() + STRESS_SECONDS
        await asyncio.gather(*(worker(i, deadline) for i in range(32)))

    try:
        asyncio.run(main())
    except openai.APIConnectionError as e:
        raise AssertionError(f"{e!r}; server alive: {server.proc.poll() is None}; server log tail:\n"
                             f"{server.log.read_text()[-6000:]}") from e
    assert not stats["bad"], stats["bad"][:5]
    assert stats["completed"] >= 2 * 32 and stats["aborted"] > 0, stats
    assert server.alive()
    time.sleep(5)  # let aborted requests drain
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    running = [float(m) for m in re.findall(r'^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)', metrics, re.M)]
    assert running and sum(running) == 0
    rss_end = _tree_rss_mb(server.proc.pid)
    print(f"\nstress: {stats['completed']} completed, {stats['aborted']} aborted in {STRESS_SECONDS:.0f}s; "
          f"server RSS {rss_start:.0f} -> {rss_end:.0f} MiB")
    assert rss_end < rss_start * 1.10 + 200, (rss_start, rss_end)


# ── Parsers on realistic token streams (offline, same classes the server uses) ─


def _stream_parse(tokenizer, text: str, thinking: bool, tools=TOOLS):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_deepinfer.serving.parsers import (
        DeepInferV41ReasoningParser,
        DeepInferV41ToolParser,
    )

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
                                chat_template_kwargs={"thinking": thinking})
    ids = tokenizer.encode(text, add_special_tokens=False)
    rp = DeepInferV41ReasoningParser(tokenizer, chat_template_kwargs={"thinking": thinking})
    reasoning, content = rp.extract_reasoning(text, req)
    tp = DeepInferV41ToolParser(tokenizer, tools=[t for t in req.tools] if req.tools else None)
    calls = tp.extract_tool_calls(content or "", req) if content else None
    return ids, reasoning, content, calls


def test_parser_on_token_streams(ckpt_root):
    from vllm.tokenizers import get_tokenizer

    from vllm_deepinfer.serving.parsers import render_tool_calls

    tok = get_tokenizer(str(tiny_checkpoint(ckpt_root, "v4.1-flash")), tokenizer_mode="deepseek_v41")
    dsml = render_tool_calls([("get_weather", {"city": "Paris", "days": 3})])
    ids, reasoning, content, calls = _stream_parse(tok, "I need the weather.</think>" + dsml, thinking=True)
    assert tok.convert_tokens_to_ids("<｜DSML｜ calls>") in ids
    assert reasoning == "I need the weather."
    assert calls.tools_called and json.loads(calls.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    _, reasoning, content, _ = _stream_parse(tok, "Think hard.</think>The answer is 4.", thinking=True)
    assert (reasoning, content) == ("Think hard.", "The answer is 4.")
    _, reasoning, content, _ = _stream_parse(tok, "Plain answer, no thinking.", thinking=False)
    assert reasoning is None and content == "Plain answer, no thinking."


def test_token_grammars_one_compiler(ckpt_root):
    """vLLM's xgrammar backend compiles every request with one cached compiler; two structural tags
    whose `token` elements differ only in the id must each get their own mask (xgrammar 0.2.8 reused
    the first one's: the sampler took a token the matcher then rejected, HTTP 500)."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from vllm_deepinfer.patches import xgrammar_token_cache

    xgrammar_token_cache.apply()
    tok = get_tokenizer(str(tiny_checkpoint(ckpt_root, "v4.1-flash")), tokenizer_mode="deepseek_v41")
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("</think>", "<｜DSML｜ calls>", "</｜DSML｜ calls>")}
    cfg = SimpleNamespace(structured_outputs_config=SimpleNamespace(disable_any_whitespace=True),
                          model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v41")),
                          speculative_config=None)
    vocab = len(tok)
    backend = XgrammarBackend(cfg, tokenizer=tok, vocab_size=vocab)
    plain = tool_call_structural_tag([("f", {"a": 1})], ids)  # "\n\n" <calls> ...
    thinking = tool_call_structural_tag([("f", {"a": 1})], ids, reasoning="ok")  # "ok" </think> "\n\n" <calls> ...
    bitmask = backend.allocate_token_bitmask(1)

    def allowed(grammar) -> set[int]:
        grammar.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
        return set(np.nonzero(bits)[0].tolist())

    for spec, prefix, want in [(plain, "\n\n", "<｜DSML｜ calls>"), (thinking, "ok", "</think>")]:
        grammar = backend.compile_grammar(StructuredOutputOptions.STRUCTURAL_TAG, spec)
        for t in tok.encode(prefix, add_special_tokens=False):
            assert grammar.accept_tokens("r", [t])
        assert allowed(grammar) == {ids[want]}, want
        assert grammar.accept_tokens("r", [ids[want]])
