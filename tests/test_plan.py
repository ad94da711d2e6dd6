"""The memory planner (`vllm_deepinfer.tools.plan`) against the engine: weight bytes and KV accounting.

vLLM 0.32's CPU worker does not log "Model loading took X GiB" (only the GPU runners do), so the weight check
compares the planner with the bytes of the loaded model's parameters and weight buffers (Engram tables, V4
hash-routing tables); the KV check compares with vLLM's own numbers behind its "CPU KV cache size: N tokens,
Maximum concurrency ..." line (`cache_config.kv_cache_size_tokens`, `kv_cache_max_concurrency`, num_blocks).
Tolerance: none — both must match exactly. Small buffers (RoPE frequencies, Engram hash constants and token
map: < 0.1 % here, ~1 MB at release size) are not weights and are not counted.
"""

from __future__ import annotations

import json

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.conftest import engine, tiny_checkpoint
from vllm_deepinfer.checkpoint.inventory import expected_tensors
from vllm_deepinfer.config import ArchConfig
from vllm_deepinfer.tools import plan


def _engine_numbers(llm) -> dict:
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    model = runner.get_model()
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:  # its own parameters; the target's embedding / head it shares are counted once
        target = {t.data_ptr() for t in model.parameters()}
        weights += sum(t.numel() * t.element_size() for t in drafter.model.parameters() if t.data_ptr() not in target)
    weights += sum(t.numel() * t.element_size() for n, t in model.named_buffers()
                   if ".engram.embed." in n or n.endswith("tid2eid"))
    cc = core.vllm_config.cache_config
    return {"weights": weights, "num_blocks": runner.kv_cache_config.num_blocks, "groups": len(
        runner.kv_cache_config.kv_cache_groups), "tokens": cc.kv_cache_size_tokens,
        "concurrency": cc.kv_cache_max_concurrency}


@pytest.mark.parametrize("arch,dtype,storage,kv_cache_dtype", [
    ("v4.1-flash", "bfloat16", "packed", "auto"), ("v4-flash", "float32", "bf16", "auto"),
    ("v4.1-flash", "bfloat16", "packed", "fp8_ds_mla"), ("v4-flash", "float32", "bf16", "fp8")])
def test_plan_matches_engine(ckpt_root, monkeypatch, arch, dtype, storage, kv_cache_dtype):
    monkeypatch.setenv("DEEPINFER_FP8_LINEARS", storage)
    monkeypatch.setenv("DEEPINFER_EXPERT_STORAGE", storage)
    ckpt = tiny_checkpoint(ckpt_root, arch)
    kv_gib, max_len, budget = 2.0, 4096, 2048   # VLLM_CPU_KVCACHE_SPACE=2 (conftest)
    extra = {"limit_mm_per_prompt": {"image": 0}} if arch == "v4.1-flash" else {}
    with engine(ckpt, dtype=dtype, max_model_len=max_len, max_num_batched_tokens=budget, kv_cache_dtype=kv_cache_dtype,
                **extra) as llm:
        got = _engine_numbers(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2  # the planned engine serves

    a = ArchConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    b = plan.DTYPE_BYTES[dtype]
    dep = plan.Deployment(dtype_bytes=b, fp8_linears=storage, experts=storage, engram="gpu", kv_dtype_bytes=b,
                          kv_records=kv_cache_dtype != "auto", block_size=64)
    w = plan.plan_weights(a, dep)
    assert w.gpu_bytes == got["weights"]
    kv = plan.plan_kv(a, dep)
    blocks, tokens, conc = kv.capacity(int(kv_gib * 2 ** 30), max_len, in_flight=budget)
    assert (blocks, len(kv.groups), tokens) == (got["num_blocks"], got["groups"], got["tokens"])
    assert conc == pytest.approx(got["concurrency"], rel=1e-12)
    # host Engram tables leave the GPU total by exactly the table bytes
    if a.engram_layer_ids:
        host = plan.plan_weights(a, plan.Deployment(dtype_bytes=b, fp8_linears=storage, experts=storage))
        assert host.gpu_bytes + host.host["Engram tables"] == w.gpu_bytes


@pytest.mark.parametrize("arch,dtype,storage,method", [("v4-flash", "float32", "bf16", "mtp"),
                                                      ("v4.1-flash", "bfloat16", "packed", "dspark")])
def test_plan_matches_engine_with_drafter(ckpt_root, monkeypatch, arch, dtype, storage, method):
    """`--speculative`: the drafter's weights (V4's MTP block with its own embedding and head; V4.1's DSpark stages
    and heads, which call the target's embedding and head) and its window caches, against an engine with vLLM's
    speculative config: weights, blocks, groups and tokens exactly."""
    monkeypatch.setenv("DEEPINFER_FP8_LINEARS", storage)
    monkeypatch.setenv("DEEPINFER_EXPERT_STORAGE", storage)
    ckpt = tiny_checkpoint(ckpt_root, arch)
    kv_gib, max_len, budget = 2.0, 4096, 2048
    extra = {"limit_mm_per_prompt": {"image": 0}} if arch == "v4.1-flash" else {}
    with engine(ckpt, dtype=dtype, max_model_len=max_len, max_num_batched_tokens=budget,
                speculative_config={"method": method, "num_speculative_tokens": 2}, **extra) as llm:
        got = _engine_numbers(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4

    a = ArchConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    b = plan.DTYPE_BYTES[dtype]
    dep = plan.Deployment(dtype_bytes=b, fp8_linears=storage, experts=storage, engram="gpu", kv_dtype_bytes=b,
                          block_size=64, speculative=True)
    w = plan.plan_weights(a, dep)
    assert "drafter" in w.per_gpu and not w.not_loaded.get("drafter mtp.* (loaded with --speculative-config)")
    assert w.gpu_bytes == got["weights"]
    kv = plan.plan_kv(a, dep)
    blocks, tokens, _ = kv.capacity(int(kv_gib * 2 ** 30), max_len, in_flight=budget)
    assert (blocks, len(kv.groups), tokens) == (got["num_blocks"], got["groups"], got["tokens"])


def test_plan_release_numbers():
    """Release configs: inventory counts of model-spec §5 and the BF16 KV growth of §6.2 (3200 / 6880 B/token);
    with fp8_ds_mla records the compressed KV costs 584 B per row instead of 1024 (2100 / 4501.25 B/token)."""
    for arch_name, growth, records in (("v4.1-flash", 3200.0, 2100.0), ("v4-flash", 6880.0, 4501.25)):
        a = ArchConfig.from_hf(plan.release_config(arch_name))
        assert plan.plan_kv(a, plan.Deployment()).growth_per_token == growth
        assert plan.plan_kv(a, plan.Deployment(kv_records=True)).growth_per_token == records
    a = ArchConfig.from_hf(plan.release_config("v4.1-flash"))
    one = plan.plan_weights(a, plan.Deployment())
    tp8 = plan.plan_weights(a, plan.Deployment(tp=8))
    ep8 = plan.plan_weights(a, plan.Deployment(tp=1, dp=8, ep=True))
    assert tp8.per_gpu["routed experts"] * 8 == one.per_gpu["routed experts"] == ep8.per_gpu["routed experts"] * 8
    assert ep8.per_gpu["attention"] == one.per_gpu["attention"]       # DP replicates attention
    # the drafter (DSpark: 3 stages of 128 experts) spreads its experts over EP ranks, redundant ones included
    spec = plan.plan_weights(a, plan.Deployment(speculative=True))
    spec_ep = plan.plan_weights(a, plan.Deployment(dp=8, ep=True, redundant_experts=32, speculative=True))
    experts = sum(b for n, (dt, shape) in expected_tensors(a).items() if n.startswith("mtp.") and ".ffn.experts." in n
                  for b in [plan.stored_bytes(n, dt, shape, plan.Deployment(), a.weight_block_size)])
    assert spec.per_gpu["drafter"] - spec_ep.per_gpu["drafter"] == experts - experts * (128 + 32) // 128 // 8
    assert "drafter" not in one.per_gpu and one.not_loaded
    assert tp8.per_gpu["router"] == one.per_gpu["router"]              # replicated under TP
    assert one.host["Engram tables"] == sum(n * 256 * (1 + 1 / 32) for n in a.engram_num_embeddings)
