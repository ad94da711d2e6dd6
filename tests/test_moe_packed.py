"""Packed (MXFP4) routed-expert storage on CPU, and the expert-storage switch.

Off CUDA, packed storage is `TorchMoEMethod(packed=True)` inside vLLM's fused-MoE layer: it keeps the
stored codes and E8M0 bytes and runs `ops.routed_experts_packed`, whose result must be bitwise equal to
`ops.routed_experts` on the dequantised weights (bf16/fp32 storage). Then a tiny V4.1 checkpoint is served
with `DEEPINFER_EXPERT_STORAGE=packed` and with bf16 storage: the codes go through the layer's weight
loader, and the greedy tokens and their logprobs are identical. `auto` is bf16 off CUDA (packed through
vLLM's MXFP4 method on CUDA: tests/gpu, benchmarks/gpu_moe_check.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import RoutedExperts

from tests.conftest import engine, interpreter_child, tiny_checkpoint
from vllm_deepinfer import ops
from vllm_deepinfer.checkpoint.formats import dequant_mxfp4, quant_mxfp4
from vllm_deepinfer.moe.method import TorchMoEMethod, expert_storage

E, D, INTER, LIMIT = 8, 64, 32, 1.0


def _weights(seed: int):
    """(codes + scales, as stored) of one random expert set: w13 [E, 2I, D], w2 [E, D, I]."""
    g = torch.Generator().manual_seed(seed)
    w13, s13 = quant_mxfp4(torch.randn(E, 2 * INTER, D, generator=g) * D ** -0.5)
    w2, s2 = quant_mxfp4(torch.randn(E, D, INTER, generator=g) * INTER ** -0.5)
    return [t.view(torch.uint8) for t in (w13, s13, w2, s2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_packed_storage_equals_dequantised(dtype, T):
    w13, s13, w2, s2 = _weights(seed=T)
    g = torch.Generator().manual_seed(100 + T)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :6]
    weights = torch.rand(T, 6, generator=g) * 1.5
    want = ops.routed_experts(x, ids, weights, dequant_mxfp4(w13, s13).to(dtype), dequant_mxfp4(w2, s2).to(dtype),
                              LIMIT)
    got = ops.routed_experts_packed(x, ids, weights, w13, s13, w2, s2, LIMIT)
    assert got.dtype == dtype and torch.equal(got, want)


def test_packed_params_start_finite():
    """vLLM's dummy load leaves integer params as constructed: zero codes, scale byte 127 (1.0), never 0xFF."""
    layer = nn.Module()
    TorchMoEMethod(None, packed=True).create_weights(layer, E, D, INTER, torch.float32, weight_loader=None)
    p = dict(layer.named_parameters())
    assert p["w13_weight"].dtype == torch.uint8 and p["w13_weight"].shape == (E, 2 * INTER, D // 2)
    assert p["w2_weight"].shape == (E, D, INTER // 2) and p["w2_weight_scale"].shape == (E, D, INTER // 32)
    assert bool((p["w13_weight_scale"] == 127).all() and (p["w2_weight_scale"] == 127).all()
                and (p["w13_weight"] == 0).all())
    assert p["w13_weight_scale"].quant_method == "block"  # vLLM's weight loader shards it like its weight
    out = ops.routed_experts_packed(torch.randn(3, D), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.ones(3, 2),
                                    p["w13_weight"], p["w13_weight_scale"], p["w2_weight"], p["w2_weight_scale"], LIMIT)
    assert torch.isfinite(out).all()


def test_storage_selection(monkeypatch):
    monkeypatch.delenv(ops.EXPERT_STORAGE_ENV, raising=False)
    assert expert_storage("fp4") == "bf16"  # auto off CUDA: the dequantised torch experts
    assert ops.parse_storage(ops.EXPERT_STORAGE_ENV, None) == "auto"
    monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, "packed")
    assert expert_storage("fp4") == "packed"
    assert expert_storage("fp8") == "bf16"  # only MXFP4 experts pack
    monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, "bf16")
    assert expert_storage("fp4") == "bf16"
    monkeypatch.delenv(ops.FP8_LINEARS_ENV, raising=False)
    assert not ops.packed_storage(ops.FP8_LINEARS_ENV, "cpu")  # FP8 linears: auto = bf16 off CUDA
    assert ops.packed_storage(ops.FP8_LINEARS_ENV, "cuda")  # and packed (Marlin W8A16) on CUDA
    monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, "fp4")
    with pytest.raises(ValueError, match="expected auto, packed or bf16"):
        expert_storage("fp4")


def _expert_methods(model) -> set[tuple[str, bool, torch.dtype]]:
    return {(type(m.quant_method).__name__, m.quant_method.packed, m.w13_weight.dtype)
            for m in model.modules() if isinstance(m, RoutedExperts)}


def test_packed_checkpoint_generates_same_tokens(ckpt_root, monkeypatch):
    from vllm import SamplingParams

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    runs = {}
    for storage in ("bf16", "packed"):
        monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, storage)
        with engine(ckpt, dtype="bfloat16") as llm:
            methods = llm.apply_model(_expert_methods)[0]
            outs = llm.generate(prompts, params, use_tqdm=False)
        packed = storage == "packed"
        assert methods == {("TorchMoEMethod", packed, torch.uint8 if packed else torch.bfloat16)}
        runs[storage] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                   o.outputs[0].token_ids)])
                         for o in outs]
    assert runs["packed"] == runs["bf16"]


def test_moe_kernels_in_interpreter_child():
    """`kernels_nvidia.moe` (the CUDA routed experts of batch-invariant mode) against the oracle in fp32, its batch
    invariance, its row tiles and its routing-glue kernel, in Triton's interpreter (TRITON_INTERPRET=1 before Triton
    loads: a child pytest; bf16 dots are CUDA-only, the interpreter computes them wrongly)."""
    pytest.importorskip("triton")
    r = interpreter_child("tests/gpu/test_moe_kernels.py")
    summary = r.stdout.strip().splitlines()[-1]
    print(summary)
    assert r.returncode == 0 and "5 passed" in summary, r.stdout[-6000:] + r.stderr[-3000:]
