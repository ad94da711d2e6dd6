"""Full CUDA graphs for verification steps whose drafts were trimmed (varlen) on the V1 runner.

Reason: under FULL_DECODE_ONLY (`patches/decode_cudagraphs.py`) vLLM 0.32's V1 runner captures full graphs
only for uniform steps of `uniform_decode_query_len` = 1 + k tokens per request, and dispatches a step
to them only when every request has exactly 1 + k tokens (`GPUModelRunner._is_uniform_decode`). A step
whose drafts the varlen policy cut (`patches/draft_lengths.py`) has fewer tokens in some requests, the
dispatcher finds no key and the step runs eagerly. Measured (H100, 2026-12-06, tiny V4.1, DSpark noise
drafter, K = 5): every draft trimmed to 0, ~41 ms per eager step, 0.05x-0.12x the tok/s of no speculation.

Our model's per-token path is layout-agnostic: each token finds its request by a searchsorted over the
device copy of `query_start_loc`, padding tokens and zero-length padded requests are masked
(`models/step.py::StepBatch.from_metadata`), and nothing of the layout is read on the host. So a full
graph captured for T tokens in R requests serves every step of at most T tokens in at most R requests
whose requests each have at most 1 + k tokens. This patch

* adds FULL keys for the plain-decode layout (s one-token requests; s = 1, 2, 4, 8, 16, ... up to
  `max_num_seqs`) (`GPUModelRunner._check_and_update_cudagraph_mode`, after vLLM initialises its keys),
  and captures them with a query length of 1 (`GPUModelRunner._warmup_and_capture`: the runner's
  `uniform_decode_query_len` is 1 while such a key is captured, and its capture run is handed that key);
* sends a non-uniform step with at most 1 + k tokens per request to the captured key with the fewest
  tokens that holds its tokens and requests (`GPUModelRunner._determine_batch_execution_and_padding`).
  All trimmed to 0 drafts: the plain-decode graph of the step's batch size, as without speculation.
  The runner counts these steps in `deepinfer_trimmed_graph_steps`.

Scope: applied by the drafters' policy (`spec_decode.proposer.policy_for`) when varlen is on; acts only
with FULL decode graphs, speculation on, one data-parallel rank, no LoRA and no encoder inputs, and never
on vLLM's own capture runs. Everything else goes to vLLM's code unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Collection, Iterable, Iterator


def plain_decode_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a plain-decode graph: 1, 2, 4, then every multiple of 8, up to `max_num_seqs` (vLLM's
    default decode sizes; with speculation its capture sizes are multiples of 1 + k, too coarse for these)."""
    return sorted({s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8), max_num_seqs) if 0 < s <= max_num_seqs})


def add_plain_keys(dispatcher, sizes: Iterable[int]) -> frozenset:
    """Add FULL keys (vLLM `BatchDescriptor`s) of s one-token requests to a `CudagraphDispatcher` whose keys are
    initialised; returns the keys it added (a size vLLM already keys the same way is left to vLLM)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    full = dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    plain = [BatchDescriptor(num_tokens=s, num_reqs=s, uniform=True) for s in sizes]
    plain = [b for b in plain if b not in full]
    for b in plain:
        dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, b)
    return frozenset(plain)


def pick_graph(keys: Iterable, num_tokens: int, num_reqs: int):
    """The FULL uniform key (a vLLM `BatchDescriptor`) with the fewest tokens that holds `num_tokens` tokens in
    `num_reqs` requests, or None. Keys with LoRA are never picked."""
    fits = [d for d in keys if d.uniform and not d.has_lora and d.num_tokens >= num_tokens
            and (d.num_reqs or 0) >= num_reqs]
    return min(fits, key=lambda d: (d.num_tokens, d.num_reqs), default=None)


def graph_keys(runner) -> Collection:
    """The runner's FULL keys (vLLM `BatchDescriptor`s) while this patch serves it (its plain-decode keys were
    added), else empty."""
    if not getattr(runner, "_deepinfer_plain_keys", None):
        return ()
    from vllm.config.compilation import CUDAGraphMode

    return runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL]


@contextlib.contextmanager
def _capturing_plain(runner, desc) -> Iterator[None]:
    """While `desc` (a plain-decode key) is captured: the runner builds its dummy batches with one token per
    request, and `determine_trimmed` hands vLLM's capture run that key (vLLM's dispatcher would pad the size
    to a capture size, multiples of 1 + k with speculation)."""
    saved = runner.uniform_decode_query_len
    runner.uniform_decode_query_len, runner._deepinfer_capturing = 1, desc
    try:
        yield
    finally:
        runner.uniform_decode_query_len, runner._deepinfer_capturing = saved, None


def apply() -> None:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker import gpu_model_runner as gmr

    runner_cls = gmr.GPUModelRunner
    if getattr(runner_cls._determine_batch_execution_and_padding, "_deepinfer", False):
        return
    check_mode, capture = runner_cls._check_and_update_cudagraph_mode, runner_cls._warmup_and_capture
    determine = runner_cls._determine_batch_execution_and_padding

    @functools.wraps(check_mode)
    def check_mode_plain_keys(self, *args, **kwargs):
        check_mode(self, *args, **kwargs)
        self._deepinfer_plain_keys = frozenset()
        d = self.cudagraph_dispatcher
        mode = getattr(d, "cudagraph_mode", CUDAGraphMode.NONE)
        if (self.uniform_decode_query_len <= 1 or mode.decode_mode() != CUDAGraphMode.FULL
                or not mode.separate_routine() or self.vllm_config.lora_config is not None):
            return
        self._deepinfer_plain_keys = add_plain_keys(d, plain_decode_sizes(self.scheduler_config.max_num_seqs))

    @functools.wraps(capture)
    def capture_plain(self, desc, *args, **kwargs):
        if desc not in getattr(self, "_deepinfer_plain_keys", ()):
            return capture(self, desc, *args, **kwargs)
        with _capturing_plain(self, desc):
            return capture(self, desc, *args, **kwargs)

    params = inspect.signature(determine)

    @functools.wraps(determine)
    def determine_trimmed(self, *args, **kwargs):
        a = params.bind(self, *args, **kwargs).arguments
        t, r, q = a["num_tokens"], a["num_reqs"], self.uniform_decode_query_len
        desc = getattr(self, "_deepinfer_capturing", None)
        if desc is not None:  # vLLM's capture run of a plain-decode key (its warm-up runs are eager)
            if a.get("force_eager"):
                return determine(self, *args, **kwargs)
            return CUDAGraphMode.FULL, desc, False, None, None
        keys = graph_keys(self)
        if (keys and 0 < r and a["max_num_scheduled_tokens"] <= q
                and not (a["max_num_scheduled_tokens"] == q and t == q * r)       # vLLM's uniform step
                and a.get("force_uniform_decode") is None and not a.get("force_eager")  # not a capture run
                and not a.get("num_encoder_reqs") and self.vllm_config.parallel_config.data_parallel_size == 1
                and not self.input_batch.lora_id_to_lora_request):
            desc = pick_graph(keys, t, r)
        if desc is None:
            return determine(self, *args, **kwargs)
        self.deepinfer_trimmed_graph_steps = getattr(self, "deepinfer_trimmed_graph_steps", 0) + 1
        stats = None
        if self.vllm_config.observability_config.cudagraph_metrics:
            stats = gmr.CUDAGraphStat(num_unpadded_tokens=t, num_padded_tokens=desc.num_tokens,
                                      num_paddings=desc.num_tokens - t,
                                      runtime_mode=str(CUDAGraphMode.FULL))
        return CUDAGraphMode.FULL, desc, False, None, stats

    for fn in (check_mode_plain_keys, capture_plain, determine_trimmed):
        fn._deepinfer = True
    runner_cls._check_and_update_cudagraph_mode = check_mode_plain_keys
    runner_cls._warmup_and_capture = capture_plain
    runner_cls._determine_batch_execution_and_padding = determine_trimmed
