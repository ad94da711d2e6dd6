"""Packed (MXFP4) routed-expert storage on CPU, through the torch reference op.

`RoutedExperts(packed=True)` keeps the stored codes and E8M0 bytes and runs `ops.routed_experts_packed`;
its result must be bitwise equal to the bf16/fp32 storage holding the dequantised weights (the oracle
dequantises exactly and calls the same `routed_experts`). Then a tiny V4.1 checkpoint is served with
`DEEPINFER_EXPERT_STORAGE=packed` and with bf16 storage: the loader writes the codes, and the greedy
tokens and their logprobs are identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import engine, tiny_checkpoint
from vllm_deepinfer import ops
from vllm_deepinfer.checkpoint.formats import dequant_mxfp4, quant_mxfp4
from vllm_deepinfer.moe.layer import RoutedExperts

E, D, INTER, LIMIT = 8, 64, 32, 1.0


def _experts(dtype: torch.dtype, seed: int) -> tuple[RoutedExperts, RoutedExperts]:
    """(plain storage with the dequantised weights, packed storage with the codes) of one random expert set."""
    g = torch.Generator().manual_seed(seed)
    w13, s13 = quant_mxfp4(torch.randn(E, 2 * INTER, D, generator=g) * D ** -0.5)
    w2, s2 = quant_mxfp4(torch.randn(E, D, INTER, generator=g) * INTER ** -0.5)
    plain, packed = RoutedExperts(E, D, INTER), RoutedExperts(E, D, INTER, packed=True)
    plain.w13.data = dequant_mxfp4(w13, s13).to(dtype)
    plain.w2.data = dequant_mxfp4(w2, s2).to(dtype)
    for name, t in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
        getattr(packed, name).data.copy_(t.view(torch.uint8))
    return plain, packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_packed_storage_equals_dequantised(dtype, T):
    plain, packed = _experts(dtype, seed=T)
    g = torch.Generator().manual_seed(100 + T)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :6]
    weights = torch.rand(T, 6, generator=g) * 1.5
    want = plain(x, ids, weights, LIMIT)
    got = packed(x, ids, weights, LIMIT)
    assert got.dtype == dtype and torch.equal(got, want)


def test_packed_params_start_finite():
    """vLLM's dummy load leaves integer params as constructed: zero codes, scale byte 127 (1.0), never 0xFF."""
    p = RoutedExperts(E, D, INTER, packed=True)
    assert p.w13.dtype == torch.uint8 and p.w13.shape == (E, 2 * INTER, D // 2) and p.w2.shape == (E, D, INTER // 2)
    assert bool((p.w13_scale == 127).all() and (p.w2_scale == 127).all() and (p.w13 == 0).all())
    out = p(torch.randn(3, D), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.ones(3, 2), LIMIT)
    assert torch.isfinite(out).all()


def test_storage_selection(monkeypatch):
    monkeypatch.delenv(ops.EXPERT_STORAGE_ENV, raising=False)
    assert not ops.packed_storage(ops.EXPERT_STORAGE_ENV)  # auto: bf16, measured faster on the H200 today
    monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, "packed")
    assert ops.packed_storage(ops.EXPERT_STORAGE_ENV)
    monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, "bf16")
    assert not ops.packed_storage(ops.EXPERT_STORAGE_ENV)
    monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, "fp4")
    with pytest.raises(ValueError, match="expected auto, packed or bf16"):
        ops.packed_storage(ops.EXPERT_STORAGE_ENV)


def _expert_dtypes(model) -> set[torch.dtype]:
    return {m.w13.dtype for m in model.modules() if isinstance(m, RoutedExperts)}


def test_packed_checkpoint_generates_same_tokens(ckpt_root, monkeypatch):
    from vllm import SamplingParams

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    runs = {}
    for storage in ("bf16", "packed"):
        monkeypatch.setenv(ops.EXPERT_STORAGE_ENV, storage)
        with engine(ckpt, dtype="bfloat16") as llm:
            dtypes = llm.apply_model(_expert_dtypes)[0]
            outs = llm.generate(prompts, params, use_tqdm=False)
        assert dtypes == {torch.uint8 if storage == "packed" else torch.bfloat16}
        runs[storage] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                   o.outputs[0].token_ids)])
                         for o in outs]
    assert runs["packed"] == runs["bf16"]
