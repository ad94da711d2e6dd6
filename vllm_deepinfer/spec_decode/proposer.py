"""Draft-length policy state of one DeepInfer drafter (MTP or DSpark) under vLLM's V1 runner.

Survival estimates [B, K] of each proposal:

* MTP (vLLM's `EagleProposer` loop, K steps): the proposer's sampling hook (`patches/draft_lengths.py`) calls
  `record` with each step's draft logits and tokens; `finish` turns them into the running product of the
  drafter's own probability of each drafted token (`schedule.draft_survival`; the MTP block has no
  confidence head). With varlen on, the hook asks `exhausted()` after every step: once no request's next
  slot can pay for its verification (its survival is below the lowest threshold of `choose_lengths`), the
  later steps cannot change the chosen lengths, so the loop stops there (`StopDrafting`) and the missing
  positions are padded with survival 0 (never verified).
* DSpark (one block per proposal): `observe` with the confidence head's per-position c_k. With varlen on (and no
  data parallelism, whose ranks must agree on every block), `cold` (`schedule.ColdDrafter`) decides per
  proposal whether the block runs (`block_runs`); a skipped proposal stores only its context rows and `skip`
  gives it survival 0, so none of its drafts is verified.

When the runner hands the drafts to the scheduler (`take_draft_token_ids`), `trim` cuts each request's list
to `schedule.choose_lengths` (varlen on, DEEPINFER_ENABLE_MTP_VARLEN=1) or keeps K (off). The scheduler then
schedules exactly the kept drafts (`len(request.spec_token_ids)`), so vLLM's own spec-decode metrics (drafts,
draft tokens, accepted tokens per position) count the verified lengths; `length_counts`, `draft_steps` and a
periodic log line add the distribution of chosen lengths (zeros included) and the drafter steps run.
"""

from __future__ import annotations

import os
from collections.abc import Collection

import torch

from vllm_deepinfer.log import get_logger
from vllm_deepinfer.spec_decode.schedule import ColdDrafter, VerifyCost, choose_lengths, draft_survival, no_slot_pays

logger = get_logger(__name__)

VARLEN_ENV = "DEEPINFER_ENABLE_MTP_VARLEN"
COLD_ENV = "VLLM_DEEPINFER_COLD_DRAFTER"  # 0: DSpark's block runs on every proposal (`schedule.ColdDrafter`)
LOG_EVERY = 200  # steps between draft-length log lines


def varlen_enabled(environ: dict[str, str] | None = None) -> bool:
    from vllm_deepinfer.serving.settings import OFF_VALUES

    value = (os.environ if environ is None else environ).get(VARLEN_ENV, "0")
    return value.strip().lower() not in OFF_VALUES


def varlen_requested(speculative_config) -> bool:
    """Varlen asked for: DEEPINFER_ENABLE_MTP_VARLEN, or `enable_adaptive_verification` in the speculative config."""
    return varlen_enabled() or bool(speculative_config.enable_adaptive_verification)


def cold_drafter_enabled(vllm_config) -> bool:
    """Whether DSpark with confidence-scheduled verification may skip its block (`schedule.ColdDrafter`): unless
    VLLM_DEEPINFER_COLD_DRAFTER=0, and not under data parallelism, where every rank must join every block's
    expert-parallel collectives."""
    return os.environ.get(COLD_ENV, "1") != "0" and vllm_config.parallel_config.data_parallel_size == 1


def policy_for(vllm_config, kind: str) -> DraftLengthPolicy:
    """The policy of a drafter built in `vllm_config` (K = num_speculative_tokens; varlen from
    DEEPINFER_ENABLE_MTP_VARLEN or vLLM's own `enable_adaptive_verification` in the speculative config), after
    installing the V1 hooks a DeepInfer drafter needs: `patches/draft_lengths.py`, on CPU
    `patches/cpu_spec_expand.py` (the rejection sampler's per-token parameters), and with varlen
    `patches/varlen_graphs.py` (trimmed verification steps replay full CUDA graphs).
    Varlen needs the drafts before the next step is scheduled: under async scheduling the scheduler places
    K placeholders first, so varlen falls back to the fixed length there, with a warning."""
    from vllm_deepinfer.patches import cpu_spec_expand, draft_lengths

    draft_lengths.apply()
    if torch.device(vllm_config.device_config.device).type == "cpu":
        cpu_spec_expand.apply()
    spec = vllm_config.speculative_config
    k, varlen = spec.num_speculative_tokens, varlen_requested(spec)
    if varlen and vllm_config.scheduler_config.async_scheduling:
        logger.warning("vllm-deepinfer %s: %s=1 needs synchronous scheduling (--no-async-scheduling); "
                       "verifying the fixed length %d", kind, VARLEN_ENV, k)
        varlen = False
    if varlen:
        from vllm_deepinfer.patches import varlen_graphs

        varlen_graphs.apply()
    return DraftLengthPolicy(k, varlen)


class StopDrafting(Exception):
    """Raised by the MTP sampling hook when `DraftLengthPolicy.exhausted()`: the remaining steps are skipped."""


class DraftLengthPolicy:
    """Survival estimates of the last proposal and the per-request trimming of its drafts."""

    def __init__(self, num_speculative_tokens: int, varlen: bool, cost: VerifyCost = VerifyCost()):
        self.max_len, self.varlen, self.cost = num_speculative_tokens, varlen, cost
        self._probs: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []
        self._dists: list[torch.Tensor | None] = []
        self.survival: torch.Tensor | None = None   # [B, K] of the last proposal (device; read by `trim` when varlen)
        self.length_counts = [0] * (num_speculative_tokens + 1)
        self.draft_steps = 0                         # drafter steps run (MTP: forwards of the block)
        self.steps = 0
        # batch-invariant mode: the step's per-request seeds [B] (set by patches/seeded_sampler.py) and the
        # position of each request's first draft [B] (set around `propose`), for drafts coupled to the
        # target's seeded draws
        self.seeds: torch.Tensor | None = None
        self.first_pos: torch.Tensor | None = None
        # the target runner's full-graph keys (`patches/varlen_graphs.py`, set where the runner hands the drafts
        # over): a verification step is padded to the smallest that holds it, so `trim` fills that padding
        self.graph_keys: Collection = ()
        self.cold: ColdDrafter | None = None  # DSpark with varlen: when the block runs (set by the drafter)
        self._kind = ColdDrafter.RUN          # the last proposal's `ColdDrafter.step()`
        self._req_ids: set[str] = set()

    def start(self) -> None:
        self._probs, self._tokens, self._dists, self.survival = [], [], [], None

    def record(self, logits: torch.Tensor, token_ids: torch.Tensor, probs: torch.Tensor | None) -> None:
        """One draft step: logits [B, V]; token_ids [B] drafted; probs [B, V] the draft distribution the
        tokens were sampled from (None: greedy drafting, then softmax(logits))."""
        dist = torch.softmax(logits.float(), dim=-1) if probs is None else probs.float()
        self._probs.append(dist.gather(1, token_ids.long().unsqueeze(1)).squeeze(1))
        self._tokens.append(token_ids)
        self._dists.append(probs)
        self.draft_steps += 1

    def coupled_tokens(self, logits: torch.Tensor, sampling_metadata) -> torch.Tensor:
        """Batch-invariant mode: this step's draft tokens [B] from draft logits [B, V]: the Gumbel-max draw with
        the noise the target's seeded sampler uses at the draft's position (`seeded_rows`), so a draft whose
        distribution matches the target's draws the target's token; greedy rows take the argmax."""
        from vllm_deepinfer.serving.seeded_sampling import seeded_rows

        if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
            return logits.argmax(dim=-1)
        b = logits.shape[0]
        temperature, k, p = (None if x is None else x[:b] for x in
                             (sampling_metadata.temperature, sampling_metadata.top_k, sampling_metadata.top_p))
        pos = self.first_pos + len(self._probs)
        return seeded_rows(logits, temperature, k, p, self.seeds, pos).argmax(dim=-1)

    def exhausted(self) -> bool:
        """Varlen on, steps left, and no request's latest slot pays (so no later slot does either)."""
        if not self.varlen or not self._probs or len(self._probs) >= self.max_len:
            return False
        last = draft_survival(torch.stack(self._probs, dim=1))[:, -1]
        return no_slot_pays(last, last.shape[0], self.cost)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After a `StopDrafting`: the drafted tokens [B, K] (missing steps repeat the last token) and the
        draft distributions [B, K, V] (None when greedy), the shapes vLLM's loop would have returned."""
        missing = self.max_len - len(self._tokens)
        tokens = torch.stack(self._tokens + [self._tokens[-1]] * missing, dim=1)
        dists = None if self._dists[-1] is None else torch.stack(self._dists + [self._dists[-1]] * missing, dim=1)
        return tokens, dists

    def finish(self) -> None:
        if self._probs:
            probs = torch.stack(self._probs, dim=1)
            missing = self.max_len - probs.shape[1]
            self.survival = torch.cat([draft_survival(probs), probs.new_zeros(probs.shape[0], missing)], 1)
        self._probs, self._tokens, self._dists = [], [], []

    def observe(self, confidence: torch.Tensor) -> None:
        """A whole block's per-position acceptance estimates [B, K] (DSpark's c_k)."""
        self.survival = draft_survival(confidence)
        self.draft_steps += 1

    def block_runs(self, req_ids: list[str]) -> bool:
        """Before a DSpark proposal for the requests `req_ids`: whether its block runs (always, without `cold`)."""
        if self.cold is None:
            return True
        if not set(req_ids) <= self._req_ids:
            self.cold.new_request()
        self._req_ids = set(req_ids)
        self._kind = self.cold.step()
        return self._kind != ColdDrafter.SKIP

    def skip(self, num_reqs: int, device: torch.device) -> None:
        """A proposal whose block did not run: survival 0 for every draft of its `num_reqs` requests."""
        self.survival = torch.zeros(num_reqs, self.max_len, device=device)

    def _padded(self, num_reqs: int):
        """n -> the tokens of the captured graph a step of n tokens in `num_reqs` requests replays (None: no graphs)."""
        if not self.graph_keys:
            return None
        from vllm_deepinfer.patches.varlen_graphs import pick_graph

        def padded(n: int) -> int:
            desc = pick_graph(self.graph_keys, n, num_reqs)
            return n if desc is None else desc.num_tokens
        return padded

    def trim(self, drafts: list[list[int]]) -> list[list[int]]:
        """drafts: per request of the last proposal (batch order) -> the prefixes to verify."""
        if self.varlen and self.survival is not None and drafts:
            b = len(drafts)
            lengths = choose_lengths(self.survival[:b], b, self.cost, padded=self._padded(b)).tolist()
            drafts = [d[:n] for d, n in zip(drafts, lengths)]
            if self.cold is not None and self._kind in (ColdDrafter.RUN, ColdDrafter.PROBE):
                self.cold.paid(self._kind, not no_slot_pays(self.survival[:b, 0], b, self.cost))
        for d in drafts:
            self.length_counts[min(len(d), self.max_len)] += 1
        self.steps += 1
        if self.steps % LOG_EVERY == 0:
            total = sum(self.length_counts)
            mean = sum(n * c for n, c in enumerate(self.length_counts)) / max(total, 1)
            logger.info("vllm-deepinfer draft lengths (%s): mean %.2f, counts by length %s, %d drafter steps%s",
                        "varlen" if self.varlen else "fixed", mean, self.length_counts, self.draft_steps,
                        "" if self.cold is None else f", {self.cold.skipped} proposals skipped (cold drafter)")
        return drafts


__all__ = ["COLD_ENV", "DraftLengthPolicy", "StopDrafting", "VARLEN_ENV", "cold_drafter_enabled", "policy_for",
           "varlen_enabled", "varlen_requested"]
