"""Engram table placement (`DEEPINFER_ENGRAM_DEVICE`, vLLM's `--engram-config`): the host path (tables outside the device, every
Engram layer's rows hashed and gathered into staging buffers at step start, consumed by the layer) gives
bitwise the tokens and logprobs of the in-layer device lookup. On CPU both placements are the same memory,
so this checks the prefetch path's logic; the CUDA side (pinned tables, UVA gathers on a side stream inside
the decode CUDA graph) is the GPU check in NOTES.md."""

from __future__ import annotations

import pytest

from tests.conftest import engine, model_runner, tiny_checkpoint
from vllm_deepinfer.ops import parse_engram_device, parse_engram_shared


def test_parse_engram_device():
    assert parse_engram_device(None, "cuda") == "host" and parse_engram_device("auto", "cpu") == "gpu"
    assert parse_engram_device("GPU", "cuda") == "gpu" and parse_engram_device("host", "cpu") == "host"
    # vLLM's --engram-config cpu_offload decides `auto`; the variable, where set, wins
    assert parse_engram_device(None, "cuda", cpu_offload=False) == "gpu"
    assert parse_engram_device("host", "cuda", cpu_offload=False) == "host"
    with pytest.raises(ValueError, match="DEEPINFER_ENGRAM_DEVICE='pinned' is unknown"):
        parse_engram_device("pinned", "cuda")


def test_parse_engram_shared():
    assert parse_engram_shared(None) and parse_engram_shared("auto") and parse_engram_shared("1")
    assert not parse_engram_shared("0") and not parse_engram_shared("off")
    with pytest.raises(ValueError, match="DEEPINFER_ENGRAM_SHARED='maybe' is unknown"):
        parse_engram_shared("maybe")


@pytest.mark.parametrize("engram_config,env,want", [
    (None, None, (False, False)),                         # CPU: `auto` keeps the tables in device memory
    ({"cpu_offload": False}, "host", (True, False)),      # the variable wins; one process: nothing to share
    ({"embedding_across_dp": True, "use_thp": True}, "host", (True, False)),  # accepted with a warning each
])
def test_engram_placement_from_vllm_config(ckpt_root, monkeypatch, caplog, engram_config, env, want):
    """vLLM's own config (EngineArgs -> VllmConfig, as `vllm serve --engram-config` builds it) decides placement."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_deepinfer.models.engram import engram_placement

    if env is None:
        monkeypatch.delenv("DEEPINFER_ENGRAM_DEVICE", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_ENGRAM_DEVICE", env)
    args = EngineArgs(model=str(tiny_checkpoint(ckpt_root, "v4.1-flash", 0)), engram_config=engram_config)
    config = args.create_engine_config()
    assert config.engram_config is not None  # vLLM resolves one for every V4.1 checkpoint
    assert engram_placement(config) == want
    warned = " ".join(r.getMessage() for r in caplog.records)
    for key in (engram_config or {}):
        if key in ("embedding_across_dp", "use_thp"):
            assert f"--engram-config {key} is not used" in warned


def test_host_tables_generate_the_same(ckpt_root, monkeypatch):
    from vllm import SamplingParams

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0)
    # a long and a short prompt: prefill spans, then decode steps with both requests in one batch
    prompts = ["The quick brown fox jumps over the lazy dog. " * 20, "1, 2, 3, 5, 8,"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = {}
    for mode in ("gpu", "host"):
        monkeypatch.setenv("DEEPINFER_ENGRAM_DEVICE", mode)
        with engine(ckpt, max_model_len=512, max_num_batched_tokens=512) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            model = model_runner(llm).model
            engrams = [layer.engram for layer in model.model.layers if layer.engram is not None]
            assert engrams and all(e.embed.host == (mode == "host") for e in engrams)
            assert len(model.model.engram_prefetch.layers) == (len(engrams) if mode == "host" else 0)
        runs[mode] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                      for o in outs]
    assert runs["host"] == runs["gpu"]
