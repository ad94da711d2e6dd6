"""Scheduling invariance of the hybrid caches (issue 2).

Chunked prefill with odd chunk sizes (groups of 2, 4 and 128 tokens and Engram n-grams span chunk
boundaries), a batch of mixed lengths, and forced preemption with recompute must all produce the
greedy tokens of each request run alone. Small selection sizes (index_topk 16, 4 x 8 candidate
blocks) make the indexer and the candidate filter active at these lengths.
"""

from __future__ import annotations

import gc

import pytest

from tests.conftest import make_llm, tiny_checkpoint
from tests.fidelity import prompt_ids

LENGTHS = (5, 37, 130, 301, 700)
N_NEW = 24
PREEMPT_BLOCKS = 160  # fits the longest request (chunks of 128 tokens), not all five at once
OVERRIDES = {
    "v4-flash": {"index_topk": 16},
    "v4.1-flash": {"index_topk": 16, "candidate_topk_blocks": 4, "candidate_block_size": 8},
}


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _close(llm) -> None:
    del llm
    gc.collect()


@pytest.fixture(scope="module", params=["v4-flash", "v4.1-flash"])
def case(request, ckpt_root):
    """(model dir, prompts, greedy tokens of each prompt run alone)."""
    model_dir = tiny_checkpoint(ckpt_root, request.param, 0, **OVERRIDES[request.param])
    prompts = [prompt_ids(model_dir, n, i) for i, n in enumerate(LENGTHS)]
    llm = make_llm(model_dir)
    alone = [_greedy(llm, [p])[0] for p in prompts]
    batched = _greedy(llm, prompts)
    _close(llm)
    return model_dir, prompts, alone, batched


def test_mixed_batch_matches_alone(case):
    _, _, alone, batched = case
    assert batched == alone


@pytest.mark.parametrize("chunk", [37, 200])
def test_chunked_prefill_matches_alone(case, chunk):
    model_dir, prompts, alone, _ = case
    llm = make_llm(model_dir, max_num_batched_tokens=chunk, max_num_seqs=4, enable_chunked_prefill=True)
    try:
        assert _greedy(llm, prompts) == alone
    finally:
        _close(llm)


def test_preemption_recompute_matches_alone(case):
    """A KV pool too small for the whole batch forces the scheduler to preempt and recompute."""
    model_dir, prompts, alone, _ = case
    llm = make_llm(model_dir, num_gpu_blocks_override=PREEMPT_BLOCKS, max_num_seqs=5, max_model_len=1024,
                   max_num_batched_tokens=128, enable_chunked_prefill=True)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preemptions = []
    original = scheduler._preempt_request

    def counting(request, *args, **kwargs):
        preemptions.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = counting
    try:
        assert _greedy(llm, prompts) == alone
    finally:
        _close(llm)
    assert preemptions, "the KV pool was large enough: no request was preempted"
