"""Fidelity of the plugin model in vLLM against independent implementations (issue 2).

* V4-Flash: HF transformers 5.19 `DeepseekV4ForCausalLM` (tests/reference/hf_v4.py).
* V4.1-Flash: the dense full-sequence reference written from the spec (tests/reference/dense_v41.py).

Three checkpoint seeds each, with `index_topk = 16` (and for V4.1 a 4 x 8 candidate filter) so that
the indexer's top-k and the two-level filter bite at these prompt lengths, plus one run of the
canonical selection sizes (k = 512, 80 x 8 blocks) at 1000 tokens. Prompt lengths cross the
128-token window and many compression boundaries (ratios 4 and 128 for V4, 2 and 1 for V4.1).

Tolerances. float32 engine vs float32 reference: every top-5 prompt logprob within 1e-3 (measured
~5e-6: only summation order differs) and all 64 greedy tokens identical. bfloat16 engine vs the
float32 reference: within 0.25 nats (measured ~0.05; bf16 keeps 8 mantissa bits, so each of the
~40 rounded sublayer outputs adds ~0.4% relative noise to the streams, which the head turns into
logit noise of a few hundredths), and the greedy tokens match where the reference's top-2 margin
exceeds that noise.
"""

from __future__ import annotations

import gc

import pytest

from tests.conftest import make_llm, tiny_checkpoint
from tests.fidelity import compare, prompt_ids

FP32_TOL = 1e-3
BF16_TOL = 0.25
LENGTHS = (37, 300, 1000)
N_NEW = 64
K16_V4 = {"index_topk": 16}
K16_V41 = {"index_topk": 16, "candidate_topk_blocks": 4, "candidate_block_size": 8}


def _check(llm, ref, model_dir, lengths, seed):
    for n in lengths:
        c = compare(llm, ref, prompt_ids(model_dir, n, seed), N_NEW)
        assert c.max_prefill_logprob_diff < FP32_TOL, (n, c.max_prefill_logprob_diff)
        assert not c.mismatches, (n, c.mismatches[:5])


def _run(arch, ref_cls, ckpt_root, seed, overrides, lengths):
    model_dir = tiny_checkpoint(ckpt_root, arch, seed, **overrides)
    ref = ref_cls(model_dir)
    llm = make_llm(model_dir)
    try:
        _check(llm, ref, model_dir, lengths, seed)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_v4_matches_transformers(ckpt_root, seed):
    from tests.reference.hf_v4 import HFV4

    _run("v4-flash", HFV4, ckpt_root, seed, K16_V4, LENGTHS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_v41_matches_dense_reference(ckpt_root, seed):
    from tests.reference.dense_v41 import DenseV41

    _run("v4.1-flash", DenseV41, ckpt_root, seed, K16_V41, LENGTHS)


def test_v41_canonical_selection_sizes(ckpt_root):
    """index_topk 512 and 80 x 8 candidate blocks: both bite at 1000 tokens (ratio-1 rows > 640)."""
    from tests.reference.dense_v41 import DenseV41

    _run("v4.1-flash", DenseV41, ckpt_root, 0, {}, (1000,))


@pytest.mark.parametrize("arch", ["v4-flash", "v4.1-flash"])
def test_bfloat16_within_tolerance(ckpt_root, arch):
    from tests.reference.dense_v41 import DenseV41
    from tests.reference.hf_v4 import HFV4

    overrides = K16_V4 if arch == "v4-flash" else K16_V41
    model_dir = tiny_checkpoint(ckpt_root, arch, 0, **overrides)
    ref = (HFV4 if arch == "v4-flash" else DenseV41)(model_dir)
    llm = make_llm(model_dir, dtype="bfloat16")
    try:
        c = compare(llm, ref, prompt_ids(model_dir, 300, 0), N_NEW)
    finally:
        del llm
        gc.collect()
    assert c.max_prefill_logprob_diff < BF16_TOL, c.max_prefill_logprob_diff
    close_calls = [c.margins[i] for i, _, _ in c.mismatches]
    assert all(m < 2 * BF16_TOL for m in close_calls), (c.mismatches, close_calls)
