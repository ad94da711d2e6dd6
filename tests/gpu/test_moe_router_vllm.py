"""The plugin's router (`moe.layer.DeepseekRouter`) vs vLLM's CUDA DeepSeek-V4 router (`fused_topk_bias`:
`dsv4_topk` / `topk_hash_softplus_sqrt`), on the GPU. Needs vLLM 0.32 (staged: `source shared/gpu/env.sh`).

Random logits without ties: same expert sets and weights (rel 1e-5). With exact ties (all-equal rows): the
plugin picks the lower expert ids; vLLM's kernels promise no order, so the test reports whether they agree
(printed) instead of asserting it: this is the check behind using our router rather than vLLM's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

pytestmark = pytest.mark.gpu

T, E, K, SCALE, IMG = 256, 384, 6, 1.5, 1000


def _dense(ids, w):
    return torch.zeros(ids.shape[0], E, device=ids.device).scatter_(1, ids.long(), w.float())


@pytest.mark.parametrize("kind", ["biased", "bias_vl", "hash"])
def test_router_matches_vllm_cuda(kind):
    from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import fused_topk_bias

    from vllm_deepinfer.moe.layer import DeepseekRouter, Gate

    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.device(dev):
        gate = Gate(8, E, 4096, K, kind == "hash", with_bias_vl=kind == "bias_vl")
    if kind == "hash":
        gate.tid2eid.copy_(torch.rand(4096, E, device=dev, generator=g).argsort(1)[:, :K])
    else:
        gate.bias.data = torch.randn(E, device=dev, generator=g) * 0.1
        if gate.bias_vl is not None:
            gate.bias_vl.data = torch.randn(E, device=dev, generator=g) * 0.1
    token_ids = torch.randint(0, 4096, (T,), device=dev, generator=g)
    token_ids[::4] = IMG + 2
    router = DeepseekRouter(gate, K, SCALE, IMG if kind == "bias_vl" else -1, None)
    for ties in (False, True):
        logits = torch.randn(T, E, device=dev, generator=g)
        if ties:
            logits[:, :] = 0.5
        ids, w = router.route(logits, token_ids)
        vw, vids = fused_topk_bias(
            hidden_states=logits, gating_output=logits, scoring_func="sqrtsoftplus",
            e_score_correction_bias=gate.bias, topk=K, renormalize=True, indices_type=torch.int32,
            input_tokens=token_ids.int(), hash_indices_table=None if gate.tid2eid is None else gate.tid2eid.int(),
            routed_scaling_factor=SCALE, bias_vl=gate.bias_vl, image_sentinel_lo=IMG if gate.bias_vl is not None else 0)
        same = torch.allclose(_dense(ids, w), _dense(vids, vw), rtol=1e-5, atol=1e-6)
        print(f"{kind} ties={ties}: vLLM's CUDA router {'agrees' if same else 'DIFFERS'}")
        if not ties or kind == "hash":
            assert same
