"""Prefix caching over the hybrid caches (V4.1).

A second request that shares a 1100-token prefix with the first hits vLLM's prefix cache (hits land
on multiples of the scheduler block size, 512 tokens here) and must produce exactly the greedy tokens
of the same request computed from scratch: window KV, compressed KV, index keys, compressor state
and token history are all restored from cached blocks, and the open compressor group and Engram
look-back resume from them.
"""

from __future__ import annotations

from tests.conftest import engine, tiny_checkpoint
from tests.fidelity import prompt_ids

K16 = {"index_topk": 16, "candidate_topk_blocks": 4, "candidate_block_size": 8}


def _greedy(llm, ids: list[int]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]


def test_v41_prefix_cache_hit_matches_fresh_compute(ckpt_root):
    model_dir = tiny_checkpoint(ckpt_root, "v4.1-flash", 0, **K16)
    shared = prompt_ids(model_dir, 1100, 0)
    first, second = shared + prompt_ids(model_dir, 41, 3), shared + prompt_ids(model_dir, 57, 4)
    with engine(model_dir, enable_prefix_caching=False) as llm:
        expected = list(_greedy(llm, second).outputs[0].token_ids)
    with engine(model_dir, enable_prefix_caching=True) as llm:
        _greedy(llm, first)
        out = _greedy(llm, second)
    assert out.num_cached_tokens >= 1024, out.num_cached_tokens
    assert list(out.outputs[0].token_ids) == expected
