"""DeepInfer's cold-drafter rule (`spec_decode.schedule.ColdDrafter`) under vLLM's V2 DSpark speculator.

Reason: with adaptive verification (`enable_adaptive_verification`, what `DEEPINFER_ENABLE_MTP_VARLEN=1` maps to
on V2) vLLM trims the verified drafts to a global budget, but the V2 runner calls `DSparkSpeculator.propose`
every step (`GPUModelRunner` after the target's sampling), so the whole draft block (three stages, N query rows
per request, attention and MoE each) runs even when the budget has been 0 for every request for many steps: a
noise drafter cost 0.32-0.50 of plain decode's speed on the tiny target (H100, 2026-12-07). vLLM 0.32 has no hook
to skip a proposal; its per-step draft length (`num_speculative_tokens`) is chosen by batch size only.

Three wraps, installed by our drafter's constructor under the V2 opt-in (`VLLM_DEEPINFER_DSPARK_V2=1`, CUDA) and
active only where the first real proposal finds the rule applies (our DSpark drafter, vLLM using its confidence
head, i.e. adaptive verification on, and no data parallelism: `proposer.cold_drafter_enabled`):

* `DSparkSpeculator.propose` (inherited from `DFlashSpeculator`): asks `ColdDrafter.step()`; a SKIP proposal only
  stores the context rows of the step's tokens (`combine_hidden_states`, then `precompute_and_store_context_kv` at
  the slots the runner's slot mapping of the step gives the drafter's window caches; a CUDA graph per token
  count, `draft_graphs.ContextWriteGraphs`), publishes confidence 0 for every draft and returns the last block's
  drafts, which are never verified;
* `AdaptiveVerificationManager.get_num_tokens`: when the drafts to verify come from a skipped proposal, the
  budget is 0 (they are the stale drafts of an earlier block) without vLLM's budget arithmetic; otherwise vLLM's
  budget, read from the estimates of the proposal before last (`record_confidences` double-buffers them), is that
  proposal's outcome for the rule: it paid when the budget exceeds the slots the step's padded CUDA graph computes
  anyway;
* `AdaptiveVerificationManager.add_request`: a new request brings the next probe forward.

The rule lives on the speculator; the manager's wraps read the newest speculator's (`newest()`: one V2 runner per
worker process, engines one after another in a test process).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from vllm_deepinfer.log import get_logger
from vllm_deepinfer.spec_decode.draft_graphs import ContextWriteGraphs
from vllm_deepinfer.spec_decode.schedule import ColdDrafter

logger = get_logger(__name__)
LOG_EVERY = 1000  # proposals between log lines


@dataclasses.dataclass
class ColdState:
    rule: ColdDrafter
    context: ContextWriteGraphs     # a skipped proposal's context write
    last: str | None = None         # `ColdDrafter.step()` of the last proposal (whose drafts the next step verifies)
    judged: str | None = None       # of the one before, until the next budget reports its outcome (then None)
    verified: int = 0               # drafts verified so far (the budgets; vLLM's V2 counters count scheduled ones)


_STATE: ColdState | None = None  # the rule of the newest speculator that proposed (its runner's manager reads it)


def free_slots(verify_cost: np.ndarray, num_tokens: int) -> int:
    """Draft slots a step of `num_tokens` verifies at no extra cost: the rest of its bucket in vLLM's step-function
    verify-cost table (a captured graph's padding)."""
    same = verify_cost[num_tokens:] == verify_cost[num_tokens]
    return int(same.size if same.all() else np.argmin(same)) - 1


def _state_for(speculator) -> ColdState | None:
    """The speculator's rule, decided on its first real proposal (None: the rule does not apply)."""
    global _STATE
    if not hasattr(speculator, "_deepinfer_cold"):
        from vllm_deepinfer.spec_decode.dspark import DSparkDrafter
        from vllm_deepinfer.spec_decode.proposer import cold_drafter_enabled

        model = speculator.model
        speculator._deepinfer_cold = None
        if isinstance(model, DSparkDrafter) and speculator.use_confidence_head \
                and cold_drafter_enabled(speculator.vllm_config):
            rows = speculator.max_num_reqs * (1 + speculator.num_speculative_steps)  # decode and verification steps
            width = len(model.target_layers) * model.arch.hidden_size
            context = ContextWriteGraphs(model, rows, width, speculator.dtype, speculator.device)
            speculator._deepinfer_cold = ColdState(ColdDrafter(probe_len=2), context)
        _STATE = speculator._deepinfer_cold
    return speculator._deepinfer_cold


def apply() -> None:
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import AdaptiveVerificationManager
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    propose = DSparkSpeculator.propose
    if getattr(propose, "_deepinfer", False):
        return
    get_num_tokens, add_request = AdaptiveVerificationManager.get_num_tokens, AdaptiveVerificationManager.add_request

    @functools.wraps(propose)
    def propose_or_skip(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                        *args, **kwargs):
        state = None if kwargs.get("dummy_run") or kwargs.get("is_profile") else _state_for(self)
        if state is not None:
            kind = state.rule.step()
            state.judged, state.last = state.last, kind
            if state.rule.proposals % LOG_EVERY == 0:
                logger.info("vllm-deepinfer DSpark on V2: %d of %d proposals skipped (cold drafter), %d drafts "
                            "verified", state.rule.skipped, state.rule.proposals, state.verified)
            if kind == ColdDrafter.SKIP:
                # the rows go where the runner's slot mapping of this step puts them in each stage's window cache
                # (DFlash's own context precompute builds the same slots from the same block tables; rejected
                # tokens' rows sit at positions no block reads before they are written again)
                n = input_batch.num_tokens
                slots = [slot_mappings[name][:n] for name in self.model.get_draft_kv_cache_layer_names()]
                state.context.store(aux_hidden_states, input_batch.positions[:n], slots)
                self.draft_token_confidence_probs[: input_batch.num_reqs].zero_()
                return self.draft_tokens[: input_batch.num_reqs]  # the last block's, never verified (budget 0)
        return propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                       *args, **kwargs)

    @functools.wraps(get_num_tokens)
    def budgeted(self, num_tokens_per_req, draft_tokens):
        if _STATE is not None and _STATE.last == ColdDrafter.SKIP:
            # stale drafts of an earlier block: verify none (vLLM's budget arithmetic over the stale confidences,
            # numpy on the host every step, is not needed: its stash with a budget of 0)
            drafts = {req_id: len(draft_tokens.get(req_id, ())) for req_id in num_tokens_per_req}
            non_draft = {req_id: n - drafts[req_id] for req_id, n in num_tokens_per_req.items()}
            self._batch_budget = (drafts, non_draft, 0)
            return sum(non_draft.values())
        n = get_num_tokens(self, num_tokens_per_req, draft_tokens)
        if _STATE is None or _STATE.last is None:
            return n
        drafts, non_draft, budget = self._batch_budget
        _STATE.verified += budget
        if _STATE.judged in (ColdDrafter.RUN, ColdDrafter.PROBE):  # once per proposal
            _STATE.rule.paid(_STATE.judged, budget > free_slots(self.cost_tables[1], sum(non_draft.values())))
            _STATE.judged = None
        return n

    @functools.wraps(add_request)
    def add_request_probing(self, req_idx: int) -> None:
        add_request(self, req_idx)
        if _STATE is not None:
            _STATE.rule.new_request()

    for fn in (propose_or_skip, budgeted, add_request_probing):
        fn._deepinfer = True
    DSparkSpeculator.propose = propose_or_skip
    AdaptiveVerificationManager.get_num_tokens = budgeted
    AdaptiveVerificationManager.add_request = add_request_probing


def newest() -> ColdState | None:
    """The rule of the newest V2 DSpark speculator that proposed (None where it does not apply)."""
    return _STATE
