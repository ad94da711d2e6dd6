"""Structured output offline: DeepInfer's `SamplingParams(so_args=...)` through `LLM()` with xgrammar."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import tiny_checkpoint
from vllm_deepinfer.serving import SamplingParams
from vllm_deepinfer.serving.so_args import to_structured_outputs

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def test_so_args_mapping_and_errors():
    assert to_structured_outputs({"json": SCHEMA}).json == SCHEMA
    assert to_structured_outputs({"json_schema": json.dumps(SCHEMA)}).json == json.dumps(SCHEMA)
    assert to_structured_outputs({"ebnf": 'root ::= "a"'}).grammar == 'root ::= "a"'
    assert to_structured_outputs({"choice": ["x", "y"]}).choice == ["x", "y"]
    assert to_structured_outputs({"regex": "a+", "disable_any_whitespace": True}).disable_any_whitespace
    with pytest.raises(ValueError, match=r"unknown so_args key\(s\) \['jsonn'\]"):
        SamplingParams(so_args={"jsonn": SCHEMA})
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(so_args={"regex": "a", "grammar": "root ::= \"a\""})
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(so_args={})
    p = SamplingParams(max_tokens=4, so_args={"regex": "a+"})
    assert p.so_args is None and p.structured_outputs.regex == "a+"


@pytest.fixture(scope="module")
def llm(ckpt_root):
    from vllm import LLM

    model = tiny_checkpoint(ckpt_root, "v4.1-flash")
    engine = LLM(str(model), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.2, enforce_eager=True,
                 structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True}, seed=0)
    yield engine
    del engine


def test_so_args_offline(llm):
    jsonschema = pytest.importorskip("jsonschema")
    prompts = ["Give me JSON", "A regex", "Grammar", "Pick one"]
    params = [
        SamplingParams(max_tokens=128, temperature=0, so_args={"json": SCHEMA, "disable_any_whitespace": True}),
        SamplingParams(max_tokens=32, temperature=0, so_args={"regex": "[a-f]{3}-[0-9]{2}"}),
        SamplingParams(max_tokens=32, temperature=0, so_args={"grammar": 'root ::= "yes" | "no" | ("n=" [0-9] [0-9]?)'}),
        SamplingParams(max_tokens=16, temperature=0, so_args={"choice": ["alpha", "beta"]}),
    ]
    outs = llm.generate(prompts, params)
    out = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(out[0], strict=False), SCHEMA)
    assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", out[1])
    assert re.fullmatch(r"yes|no|n=[0-9]{1,2}", out[2])
    assert out[3] in ("alpha", "beta")
