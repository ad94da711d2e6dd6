"""`/metrics` gets the verified draft length of every request-step, zeros included:
`vllm:deepinfer_spec_decode_verified_length` (histogram, buckets 0..k, labels model_name and engine).

Reason: with confidence-scheduled verification (`DEEPINFER_ENABLE_MTP_VARLEN=1`) the interesting number is how
many drafts each request verifies per step, from 0 to k. vLLM 0.32's Prometheus logger exports drafts, draft
tokens and accepted tokens per position, so a length can be told only on average over the requests that verified
at least one draft; a request whose scheduled length is 0 is no draft at all to vLLM. Its `SpecDecodingStats`
already counts draft tokens per position (`num_draft_tokens_per_pos`), and every decode output of a step
(`IterationStats.inter_token_latencies_iter`: one entry per output of a request past its prefill) is one
verification, so the step's lengths follow: n(L) = per_pos[L-1] - per_pos[L] for L >= 1 (per_pos[k] = 0) and
n(0) = decode outputs - drafts (`verified_lengths`). The scheduler attaches no `SpecDecodingStats` to a step
without drafts; such a step counts every decode output as length 0.

Hook: `PrometheusStatLogger.__init__` / `.record` (the frontend process: `vllm serve`'s API server, or `LLM()`
with stats on), wrapped: after vLLM's own recording the step's lengths are observed. Only with a speculative
config (any method: the numbers come from vLLM's own counters); a logger with no stats does nothing.
"""

from __future__ import annotations

import functools

METRIC = "vllm:deepinfer_spec_decode_verified_length"


def verified_lengths(draft_tokens_per_pos: list[int], decode_outputs: int) -> list[int]:
    """Counts of request-steps by verified draft length 0..k, from the step's draft tokens per position
    (per_pos[p] = drafts with more than p tokens) and its decode outputs (one per verification)."""
    per_pos = list(draft_tokens_per_pos) + [0]
    counts = [per_pos[n - 1] - per_pos[n] for n in range(1, len(per_pos))]
    return [max(decode_outputs - per_pos[0], 0)] + counts


def apply() -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    init, record = PrometheusStatLogger.__init__, PrometheusStatLogger.record
    if getattr(init, "_deepinfer", False):
        return

    @functools.wraps(init)
    def logger_init(self, vllm_config, *args, **kwargs):
        init(self, vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        self.deepinfer_lengths = {}
        if spec is None or vllm_config.model_config.is_diffusion:
            return
        from vllm.v1.metrics.utils import create_metric_per_engine

        self.deepinfer_k = spec.num_speculative_tokens
        histogram = self._histogram_cls(
            name=METRIC, labelnames=["model_name", "engine"], buckets=list(range(self.deepinfer_k + 1)),
            documentation="Drafts verified per request and step (0 = verified none: length chosen 0 or none "
                          "proposed).")
        self.deepinfer_lengths = create_metric_per_engine(histogram, self.per_engine_labelvalues)

    @functools.wraps(record)
    def logger_record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        record(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
        histogram = self.deepinfer_lengths.get(engine_idx)
        if histogram is None or scheduler_stats is None or iteration_stats is None:
            return
        spec = scheduler_stats.spec_decoding_stats
        per_pos = spec.num_draft_tokens_per_pos if spec is not None else [0] * self.deepinfer_k
        for length, n in enumerate(verified_lengths(per_pos, len(iteration_stats.inter_token_latencies_iter))):
            for _ in range(n):
                histogram.observe(length)

    logger_init._deepinfer = True
    PrometheusStatLogger.__init__ = logger_init
    PrometheusStatLogger.record = logger_record
