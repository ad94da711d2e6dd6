"""Scheduling invariance of the hybrid caches (issue 2).

Chunked prefill with odd chunk sizes (groups of 2, 4 and 128 tokens and Engram n-grams span chunk
boundaries), a batch of mixed lengths, and forced preemption with recompute must all produce the
greedy tokens of each request run alone. Small selection sizes (index_topk 16, 4 x 8 candidate
blocks) make the indexer and the candidate filter active at these lengths.
"""

from __future__ import annotations

import pytest

from tests.conftest import engine, recorded_preemptions, tiny_checkpoint
from tests.fidelity import prompt_ids

LENGTHS = (5, 37, 130, 301, 700)
N_NEW = 24
# Any one request fits, six long decodes do not. vLLM refuses to start unless one max_model_len request fits
# its per-request admission cap (per group: cdiv(sliding_window - 1 + in-flight tokens, block_size) + 1 blocks).
# V4.1 runs bounded replay by default (vLLM's swa_bounded_replay) and, with prefix caching on, its ten
# sliding-window caches up to the cut retain keep = 382 more tokens (`PagedCache.retain_tokens`), which
# raises that cap for a 1024-token request from 106 to 176 blocks. Those windows (>= 384 tokens) then
# free nothing for these <= 255-token requests, so each holds ~67 blocks at its end: six need over twice the pool.
PREEMPT_BLOCKS = {"v4-flash": 80, "v4.1-flash": 180}
PREEMPT_NEW = 160
OVERRIDES = {
    "v4-flash": {"index_topk": 16},
    "v4.1-flash": {"index_topk": 16, "candidate_topk_blocks": 4, "candidate_block_size": 8},
}


def _greedy(llm, prompts: list[list[int]], n_new: int = N_NEW) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["v4-flash", "v4.1-flash"])
def case(request, ckpt_root):
    """(arch, model dir, prompts, greedy tokens of each prompt alone, greedy tokens of the batch, the preemption
    prompts and their greedy tokens on this engine's pool, which holds them all at once)."""
    model_dir = tiny_checkpoint(ckpt_root, request.param, 0, **OVERRIDES[request.param])
    prompts = [prompt_ids(model_dir, n, i) for i, n in enumerate(LENGTHS)]
    preempt = [prompt_ids(model_dir, 60 + 7 * i, i) for i in range(6)]
    with engine(model_dir) as llm:
        alone = [_greedy(llm, [p])[0] for p in prompts]
        batched = _greedy(llm, prompts)
        unpreempted = _greedy(llm, preempt, PREEMPT_NEW)
    return request.param, model_dir, prompts, alone, batched, preempt, unpreempted


def test_mixed_batch_matches_alone(case):
    _, _, _, alone, batched, *_ = case
    assert batched == alone


@pytest.mark.parametrize("chunk", [37, 200])
def test_chunked_prefill_matches_alone(case, chunk):
    _, model_dir, prompts, alone, *_ = case
    with engine(model_dir, max_num_batched_tokens=chunk, max_num_seqs=4, enable_chunked_prefill=True) as llm:
        assert _greedy(llm, prompts) == alone


def test_preemption_recompute_matches_unpreempted(case):
    """A KV pool too small for six long decodes at once forces preemption and recompute.

    The pool holds every request alone; in the batch, decodes that cross window-block boundaries need
    blocks that are not there, so the scheduler preempts running requests and recomputes them later. The
    tokens equal the same batch on the default pool, where nothing is preempted (and mixed batches equal
    each request alone: `test_mixed_batch_matches_alone`).
    """
    arch, model_dir, *_, prompts, unpreempted = case
    with engine(model_dir, num_gpu_blocks_override=PREEMPT_BLOCKS[arch], max_num_seqs=6, max_model_len=1024,
                max_num_batched_tokens=128, enable_chunked_prefill=True) as llm:
        with recorded_preemptions(llm) as preempted:
            assert _greedy(llm, prompts, PREEMPT_NEW) == unpreempted
    assert preempted, "the KV pool was large enough: no request was preempted"
