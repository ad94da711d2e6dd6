"""Batch-invariant mode: the V1 model runner samples with `SeededSampler` (noise keyed by seed and position).

Reason: vLLM's V1 runner (the runner on CPU, and on GPU with `VLLM_USE_V2_MODEL_RUNNER=0`) has no
sampler hook (`GPUModelRunner.__init__` constructs `Sampler` directly), and its seeded sampling keeps
a `torch.Generator` per request: a resumed (preempted) request's generator restarts its stream, and
on CPU a seeded request whose prefill is chunked crashes the step ("CPU Generator does not use
offset", `gpu_model_runner.py` `_bookkeeping_sync` rewinding the discarded draw). Neither is
batch-invariant. See `vllm_deepinfer/serving/seeded_sampling.py` for the noise.

Hook: `GPUModelRunner._sample` (V1, inherited by `CPUModelRunner`). When batch-invariant mode is on
(`vllm_deepinfer.ops.invariant_requested`) the wrapper installs a `SeededSampler` as the runner's
`sampler.topk_topp_sampler` once, gives it each row's (seed, position of the token being drawn:
`input_batch.num_tokens_no_spec`) and empties `input_batch.generators` (the seeds are read from
the requests; no generator is used or rewound). Off, the original method runs untouched. Speculative
decoding (rejection sampler) is not covered yet: it is refused in invariant mode.
"""

from __future__ import annotations

import torch

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._sample, "_deepinfer", False):
        return
    original = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        from vllm_deepinfer import ops
        from vllm_deepinfer.serving.seeded_sampling import SeededSampler

        if not ops.invariant_requested(self.vllm_config):
            return original(self, logits, spec_decode_metadata)
        if spec_decode_metadata is not None:
            raise NotImplementedError("DEEPINFER_BATCH_INVARIANT: speculative decoding is not covered yet")
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
        sampler.keys = (seeds, torch.from_numpy(batch.num_tokens_no_spec[:n].copy()))
        return original(self, logits, spec_decode_metadata)

    _sample._deepinfer = True
    GPUModelRunner._sample = _sample
