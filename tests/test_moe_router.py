"""The MoE router (`moe.layer.DeepseekRouter`, the router vLLM's fused-MoE layer runs for this model).

Checked against an independent per-token float64 reference of model-spec §3.8 on random logits with
many exact ties (all-equal rows, pairwise-equal experts, a bias on a 0.1 grid): scores sqrt(softplus),
selection on score + bias with ties to the lower expert id, V4.1 image-span tokens [image_token_id, +5)
selecting with `bias_vl`, V4 hash layers taking `tid2eid[token]`; weights the unbiased scores
renormalised to `routed_scaling_factor`. Also through vLLM's entry point (`select_experts`: int32 ids,
fp32 weights). vLLM's own CPU router for DeepSeek V4 (`CPURouter`, the `biased_topk_cpu` /
`hash_topk_cpu` kernels) is compared where this vLLM build has those kernels; the CUDA router
(`fused_topk_bias`) in tests/gpu/test_moe_router_vllm.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vllm_deepinfer.moe.layer import IMAGE_TOKEN_SPAN, DeepseekRouter, Gate

T, E, K, SCALE, IMG = 48, 16, 6, 1.5, 100


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    logits[:6] = 0.0                          # every expert ties
    logits[6:12, 1::2] = logits[6:12, ::2]    # pairs of equal experts
    return logits


def _gate(seed: int, hash_routed: bool, bias_vl: bool, experts: int = E) -> Gate:
    g = torch.Generator().manual_seed(seed)
    gate = Gate(8, experts, 200, K, hash_routed, with_bias_vl=bias_vl)
    if hash_routed:
        gate.tid2eid.copy_(torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(200)]))
    else:
        gate.bias.data = (torch.randn(experts, generator=g) * 0.2).round(decimals=1)  # ties of score + bias
        if bias_vl:
            gate.bias_vl.data = (torch.randn(experts, generator=g) * 0.2).round(decimals=1)
    return gate


def dense_route(logits, token_ids, gate: Gate, image_token_id: int):
    """Per token, float64 weights; selection compares the float32 biased scores (as the model does)."""
    ids, weights = [], []
    for t in range(logits.shape[0]):
        s32 = torch.sqrt(F.softplus(logits[t].float()))
        tok = int(token_ids[t])
        if gate.tid2eid is not None:
            sel = [int(e) for e in gate.tid2eid[tok]]
        else:
            vl = gate.bias_vl is not None and image_token_id <= tok < image_token_id + IMAGE_TOKEN_SPAN
            key = (s32 + (gate.bias_vl if vl else gate.bias)).tolist()
            sel = sorted(range(E), key=lambda e: (-key[e], e))[:K]   # ties: lower id first
        s = [math.sqrt(math.log1p(math.exp(float(logits[t, e])))) for e in sel]
        ids.append(sel)
        weights.append([SCALE * v / sum(s) for v in s])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["biased", "bias_vl", "hash"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_router_matches_dense_reference(kind, seed):
    gate = _gate(seed, kind == "hash", kind == "bias_vl")
    router = DeepseekRouter(gate, K, SCALE, IMG if kind == "bias_vl" else -1, eplb_state=None)
    logits = _logits(seed)
    token_ids = torch.randint(0, 200, (T,), generator=torch.Generator().manual_seed(seed))
    token_ids[::3] = IMG + torch.arange(T)[::3] % (IMAGE_TOKEN_SPAN + 1)  # image span and the id just past it
    ids, weights = router.route(logits, token_ids)
    want_ids, want_w = dense_route(logits, token_ids, gate, IMG)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights.double(), want_w, rtol=1e-6, atol=0)


def test_router_through_vllm_entry_point():
    """select_experts (what vLLM's runner calls): int32 ids in the order of `route`, fp32 weights."""
    gate = _gate(0, False, True)
    router = DeepseekRouter(gate, K, SCALE, IMG, eplb_state=None)
    logits, token_ids = _logits(0), torch.full((T,), IMG + 2)
    weights, ids = router.select_experts(torch.zeros(T, 8), logits, torch.int32, input_ids=token_ids)
    want_ids, want_w = router.route(logits, token_ids)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids) and torch.equal(weights, want_w)
    with pytest.raises(ValueError, match="token ids"):
        router.select_experts(torch.zeros(T, 8), logits)


@pytest.mark.parametrize("kind", ["biased", "hash"])
def test_vllm_cpu_router(kind):
    """vLLM's CPU DeepSeek-V4 router, where the build has its AVX-512 kernels: same expert sets and weights
    (selection order and exact ties are not promised by its kernel: it is compared, not used). Its kernels take
    64, 128, 256 or 384 experts only ("biased_topk_cpu: unsupported num_experts 16" otherwise, vLLM 0.32 on an
    AVX-512 box), so this uses 64."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    if not hasattr(torch.ops._C, "biased_topk_cpu"):
        pytest.skip("this vLLM CPU build has no biased_topk_cpu/hash_topk_cpu kernels: vLLM's CPU router "
                    "cannot route DeepSeek V4 here (the plugin's router runs instead)")
    experts = 64
    gate = _gate(3, kind == "hash", False, experts)
    logits = torch.randn(T, experts, generator=torch.Generator().manual_seed(3))   # no ties: sets are comparable
    token_ids = torch.randint(0, 200, (T,))
    vllm_router = CPURouter(top_k=K, global_num_experts=experts, renormalize=True, scoring_func="sqrtsoftplus",
                            routed_scaling_factor=SCALE, e_score_correction_bias=gate.bias,
                            hash_indices_table=None if gate.tid2eid is None else gate.tid2eid.int())
    w, i = vllm_router._compute_routing(None, logits, None, input_ids=token_ids)
    ids, weights = DeepseekRouter(gate, K, SCALE, -1, None).route(logits, token_ids)
    dense = lambda ii, ww: torch.zeros(T, experts).scatter_(1, ii.long(), ww.float())
    assert torch.allclose(dense(i, w), dense(ids, weights), rtol=1e-6, atol=1e-7)
