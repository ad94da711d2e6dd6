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

A drafter whose drafts never pay (a poor match for the traffic) still costs its block every step. `ColdDrafter`
skips the block once no draft has paid for `patience` proposals in a row, and probes it again after an interval
that doubles while the probes fail (a new request brings the next probe forward, once between two scheduled
probes). Skipping is lossless: a skipped proposal's drafts are never verified, and the drafter still stores its
context rows of every step's tokens, so a probe drafts from a complete window.

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


class ColdDrafter:
    """When to run the drafter's block (batch level; module docstring).

    `step()` is asked once per proposal and returns what it is: RUN (hot: every block runs), PROBE (the first
    block of a probe), MORE (the probe's further blocks) or SKIP (context rows only, nothing to verify). For a
    RUN or PROBE proposal the caller reports `paid(kind, any_paid)`: whether the policy chose any of its drafts
    for the verification they pay for (slots a padded CUDA graph computes for free do not count). `probe_len`
    blocks make one probe: 1 where the lengths come from the proposal's own estimates (our V1 policy), 2 under
    vLLM's V2 adaptive verification, whose draft budget for a step reads the estimates of the proposal before
    the one it verifies."""

    RUN, PROBE, MORE, SKIP = "run", "probe", "more", "skip"

    def __init__(self, patience: int = 4, first_interval: int = 4, max_interval: int = 128, probe_len: int = 1):
        self.patience, self.first_interval, self.max_interval = patience, first_interval, max_interval
        self.probe_len = probe_len
        self.unpaid = 0            # consecutive unpaid RUN proposals
        self.cold = False
        self.interval = first_interval
        self.wait = 0              # proposals to skip before the next probe
        self.more = 0              # MORE blocks of the current probe still to run
        self.early_allowed = True   # a new request may still bring the next probe forward (once per probe)
        self.early_pending = False  # the next probe was brought forward
        self.proposals = 0         # proposals asked about so far (for logs and tests)
        self.skipped = 0           # of which skipped

    def step(self) -> str:
        self.proposals += 1
        if not self.cold:
            return self.RUN
        if self.more > 0:
            self.more -= 1
            return self.MORE
        if self.wait > 0:
            self.wait -= 1
            self.skipped += 1
            return self.SKIP
        self.more = self.probe_len - 1
        self.early_allowed, self.early_pending = not self.early_pending, False
        return self.PROBE

    def paid(self, kind: str, any_paid: bool) -> None:
        """The outcome of a RUN or PROBE proposal (class docstring). A RUN block still in flight when the drafter
        turned cold (V2's stale estimates) only counts if it paid."""
        if any_paid:
            self.cold, self.unpaid, self.interval, self.more = False, 0, self.first_interval, 0
        elif kind == self.PROBE:  # a failed probe
            self.interval = min(2 * self.interval, self.max_interval)
            self.wait = self.interval
        elif not self.cold:
            self.unpaid += 1
            if self.unpaid >= self.patience:
                self.cold, self.unpaid, self.wait = True, 0, self.interval

    def new_request(self) -> None:
        """A request joined: probe within `first_interval` proposals, at most once between two scheduled probes
        (under steady arrivals the probes stay at the interval); the interval itself is kept."""
        if self.cold and self.early_allowed and self.wait > self.first_interval:
            self.wait, self.early_allowed, self.early_pending = self.first_interval, False, True


__all__ = ["ColdDrafter", "VerifyCost", "choose_lengths", "draft_survival", "no_slot_pays"]
