"""Prompt lengths for V4.1 bounded replay under vLLM's V1 model runner (the CPU runner).

Reason: bounded replay (`vllm_deepinfer/models/replay.py`) needs each request's prompt length P to fix
its replay start R = P - keep for the request's life (chunks and recompute after preemption alike),
and must run requests that ask for prompt logprobs in full. vLLM 0.32's V1 runner hands attention
metadata builders only the batch layout (`CommonAttentionMetadata`; its `rswa_prefix_lens` carries
prompt lengths only for R-SWA models and would switch that feature on). The runner has both in its
input batch (`num_prompt_tokens`, `req_ids`) and `num_prompt_logprobs`
(`vllm/v1/worker/gpu_model_runner.py`). This patch wraps `GPUModelRunner._build_attention_metadata`
(which the CPU runner inherits) to hand them, in batch order, to our builders for the duration of the
call (`attention.backend.step_hints`); other models' builders never read them. The V2 runner
(GPU) needs no patch: the model supplies its own ModelState (`models/replay.py`).

Applied by the model's constructor when replay is on (not by `apply_all`): the runner module is
imported by then, and importing it in every plugin process (frontend, registry probe) would be slow.
"""

from __future__ import annotations

import functools


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_deepinfer.attention.backend import step_hints

    original = GPUModelRunner._build_attention_metadata
    if getattr(original, "_deepinfer", False):
        return

    @functools.wraps(original)
    def build(self, num_tokens: int, num_reqs: int, *args, **kwargs):
        batch = self.input_batch
        lens = batch.num_prompt_tokens[:num_reqs].tolist()
        if self.num_prompt_logprobs:
            lens = [-1 if rid in self.num_prompt_logprobs else n for rid, n in zip(batch.req_ids, lens)]
        with step_hints(lens):
            return original(self, num_tokens, num_reqs, *args, **kwargs)

    build._deepinfer = True
    GPUModelRunner._build_attention_metadata = build
