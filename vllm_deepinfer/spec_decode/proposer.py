"""Draft-length policy state of one MTP drafter under vLLM's V1 runner.

vLLM's `EagleProposer` drafts K = num_speculative_tokens tokens per request each step. For every
draft step the proposer's sampling hook (`patches/mtp_draft_lengths.py`) calls `record` with the
draft logits and the drafted tokens; `finish` turns them into prefix-survival estimates [B, K]
(`schedule.draft_survival`: running product of the drafter's own probability of each drafted token;
the MTP block has no confidence head). When the runner hands the drafts to the scheduler
(`take_draft_token_ids`), `trim` cuts each request's list to `schedule.choose_lengths` (varlen on,
DEEPINFER_ENABLE_MTP_VARLEN=1) or keeps K (off). The scheduler then schedules exactly the kept
drafts (`len(request.spec_token_ids)`), so vLLM's own spec-decode metrics (drafts, draft tokens,
accepted tokens per position) count the verified lengths; `length_counts` and a periodic log line
add the distribution of chosen lengths, zeros included.
"""

from __future__ import annotations

import os

import torch

from vllm_deepinfer.log import get_logger
from vllm_deepinfer.spec_decode.schedule import VerifyCost, choose_lengths, draft_survival

logger = get_logger(__name__)

VARLEN_ENV = "DEEPINFER_ENABLE_MTP_VARLEN"
LOG_EVERY = 200  # steps between draft-length log lines


def varlen_enabled(environ: dict[str, str] | None = None) -> bool:
    from vllm_deepinfer.serving.settings import OFF_VALUES

    value = (os.environ if environ is None else environ).get(VARLEN_ENV, "0")
    return value.strip().lower() not in OFF_VALUES


class DraftLengthPolicy:
    """Survival estimates of the last proposal and the per-request trimming of its drafts."""

    def __init__(self, num_speculative_tokens: int, varlen: bool, cost: VerifyCost = VerifyCost()):
        self.max_len, self.varlen, self.cost = num_speculative_tokens, varlen, cost
        self._probs: list[torch.Tensor] = []
        self.survival: torch.Tensor | None = None   # [B, K] of the last proposal
        self.length_counts = [0] * (num_speculative_tokens + 1)
        self.steps = 0

    def start(self) -> None:
        self._probs, self.survival = [], None

    def record(self, logits: torch.Tensor, token_ids: torch.Tensor, probs: torch.Tensor | None) -> None:
        """One draft step: logits [B, V]; token_ids [B] drafted; probs [B, V] the draft distribution the
        tokens were sampled from (None: greedy drafting, then softmax(logits))."""
        dist = torch.softmax(logits.float(), dim=-1) if probs is None else probs.float()
        self._probs.append(dist.gather(1, token_ids.long().unsqueeze(1)).squeeze(1))

    def finish(self) -> None:
        if self._probs:
            self.survival = draft_survival(torch.stack(self._probs, dim=1)).cpu()
        self._probs = []

    def trim(self, drafts: list[list[int]]) -> list[list[int]]:
        """drafts: per request of the last proposal (batch order) -> the prefixes to verify."""
        if self.varlen and self.survival is not None and drafts:
            lengths = choose_lengths(self.survival[: len(drafts)], len(drafts), self.cost).tolist()
            drafts = [d[:n] for d, n in zip(drafts, lengths)]
        for d in drafts:
            self.length_counts[min(len(d), self.max_len)] += 1
        self.steps += 1
        if self.steps % LOG_EVERY == 0:
            total = sum(self.length_counts)
            mean = sum(n * c for n, c in enumerate(self.length_counts)) / max(total, 1)
            logger.info("vllm-deepinfer MTP draft lengths (%s): mean %.2f, counts by length %s",
                        "varlen" if self.varlen else "fixed", mean, self.length_counts)
        return drafts


__all__ = ["DraftLengthPolicy", "VARLEN_ENV", "varlen_enabled"]
