"""Per-request draft lengths (confidence-scheduled verification) for DeepInfer's drafters on the V1 runner.

Reason: vLLM 0.32's V1 runner has no hook for a draft-length policy: `EagleProposer.propose`
returns K drafts for every request and `GPUModelRunner.take_draft_token_ids` hands them to the
scheduler as they are; the per-request policy vLLM has (`enable_adaptive_verification`) is V2- and
DSpark-only (refused on V1: "Model Runner V1 does not support: dspark speculative decoding"). The
scheduler itself schedules whatever list length it receives (`Scheduler.update_draft_token_ids`,
verified with list proposers in the extension-points doc), so the least fragile V1 route is to trim
the lists where the runner hands them over. This module wraps three methods, each only acting when
the proposer's draft model carries a `draft_policy` (`spec_decode/proposer.py`: the MTP drafter's, and
DSpark's, whose proposer feeds it the confidence head directly):

* `SpecDecodeBaseProposer.propose` (MTP): reset / finish the policy's per-step records around the call;
  when the sampling hook stops the loop early (`StopDrafting`: varlen on and no later draft can be
  verified), return the padded drafts (and draft probabilities) vLLM's loop would have returned;
* `SpecDecodeBaseProposer._sample_draft_tokens` (MTP): the same sampling as vLLM's (greedy argmax, or
  `_sample_from_logits` when probabilistic drafting is on; in batch-invariant mode the draw coupled to the
  target's seeded noise, `DraftLengthPolicy.coupled_tokens`), plus recording the drafted tokens'
  probabilities, and the early stop;
* `GPUModelRunner.take_draft_token_ids` (inherited by the CPU runner): trim each request's list (with the
  runner's full-graph keys, whose padding the policy fills: `patches/varlen_graphs.py`).

With async scheduling (GPU V1) the scheduler schedules placeholders before the lists exist, so
trimming cannot act there: `proposer.policy_for` turns varlen off then (the CPU platform forces async
scheduling off).

Applied by the drafters' constructors (`spec_decode.proposer.policy_for`, not by `apply_all`): importing the
runner module in every plugin process would be slow, and nothing changes for other drafters.
"""

from __future__ import annotations

import functools


def _policy(proposer):
    return getattr(getattr(proposer, "model", None), "draft_policy", None)


def apply() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_deepinfer.patches import varlen_graphs
    from vllm_deepinfer.spec_decode.proposer import StopDrafting

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
        if policy.seeds is not None:  # batch-invariant mode: position of each request's first draft
            cm, rejected = kwargs["common_attn_metadata"], kwargs.get("num_rejected_tokens_gpu")
            b = kwargs["next_token_ids"].shape[0]
            nxt = cm.seq_lens[:b].long() - (0 if rejected is None else rejected[:b].long())
            policy.first_pos = (nxt + 1).cpu()
        try:
            out = propose(self, *args, **kwargs)
        except StopDrafting:
            out, dists = policy.padded()
            if dists is not None:
                self._last_draft_probs = dists.contiguous()
        policy.finish()
        return out

    @functools.wraps(sample)
    def sample_recorded(self, hidden_states, sampling_metadata):
        policy = _policy(self)
        if policy is None:
            return sample(self, hidden_states, sampling_metadata)
        logits = self.model.compute_logits(hidden_states)
        if policy.seeds is not None:  # batch-invariant mode (patches/seeded_sampler.py)
            token_ids, probs = policy.coupled_tokens(logits, sampling_metadata), None
        elif not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy:
            token_ids, probs = logits.argmax(dim=-1), None
        else:
            token_ids, probs = self._sample_from_logits(logits, sampling_metadata)
        policy.record(logits, token_ids, probs)
        if policy.exhausted():
            raise StopDrafting
        return token_ids, probs

    @functools.wraps(take)
    def take_trimmed(self):
        out = take(self)
        policy = _policy(getattr(self, "drafter", None))
        if out is not None and policy is not None:
            policy.graph_keys = varlen_graphs.graph_keys(self)
            out.draft_token_ids = policy.trim(out.draft_token_ids)
        return out

    for fn in (propose_recorded, sample_recorded, take_trimmed):
        fn._deepinfer = True
    SpecDecodeBaseProposer.propose = propose_recorded
    SpecDecodeBaseProposer._sample_draft_tokens = sample_recorded
    GPUModelRunner.take_draft_token_ids = take_trimmed
