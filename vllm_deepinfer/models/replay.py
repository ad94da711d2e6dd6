"""V4.1 decoder bounded replay (model-spec §3.14), exact by default.

Layers 0..cut (cut = max(kv_source_layer_ids)) write window KV, compressed KV and index keys for every
token: the layers past the cut read the cut's compressed KV and index keys, and own only their
window KV. So the cut layer's queries and FFN and every later layer run only on a request's trailing
positions, and each layer past the cut on fewer of them than the one before: layer cut+k's queries
and FFN run on the positions p >= P - keep_k (P prompt tokens; fixed for the request's life, so
chunked prefill and recompute after preemption see the same rows), its window KV is written for the
rows it receives (p >= P - keep_{k-1}), and its window reads are masked to those rows.

Exactness (every output that matters equals full prefill). Past the cut, a token depends on earlier
tokens only through its layer's window (W rows: itself and W-1 earlier ones); the cut's compressed
rows and index keys are complete, and index selection / candidate blocks are per token (own query
against complete keys). With n = L-1-cut layers past the cut and
  keep_k = (n-k)(W-1) + 1   (k = 0..n; keep_0 = keep = n(W-1)+1, the last layer keep_n = 1),
layer cut+k's output at p >= P - keep_k reads window rows >= P - keep_k - (W-1) = P - keep_{k-1} of
its own input, all of which layer cut+k-1 computed exactly (the cut's window is complete): by
induction every kept output is exact. So
  * the last prompt token (p = P-1, keep_n = 1) is exact at the last layer: the first sampled token is;
  * every window row a decode step reads is exact: a decode step at P reads rows >= P-W+1 of layer
    cut+k, computed from layer cut+k-1's output, kept since keep_{k-1} >= W-1; later steps read the
    same rows or rows they computed themselves.
Against one keep for every layer past the cut this halves their rows (n = 3, W = 128: 382 + 255 +
128 + 1 instead of 4 x 382 per prompt). While a DSpark drafter captures the streams entering layers
past the cut (`models/capture.py`), every layer keeps `keep` rows so the captured rows stay complete.
A smaller keep (DeepInfer's `DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`, default 140 there; vLLM's in-tree
keeps W = 128 rows) is approximate: the first kept rows see truncated windows; then
keep_k = max(keep - k(W-1), W-1) for k < n. keep >= W is required either way, so decode steps never
read an unwritten row.

Not replayed (run every layer on every token): requests that ask for prompt logprobs, and every
request when the runner gives no prompt lengths. Prefix hits: the past-cut window caches are kept
out of prefix caching and a hit is rewound by `keep` tokens (vLLM's `prefix_replay_tokens`), so the
recomputed tail covers every retained row (`attention/caches.py`); the other sliding-window caches
then retain `keep` more tokens so the rewound tail resumes from cached rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from vllm_deepinfer.attention.backend import step_hints
from vllm_deepinfer.config import V41, ArchConfig
from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)

MODE_ENV = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"
KEEP_ENV = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
_OFF = {"", "0", "false", "no", "off", "none", "disabled"}


def parse_mode(value: str) -> bool:
    """DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE: `compact` (replay on) or an off value (`none`, `0`, ...)."""
    v = value.strip().lower()
    if v == "compact":
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{MODE_ENV}={value!r}: expected compact or none")


def parse_keep(value: str) -> int | None:
    """DEEPINFER_YOCO_PREFILL_KEEP_TOKENS: a positive token count, or an off/`exact` value (None = exact)."""
    v = value.strip().lower()
    if v in _OFF or v in ("auto", "exact"):
        return None
    if not v.isdigit() or int(v) <= 0:
        raise ValueError(f"{KEEP_ENV}={value!r}: expected a positive token count or exact")
    return int(v)


@dataclasses.dataclass(frozen=True)
class ReplayPolicy:
    """cut: last KV-source layer; keep: trailing prompt tokens per request that leave the cut layer;
    exact_keep = n(W-1)+1, the smallest keep that is exact; keeps[k]: the trailing prompt tokens that
    leave layer cut+k (k = 0..n, keeps[0] = keep, non-increasing)."""

    cut: int
    keep: int
    exact_keep: int
    keeps: tuple[int, ...]

    @property
    def exact(self) -> bool:
        return self.keep >= self.exact_keep

    def layer_keeps(self, capturing: bool) -> tuple[int, ...]:
        """Output keep of layers cut..L-1; `capturing` (a drafter reads streams past the cut): `keep` for all."""
        return (self.keep,) * len(self.keeps) if capturing else self.keeps


def layer_keeps(keep: int, n: int, window: int) -> tuple[int, ...]:
    """keep_k of layers cut+k, k = 0..n: keep - k(W-1), at least W-1 (the window rows a decode step reads
    from the next layer), and 1 at the last layer (only the last prompt token's output is used)."""
    return tuple(max(keep - k * (window - 1), window - 1) for k in range(n)) + (1,)


def exact_keep(arch: ArchConfig) -> int:
    return (arch.num_layers - 1 - max(arch.kv_source_layer_ids)) * (arch.window - 1) + 1


def resolve(arch: ArchConfig, swa_bounded_replay: bool, environ: dict[str, str] | None = None) -> ReplayPolicy | None:
    """The bounded-replay policy of a model, None = off.

    On: `DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact`, or, when that is unset, vLLM's
    `cache_config.swa_bounded_replay` (`--swa-bounded-replay`, default on). keep: the exact n(W-1)+1
    unless `DEEPINFER_YOCO_PREFILL_KEEP_TOKENS` asks for another (>= W; approximate below exact).
    V4 (no KV sharing) and V4.1 configs with nothing past the last KV source have nothing to replay.
    """
    env = os.environ if environ is None else environ
    on = parse_mode(env[MODE_ENV]) if MODE_ENV in env else swa_bounded_replay
    if not on:
        return None
    if arch.family != V41 or not arch.kv_source_layer_ids or max(arch.kv_source_layer_ids) >= arch.num_layers - 1:
        if MODE_ENV in env:
            logger.warning("%s=compact ignored: %s has no layers past a last KV source (bounded replay is V4.1-only)",
                           MODE_ENV, arch.family)
        return None
    cut = max(arch.kv_source_layer_ids)
    if any(l > cut for l in arch.engram_layer_ids):
        logger.warning("bounded replay off: Engram layer past the last KV source %d (unsupported, as in vLLM)", cut)
        return None
    exact = exact_keep(arch)
    keep = parse_keep(env[KEEP_ENV]) if KEEP_ENV in env else None
    keep = exact if keep is None else keep
    if keep < arch.window:
        raise ValueError(f"{KEEP_ENV}={keep} is below the sliding window {arch.window}: decode steps read the "
                         f"last {arch.window} window rows of every layer past the cut, so at least that many must "
                         f"be computed (exact: {exact})")
    policy = ReplayPolicy(cut, keep, exact, layer_keeps(keep, arch.num_layers - 1 - cut, arch.window))
    logger.info("vllm-deepinfer bounded replay: layers %d..%d run on each prompt's last %s tokens (%s; exact keep %d)",
                cut, arch.num_layers - 1, "/".join(map(str, policy.keeps)), "exact" if policy.exact else "APPROXIMATE",
                exact)
    return policy


def agree_across_dp(rows: list[int]) -> torch.Tensor | None:
    """Data parallel: every DP rank's row count leaving each layer from the cut on, [len(rows), dp] int32.

    The MoE all2all of a layer gathers every rank's rows with the per-rank sizes of the step's DP metadata,
    which count the step's tokens; from the cut on a rank runs fewer. One host all-reduce on the DP group
    per eager step (as vLLM's in-tree replay agrees its batch), made by every rank's forward in the same
    steps: vLLM syncs the CUDA-graph mode across DP ranks and an idle rank runs a dummy batch. None when
    DP is off, or in a graph (per-token steps: no token drops).
    """
    from vllm.config import CUDAGraphMode
    from vllm.distributed import get_dp_group
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.v1.worker.dp_utils import should_skip_dp_coordination

    if not is_forward_context_available() or should_skip_dp_coordination():
        return None
    ctx = get_forward_context()
    if ctx.dp_metadata is None or ctx.cudagraph_runtime_mode != CUDAGraphMode.NONE:
        return None
    group = get_dp_group()
    agreed = torch.zeros(len(rows), group.world_size, dtype=torch.int32)
    agreed[:, group.rank_in_group] = torch.tensor(rows, dtype=torch.int32)
    dist.all_reduce(agreed, group=group.cpu_group)
    return agreed


@contextlib.contextmanager
def dp_rows(agreed: torch.Tensor | None, k: int) -> Iterator[None]:
    """Layer cut+k under DP: the forward context's per-rank sizes are `agreed[k]` (`agree_across_dp`)."""
    if agreed is None:
        yield
        return
    from vllm.forward_context import DPMetadata, get_forward_context

    ctx = get_forward_context()
    step = ctx.dp_metadata
    ctx.dp_metadata = DPMetadata(agreed[k])  # the context itself stays: MoE layers count calls on it
    try:
        yield
    finally:
        ctx.dp_metadata = step


def replay_model_state_cls():
    """V2 model runner: DefaultModelState that hands the metadata builders each step's prompt lengths (-1 for
    requests that ask for prompt logprobs) and, under adaptive verification, the number of leading requests
    with drafts, whose host query lengths the runner may have split evenly (`attention.backend.step_hints`;
    vLLM orders requests with drafts first). Imported only by the V2 runner (CUDA)."""
    import numpy as np
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    class ReplayModelState(DefaultModelState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.prompt_lens = np.full(self.max_num_reqs, -1, dtype=np.int64)
            spec = self.vllm_config.speculative_config
            self.adaptive = spec is not None and spec.enable_adaptive_verification

        def add_request(self, req_index, new_req_data) -> None:
            super().add_request(req_index, new_req_data)
            params = new_req_data.sampling_params
            full = params is not None and params.prompt_logprobs is not None
            self.prompt_lens[req_index] = -1 if full else new_req_data.prompt_len

        def prepare_attn(self, input_batch, *args, **kwargs):
            lens = self.prompt_lens[input_batch.idx_mapping_np[: input_batch.num_reqs]].tolist()
            drafts = input_batch.num_draft_tokens_per_req
            trimmed = int(np.count_nonzero(drafts)) if self.adaptive and drafts is not None else 0
            with step_hints(lens, trimmed):
                return super().prepare_attn(input_batch, *args, **kwargs)

    return ReplayModelState

