"""Seeded-sampling statistics shared by the speculative-decoding tests (MTP in test_spec_decode.py, DSpark in
test_dspark.py): N_SAMPLES seeded requests of one prompt, and a chi-square homogeneity test per position."""

from __future__ import annotations

from collections import Counter

import torch

N_SAMPLES = 256
POSITIONS = (1, 2, 3)    # generated-token positions after the first (the first comes from the prompt's logits)
ALPHA = 0.01             # family-wise false-alarm rate: Bonferroni over POSITIONS, ALPHA / 3 per test


def seeded_samples(llm, temperature: float) -> list[list[int]]:
    """N_SAMPLES seeded requests of one prompt at `temperature`, chosen per checkpoint so that a few tokens per
    position carry the mass (tiny V4: logits of std ~32, temperature 2; tiny V4.1: top logits 0.02-0.6 apart,
    temperature 0.1) and the greedy drafts are accepted often but not always. No top-k: vLLM 0.32's CPU
    rejection sampler crashes on top-k in a step without drafts (NOTES.md)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=1 + max(POSITIONS), ignore_eos=True)
              for s in range(N_SAMPLES)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 140)))] * N_SAMPLES, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def chi2_homogeneity_p(a: list[int], b: list[int], min_pooled: int = 10) -> float:
    """p-value of the chi-square test that two samples of tokens come from one distribution (cells whose
    pooled count is below `min_pooled` are merged into one)."""
    ca, cb = Counter(a), Counter(b)
    cells, rest = [], [0, 0]
    for tok in sorted(set(ca) | set(cb)):
        if ca[tok] + cb[tok] >= min_pooled:
            cells.append((ca[tok], cb[tok]))
        else:
            rest = [rest[0] + ca[tok], rest[1] + cb[tok]]
    if sum(rest):
        cells.append(tuple(rest))
    if len(cells) < 2:
        return 1.0
    na, nb = len(a), len(b)
    stat = sum((x - (xa + xb) * n / (na + nb)) ** 2 / ((xa + xb) * n / (na + nb))
               for xa, xb in cells for x, n in ((xa, na), (xb, nb)))
    dof = torch.tensor((len(cells) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2.0, dtype=torch.float64)))


def assert_same_distribution(off: list[list[int]], on: list[list[int]]) -> None:
    """Per position of POSITIONS: the samples with speculation pass the homogeneity test against those without
    at ALPHA / len(POSITIONS) (false alarm <= ALPHA = 1 % in all, chi-square approximation)."""
    for pos in POSITIONS:
        a, b = [s[pos] for s in off], [s[pos] for s in on]
        assert len(set(a)) >= 2, f"position {pos}: no randomness to test"
        p = chi2_homogeneity_p(a, b)
        assert p > ALPHA / len(POSITIONS), f"position {pos}: p = {p:.2e}"
