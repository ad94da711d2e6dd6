"""Fidelity of the plugin model in vLLM against independent implementations (issue 2).

* V4-Flash: HF transformers 5.19 `DeepseekV4ForCausalLM` (tests/reference/hf_v4.py).
* V4.1-Flash: the dense full-sequence reference written from the spec (tests/reference/dense_v41.py).

Three checkpoint seeds each, with `index_topk = 16` (and for V4.1 a 4 x 8 candidate filter) so that
the indexer's top-k and the two-level filter bite at these prompt lengths, plus one run of the
canonical selection sizes (k = 512, 80 x 8 blocks) at 1000 tokens. Prompt lengths cross the
128-token window and many compression boundaries (ratios 4 and 128 for V4, 2 and 1 for V4.1).

Tolerances (float32 engine vs float32 reference). Two fp32 implementations agree to ~5e-6 in
logprobs (summation order only). The exception is top-k selection: indexer scores are sums of
mixed-sign terms, so the implementations' ~1e-6 relative differences can reorder rows whose scores
are within ~1e-5 of each other (spec §7 Q18). Observed once (V4, seed 2, position 768, layer 2):
rows 51 and 53 score 0.6168753 / 0.6168799 here and 0.6168785 / 0.6168782 in transformers, so the
16th row differs and later positions shift by up to 0.03 nats. Hence: every position within
FP32_TOL except at most NEAR_TIE_SHARE of them, none beyond NEAR_TIE_TOL, and every greedy token
identical unless the reference's own top-2 margin at that step is below NEAR_TIE_TOL.

bfloat16 engine vs the float32 reference: random tiny models amplify rounding, and transformers'
own bf16 forward differs from its fp32 forward by up to 0.78 nats (mean 0.025 over the top-5 of a
300-token prompt). Required: mean difference < BF16_MEAN_TOL, and the same top-1 token wherever the
reference's top-1/top-2 margin exceeds BF16_MARGIN, above the 0.78-nat deviation of HF's own bf16 (closer
calls flip under bf16 rounding: 16% of prompt positions for tiny V4.1, two of them with margins 0.66 and 0.85).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import engine, tiny_checkpoint
from tests.fidelity import Comparison, compare, prompt_ids

FP32_TOL = 1e-3
NEAR_TIE_TOL = 0.1
NEAR_TIE_SHARE = 0.15
BF16_MEAN_TOL = 0.1
BF16_MARGIN = 1.0
LENGTHS = (37, 300, 1000)
N_NEW = 64
K16_V4 = {"index_topk": 16}
K16_V41 = {"index_topk": 16, "candidate_topk_blocks": 4, "candidate_block_size": 8}


def assert_fp32_agreement(c: Comparison, label) -> None:
    far = [d for d in c.prefill_diffs if d > FP32_TOL]
    assert len(far) <= NEAR_TIE_SHARE * len(c.prefill_diffs), (label, len(far), c.max_prefill_diff)
    assert c.max_prefill_diff < NEAR_TIE_TOL, (label, c.max_prefill_diff)
    unexplained = [m for m in c.mismatches if c.margins[m[0]] >= NEAR_TIE_TOL]
    assert not unexplained, (label, unexplained[:5])


def _run(arch, ref_cls, ckpt_root, seed, overrides, lengths):
    model_dir = tiny_checkpoint(ckpt_root, arch, seed, **overrides)
    ref = ref_cls(model_dir)
    with engine(model_dir) as llm:
        for n in lengths:
            assert_fp32_agreement(compare(llm, ref, prompt_ids(model_dir, n, seed), N_NEW), (arch, seed, n))


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
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.reference.dense_v41 import DenseV41
    from tests.reference.hf_v4 import HFV4

    overrides = K16_V4 if arch == "v4-flash" else K16_V41
    model_dir = tiny_checkpoint(ckpt_root, arch, 0, **overrides)
    prompt = prompt_ids(model_dir, 300, 0)
    ref = torch.log_softmax((HFV4 if arch == "v4-flash" else DenseV41)(model_dir).logits(prompt).float(), -1)
    with engine(model_dir, dtype="bfloat16") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    diffs, flips = [], []
    for i, top in enumerate(out.prompt_logprobs[1:]):
        diffs += [abs(lp.logprob - ref[i, tok].item()) for tok, lp in top.items()]
        ours_top1 = next(tok for tok, lp in top.items() if lp.rank == 1)
        best = ref[i].topk(2).values
        if ours_top1 != int(ref[i].argmax()) and float(best[0] - best[1]) > BF16_MARGIN:
            flips.append((i, float(best[0] - best[1])))
    assert sum(diffs) / len(diffs) < BF16_MEAN_TOL, sum(diffs) / len(diffs)
    assert not flips, flips
