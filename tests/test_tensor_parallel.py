"""Tensor parallel (`LLM(..., tensor_parallel_size=2)`, vLLM's multiprocessing executor) against one process.

Each rank owns half of the query heads, `attn_sink` entries and `wo_a` groups, a row slice of `wo_b`
(all-reduce), and half of the vocabulary of the embedding and LM head; everything else is replicated
(models/attention.py). On this CPU build TP=2 needs one OpenMP core per rank
(`VLLM_CPU_OMP_THREADS_BIND="0|1"`: vLLM refuses auto-binding with one NUMA node), and the workers are
spawned processes (minutes to start here). The all-reduce sums the two ranks' partial `wo_b` products,
a different summation order: greedy tokens must be identical, logprobs equal to 1e-4 (fp32).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import engine, tiny_checkpoint
from tests.fidelity import prompt_ids

LOGPROB_TOL = 1e-4


def _generate(ckpt, **overrides) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=prompt_ids(ckpt, n, seed=i)) for i, n in enumerate((37, 300))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    with engine(ckpt, max_model_len=1024, max_num_batched_tokens=1024, **overrides) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


_SINGLE: dict[str, list] = {}


@pytest.mark.parametrize("arch,storage", [("v4-flash", "bf16"), ("v4.1-flash", "bf16"), ("v4.1-flash", "packed")])
def test_tp2_matches_one_process(ckpt_root, monkeypatch, arch, storage):
    """`packed`: each rank loads its shard of the FP8 codes and E8M0 scale blocks (the one-process run keeps
    bf16: packed equals bf16 bitwise there, tests/test_fp8_linears.py)."""
    ckpt = tiny_checkpoint(ckpt_root, arch, 0)
    if arch not in _SINGLE:
        _SINGLE[arch] = _generate(ckpt)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("DEEPINFER_FP8_LINEARS", storage)
    tp2 = _generate(ckpt, tensor_parallel_size=2)
    for (tokens1, lps1), (tokens2, lps2) in zip(_SINGLE[arch], tp2):
        assert tokens2 == tokens1
        diff = max(abs(a[t] - b[t]) for a, b in zip(lps1, lps2) for t in a.keys() & b.keys())
        assert diff <= LOGPROB_TOL, diff


def test_tp_that_cannot_split_the_heads_is_refused(ckpt_root):
    """tiny V4.1 has 4 query heads and 2 wo_a groups: TP=4 is refused before any weight is loaded."""
    from vllm_deepinfer.config import ArchConfig, ConfigError

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0)
    arch = ArchConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    arch.check_tensor_parallel(2)
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 must divide .* o_groups \\(2\\)"):
        arch.check_tensor_parallel(4)
