"""Expert parallelism over the tensor-parallel group through vLLM's fused-MoE layer on CPU.

TP=2 with `enable_expert_parallel=True`: each rank owns 4 of the 8 experts and computes attention
replicated on this branch; the greedy tokens of the tiny V4 (hash layers) and V4.1 checkpoints in fp32
must equal one process's, logprobs to 1e-4 (the ranks' partial sums add in another order).
Data parallel + expert parallel (`vllm serve --data-parallel-size 2 --enable-expert-parallel`) is
tests/test_data_parallel.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import engine, tiny_checkpoint

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 40, 130)]


def _generate(llm):
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, logprobs=1), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)])
            for o in outs]


def _placement(model):
    """Per rank: MixtureOfExperts protocol live, MoE layer count, local experts and their global ids."""
    from vllm.model_executor.models.interfaces import is_mixture_of_experts

    experts = model.moe_layers[0].routed_experts
    return (is_mixture_of_experts(model), model.num_moe_layers, experts.local_num_experts,
            [g for g, slot in enumerate(experts.expert_map.tolist()) if slot >= 0])


@pytest.mark.parametrize("arch", ["v4-flash", "v4.1-flash"])
def test_expert_parallel_tp2_matches_one_process(ckpt_root, arch, monkeypatch):
    ckpt = tiny_checkpoint(ckpt_root, arch)
    with engine(ckpt, max_model_len=2048, max_num_batched_tokens=2048) as llm:
        want = _generate(llm)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with engine(ckpt, max_model_len=2048, max_num_batched_tokens=2048, tensor_parallel_size=2,
                enable_expert_parallel=True) as llm:
        ranks = llm.apply_model(_placement)
        got = _generate(llm)
    n_layers = ranks[0][1]
    assert ranks == [(True, n_layers, 4, [0, 1, 2, 3]), (True, n_layers, 4, [4, 5, 6, 7])]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb)) < 1e-4
