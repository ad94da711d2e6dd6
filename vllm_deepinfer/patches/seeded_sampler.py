"""Batch-invariant mode: the V1 model runner samples with `SeededSampler` (noise keyed by seed and position).

Reason: vLLM's V1 runner (the runner on CPU, and on GPU with `VLLM_USE_V2_MODEL_RUNNER=0`) has no
sampler hook (`GPUModelRunner.__init__` constructs `Sampler` directly), and its seeded sampling keeps
a `torch.Generator` per request: a resumed (preempted) request's generator restarts its stream, and
on CPU a seeded request whose prefill is chunked crashes the step ("CPU Generator does not use
offset", `gpu_model_runner.py` `_bookkeeping_sync` rewinding the discarded draw). Neither is
batch-invariant. See `vllm_deepinfer/serving/seeded_sampling.py` for the noise.

Runner choice: vLLM's V2 runner (its default on CUDA) samples on its own path, which this hook does not reach and
which no invariance run has verified. So in batch-invariant mode, while `VLLM_USE_V2_MODEL_RUNNER` is unset, the
V2 list of unsupported features gains "DeepInfer's batch-invariant sampling" for our models and vLLM picks V1 by
itself (as for any feature V2 lacks). `VLLM_USE_V2_MODEL_RUNNER=1` is honoured, with a warning (vLLM's V2 sampler
also keys its Gumbel noise by seed and position, but its tokens are not the plugin's `SeededSampler`'s).

Hook: `GPUModelRunner._sample` (V1, inherited by `CPUModelRunner`). When batch-invariant mode is on
(`vllm_deepinfer.ops.invariant_requested`) the wrapper installs a `SeededSampler` as the runner's
`sampler.topk_topp_sampler` once, gives it each row's (seed, position of the token being drawn:
`input_batch.num_tokens_no_spec`) and empties `input_batch.generators` (the seeds are read from
the requests; no generator is used or rewound). Off, the original method runs untouched.

Speculative decoding (invariant mode): vLLM's rejection sampler draws its accept/reject uniforms and
recovered tokens from generators, so a request's tokens would depend on the drafts, hence on the batch.
Instead every verified row r of a request, predicting position N + r (N = `num_tokens_no_spec`), gets the
token the non-speculative seeded sampler would draw there: Gumbel-max over its processed logits with the
noise of (seed, N + r) (`seeded_row_logits`, in place of vLLM's `apply_sampling_constraints`); verification is
then exact match (vLLM's greedy kernel, `rejection_sample` with all rows greedy), and the bonus token is the
runner's sampler keyed by (seed, N + k). A draft is accepted iff it equals the seeded sample, so the output
is the non-speculative seeded output token for token, whatever the drafts, the draft lengths or the batch.
To keep acceptance up, the drafters draw their drafts with the same noise (MTP:
`DraftLengthPolicy.coupled_tokens`; DSpark: `dspark.sample`); the step's seeds are handed to their policy here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)


V2_GAP = "DeepInfer's batch-invariant sampling"

#: (seeds [T], positions [T]) of the verified rows of the current speculative step, set
#: around the rejection sampler call in invariant mode; None otherwise.
_ROW_KEYS: tuple[torch.Tensor, torch.Tensor] | None = None


def seeded_row_logits(logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sampling_metadata) -> torch.Tensor:
    """Verified rows' logits [T, V] (fp32, logits processors applied) -> logits whose argmax is the row's seeded
    draw (`serving.seeded_sampling.seeded_rows` with the per-request parameters expanded to the rows)."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    from vllm_deepinfer.serving.seeded_sampling import seeded_rows

    n = logits.shape[0]
    if sampling_metadata.all_greedy or n == 0:
        return logits
    temperature, k, p = (None if x is None else expand_batch_to_tokens(x, cu_num_draft_tokens, n)
                         for x in (sampling_metadata.temperature, sampling_metadata.top_k, sampling_metadata.top_p))
    return seeded_rows(logits, temperature, k, p, *_ROW_KEYS)   # greedy rows carry GREEDY_TEMPERATURE = 0


def _spec_row_keys(runner, meta, seeds: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(seeds, positions) [T] of the verified rows (request-major, as `meta.draft_token_ids`) and the
    bonus positions [B]: row r of a request with N tokens predicts position N + r, its bonus N + k."""
    batch = runner.input_batch
    n = batch.num_reqs
    counts = torch.tensor(meta.num_draft_tokens, dtype=torch.int64)
    base = torch.from_numpy(batch.num_tokens_no_spec[:n].copy()).to(torch.int64)
    req = torch.repeat_interleave(torch.arange(n), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return (seeds[req], base[req] + torch.arange(req.shape[0]) - first), base + counts


@functools.cache
def _warn_explicit_v2() -> None:
    logger.warning("batch-invariant mode with VLLM_USE_V2_MODEL_RUNNER=1: the V2 runner samples with vLLM's own "
                   "seeded sampler (not verified for invariance); unset it for the verified V1 runner")


def apply() -> None:
    from vllm.config.vllm import VllmConfig
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._sample, "_deepinfer", False):
        return
    v2 = VllmConfig._get_v2_model_runner_unsupported_features

    @functools.wraps(v2)
    def v2_unsupported(self) -> list[str]:
        import vllm.envs as envs

        from vllm_deepinfer import ops
        from vllm_deepinfer.registry import is_deepinfer_model

        if not (ops.invariant_requested(self) and is_deepinfer_model(self.model_config)):
            return v2(self)
        if envs.VLLM_USE_V2_MODEL_RUNNER is None:
            return v2(self) + [V2_GAP]
        if envs.VLLM_USE_V2_MODEL_RUNNER:
            _warn_explicit_v2()
        return v2(self)

    original = GPUModelRunner._sample
    constraints, reject = rejection_sampler.apply_sampling_constraints, rejection_sampler.rejection_sample

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if _ROW_KEYS is None:
            return constraints(logits, cu_num_draft_tokens, sampling_metadata)
        return seeded_row_logits(logits, cu_num_draft_tokens, sampling_metadata)

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        if _ROW_KEYS is not None:  # exact match against the seeded draws
            sampling_metadata = dataclasses.replace(sampling_metadata, all_greedy=True, all_random=False)
            draft_probs = None
        return reject(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                      target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        from vllm_deepinfer import ops
        from vllm_deepinfer.serving.seeded_sampling import SeededSampler

        if not ops.invariant_requested(self.vllm_config):
            return original(self, logits, spec_decode_metadata)
        global _ROW_KEYS
        sampler = self.sampler.topk_topp_sampler
        if not isinstance(sampler, SeededSampler):
            sampler = self.sampler.topk_topp_sampler = SeededSampler(self.sampler.logprobs_mode)
            logger.info("vllm-deepinfer: batch-invariant mode, seeded sampling keyed by (seed, position)")
        batch = self.input_batch
        n = batch.num_reqs
        seeds = torch.randint(0, 2**62, (n,), dtype=torch.int64)  # unseeded rows: fresh noise
        for i, req_id in enumerate(batch.req_ids[:n]):
            seed = self.requests[req_id].sampling_params.seed
            if seed is not None:
                seeds[i] = seed
        batch.generators.clear()
        policy = getattr(getattr(getattr(self, "drafter", None), "model", None), "draft_policy", None)
        if policy is not None:  # the drafters couple their drafts to these seeds (spec_decode/proposer.py)
            policy.seeds = seeds
        if spec_decode_metadata is None:
            sampler.keys = (seeds, torch.from_numpy(batch.num_tokens_no_spec[:n].copy()))
            return original(self, logits, spec_decode_metadata)
        _ROW_KEYS, bonus_pos = _spec_row_keys(self, spec_decode_metadata, seeds)
        sampler.keys = (seeds, bonus_pos)
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            _ROW_KEYS = None

    _sample._deepinfer = apply_sampling_constraints._deepinfer = rejection_sample._deepinfer = True
    v2_unsupported._deepinfer = True
    VllmConfig._get_v2_model_runner_unsupported_features = v2_unsupported
    GPUModelRunner._sample = _sample
    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints
    rejection_sampler.rejection_sample = rejection_sample
