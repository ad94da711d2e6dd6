"""Per-request draft lengths (confidence-scheduled verification) for the MTP drafter on the V1 runner.

Reason: vLLM 0.32's V1 runner has no hook for a draft-length policy: `EagleProposer.propose`
returns K drafts for every request and `GPUModelRunner.take_draft_token_ids` hands them to the
scheduler as they are; the per-request policy vLLM has (`enable_adaptive_verification`) is V2- and
DSpark-only (refused on V1: "Model Runner V1 does not support: dspark speculative decoding"). The
scheduler itself schedules whatever list length it receives (`Scheduler.update_draft_token_ids`,
verified with list proposers in the extension-points doc), so the least fragile V1 route is to trim
the lists where the runner hands them over. This module wraps three methods, each only acting when
the proposer's draft model is the DeepInfer MTP drafter (it carries a `draft_policy`):

* `SpecDecodeBaseProposer.propose`: reset / finish the policy's per-step records around the call;
* `SpecDecodeBaseProposer._sample_draft_tokens`: the same sampling as vLLM's (greedy argmax, or
  `_sample_from_logits` when probabilistic drafting is on), plus recording the drafted tokens'
  probabilities (`spec_decode/proposer.py`);
* `GPUModelRunner.take_draft_token_ids` (inherited by the CPU runner): trim each request's list.

With async scheduling (GPU V1) the scheduler schedules placeholders before the lists exist, so
trimming cannot act there; the CPU platform forces async scheduling off.

Applied by the drafter's constructor (not by `apply_all`): importing the runner module in every
plugin process would be slow, and nothing changes for other drafters.
"""

from __future__ import annotations

import functools


def _policy(proposer):
    return getattr(getattr(proposer, "model", None), "draft_policy", None)


def apply() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(SpecDecodeBaseProposer.propose, "_deepinfer", False):
        return
    propose, sample = SpecDecodeBaseProposer.propose, SpecDecodeBaseProposer._sample_draft_tokens
    take = GPUModelRunner.take_draft_token_ids

    @functools.wraps(propose)
    def propose_recorded(self, *args, **kwargs):
        policy = _policy(self)
        if policy is None:
            return propose(self, *args, **kwargs)
        policy.start()
        out = propose(self, *args, **kwargs)
        policy.finish()
        return out

    @functools.wraps(sample)
    def sample_recorded(self, hidden_states, sampling_metadata):
        policy = _policy(self)
        if policy is None:
            return sample(self, hidden_states, sampling_metadata)
        logits = self.model.compute_logits(hidden_states)
        if not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy:
            token_ids, probs = logits.argmax(dim=-1), None
        else:
            token_ids, probs = self._sample_from_logits(logits, sampling_metadata)
        policy.record(logits, token_ids, probs)
        return token_ids, probs

    @functools.wraps(take)
    def take_trimmed(self):
        out = take(self)
        policy = _policy(getattr(self, "drafter", None))
        if out is not None and policy is not None:
            out.draft_token_ids = policy.trim(out.draft_token_ids)
        return out

    for fn in (propose_recorded, sample_recorded, take_trimmed):
        fn._deepinfer = True
    SpecDecodeBaseProposer.propose = propose_recorded
    SpecDecodeBaseProposer._sample_draft_tokens = sample_recorded
    GPUModelRunner.take_draft_token_ids = take_trimmed
