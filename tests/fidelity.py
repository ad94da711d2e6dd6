"""Comparison of the plugin running in vLLM against an independent full-sequence reference.

Prefill: vLLM's prompt logprobs (top-5 per position) against the reference's log-softmax.
Greedy: vLLM generates N tokens; the reference then scores prompt + generation in one forward
(teacher forcing) and must put its argmax on every generated token. By induction this is the
same as the reference's own greedy continuation being identical, at one forward's cost.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoTokenizer

PROMPT_TEXT = (
    "The morning was cold and clear, and the first light came slowly over the hills behind the old house. "
    "She opened the window, listened to the birds in the garden, and decided to write the letter. "
)


def prompt_ids(model_dir, n: int, seed: int = 0) -> list[int]:
    """`n` token ids of English text (a rotation picked by `seed`), no special tokens."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.encode(PROMPT_TEXT * 200, add_special_tokens=False)
    start = (seed * 97) % 500
    return ids[start:start + n]


@dataclasses.dataclass
class Comparison:
    prefill_diffs: list[float]             # max |logprob difference| over vLLM's top-5, per prompt position
    generated: list[int]
    mismatches: list[tuple[int, int, int]]  # (step, vLLM token, reference argmax)
    margins: list[float]                   # reference top-1 minus top-2 logit at each generated step

    @property
    def max_prefill_diff(self) -> float:
        return max(self.prefill_diffs)


def compare(llm, reference, prompt: list[int], n_new: int) -> Comparison:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, prompt_logprobs=5)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    generated = list(out.outputs[0].token_ids)
    logits = reference.logits(prompt + generated).float()
    logprobs = torch.log_softmax(logits, dim=-1)
    diffs = [max(abs(lp.logprob - logprobs[i, tok].item()) for tok, lp in top.items())
             for i, top in enumerate(out.prompt_logprobs[1:])]   # position i predicts prompt token i + 1
    cont = logits[len(prompt) - 1: len(prompt) - 1 + n_new]
    ref_next = cont.argmax(-1).tolist()
    mismatches = [(i, g, r) for i, (g, r) in enumerate(zip(generated, ref_next)) if g != r]
    top2 = cont.topk(2, dim=-1).values
    return Comparison(diffs, generated, mismatches, (top2[:, 0] - top2[:, 1]).tolist())
