"""Confidence-scheduled verification: how many draft tokens of each request the target verifies.

Inputs: `survival` [B, K], where survival[r, i] estimates the probability that request r's draft
prefix d_1..d_{i+1} is accepted (non-increasing along i), and the batch size B. A step that verifies
k_r drafts of request r feeds the target n = sum_r (1 + k_r) tokens and is expected to emit

    E[tokens] = sum_r (1 + sum_{i < k_r} survival[r, i])        (one bonus/corrected token per request)

in step time `cost.step_time(n)`. The policy picks the lengths k_r that maximise the expected rate
E[tokens] / step_time(n). With a linear step time a + b*n this is a fractional knapsack over the
(request, position) slots: taking the slots in descending survival, a slot pays while its survival
exceeds the rate it joins times b, i.e. s > E_so_far * b / (a + b * n_so_far). Because each row is
non-increasing, the chosen slots of a request always form a prefix, so k_r is a count. Plain decode
(k_r = 0 for all r) is the empty choice; the policy picks it whenever no draft pays for its verification.
Under CUDA graphs the target computes the step padded to a captured size (`patches/varlen_graphs.py`), so
the slots between n and that size are free: the next best drafts fill them.

Survival sources: the V4 MTP drafter has no confidence head, so `spec_decode/proposer.py` feeds the
running product of the drafter's own probability of each drafted token (`draft_survival`); the V4.1
DSpark confidence head's per-position sigmoid outputs feed the same function through the same product.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class VerifyCost:
    """Target step time a + b * n for a step of n tokens (any time unit; only b / a matters).

    Defaults: decode step times of the V4.1 protocol benchmark on one H200 (NOTES.md, final code:
    batch 1 4.66 ms, batch 64 9.07 ms), i.e. a = 4.6 ms fixed (weights, launches) and b = 0.07 ms per token.
    """

    fixed: float = 4.6
    per_token: float = 0.07

    def step_time(self, num_tokens: int | torch.Tensor) -> float | torch.Tensor:
        return self.fixed + self.per_token * num_tokens


def draft_survival(token_probs: torch.Tensor) -> torch.Tensor:
    """token_probs [B, K] (per-position acceptance estimates in [0, 1]) -> prefix survival [B, K],
    survival[:, i] = prod_{j <= i} token_probs[:, j]."""
    return torch.cumprod(token_probs.float().clamp(0.0, 1.0), dim=1)


def _pays(value: float, tokens: float, n: int, cost: VerifyCost) -> bool:
    """Whether verifying one more slot of survival `value` raises the rate of a step that verifies `n` tokens
    and expects `tokens`: (tokens + value) / step_time(n + 1) > tokens / step_time(n)."""
    return value * cost.step_time(n) > tokens * cost.per_token


def no_slot_pays(survival: torch.Tensor, batch_size: int, cost: VerifyCost = VerifyCost()) -> bool:
    """survival [B] of one draft position -> whether none of them pays even as the first slot of the step.

    The threshold a slot must beat only rises as slots are taken (each taken slot lifts the rate above the
    old one), so the first slot's threshold is the lowest: when no request passes it at position i, rows
    being non-increasing, `choose_lengths` verifies no position >= i (the MTP loop stops drafting there)."""
    return not _pays(float(survival.detach().float().max()), batch_size, batch_size, cost)


def choose_lengths(survival: torch.Tensor, batch_size: int, cost: VerifyCost = VerifyCost(),
                   min_len: int = 0, padded: Callable[[int], int] | None = None) -> torch.Tensor:
    """survival [B, K] (non-increasing rows) -> draft tokens to verify per request [B] (int64, min_len..K).

    `batch_size` is the number of requests in the step (B here; the cost of their bonus tokens is the
    plain-decode baseline). Greedy fractional knapsack on the expected rate (module docstring).
    `padded(n)`: the tokens the target will actually compute for a step of n tokens (a captured CUDA graph
    pads the step to its size; None: n). Slots up to that size cost nothing, so after the knapsack the next
    best slots fill them.
    """
    b, k = survival.shape
    m = min(min_len, k)
    lengths = torch.full((b,), m, dtype=torch.int64)
    s = survival.detach().float().cpu()
    tokens = batch_size + float(s[:, :m].sum())   # expected tokens of the step so far
    n = batch_size + b * m                         # tokens the target verifies so far
    order = torch.argsort(s[:, m:].flatten(), descending=True, stable=True)
    free = None  # once the knapsack stops: slots the padded step computes anyway
    for flat in order.tolist():
        r, i = divmod(flat, k - m)
        value = float(s[r, m + i])
        if free is None and not _pays(value, tokens, n, cost):  # this slot (and every later one) lowers the rate
            free = (n if padded is None else padded(n)) - n
        if free is not None:
            if free <= 0 or value <= 0.0:
                break
            free -= 1
        tokens += value
        n += 1
        lengths[r] += 1
    return lengths


__all__ = ["VerifyCost", "choose_lengths", "draft_survival", "no_slot_pays"]
