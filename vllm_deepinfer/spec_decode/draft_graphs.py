"""Fixed-shape DSpark draft steps, replayed as CUDA graphs (issue 11).

A DSpark proposal is several hundred small kernels (the context write, three V4.1 blocks, the head, the Markov
loop). Launched eagerly from vLLM's V1 runner they made a speculative step about 4x slower than plain decode on the
H200 (2026-12-02, tiny-gpu V4.1: 164 tok/s per user at batch 1 with 4.9 of 5 drafts accepted, against 219
without speculation; vLLM 0.32 captures V1 drafters PIECEWISE only, through torch.compile, which the drafter
does not use). So the proposer replays one full graph per padded request count R:

    fixed buffers <- query offsets [R + 1] (padding rows: T), T, positions [R (1 + K)], anchors [R],
                     anchor positions [R], each drafter cache group's block table [R, blocks] (padding: block 0)
    graph:  req  = searchsorted(offsets[1:], token, right)      token = 0 .. R (1 + K) - 1
            keep = captured[token] & (token < T)                 (the target's graph padding is not context)
            context write; block forward of R x N tokens; drafts [R, N], confidence [R, N]
            (N = 0, a cold drafter's proposal: the context write only)

Every step whose requests have at most 1 + K target tokens each fits (decode, verification, varlen-trimmed
verification); prefill and mixed steps, and batch-invariant mode's coupled drafts, stay eager. Sizes R: powers of
two up to max_num_seqs, and max_num_seqs. A graph is captured on first use, after one eager run on the same
buffers (warm-up, and that step's drafts); all share one private memory pool, which vLLM's memory profile does
not see (the largest step's activations: R (1 + K) context rows and R N block tokens through three stages). A
capture that fails logs a warning and leaves drafting on the eager fixed-buffer step.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.forward_context import set_forward_context
from vllm.utils.torch_utils import current_stream

from vllm_deepinfer.attention.backend import PagedCacheMetadata
from vllm_deepinfer.log import get_logger
from vllm_deepinfer.models.capture import StreamCapture
from vllm_deepinfer.spec_decode.dspark import DraftBatch, DSparkDrafter

logger = get_logger(__name__)


def padded_sizes(max_reqs: int) -> list[int]:
    """Request counts with a graph: powers of two below max_reqs, then max_reqs."""
    sizes, s = [], 1
    while s < max_reqs:
        sizes.append(s)
        s *= 2
    return sizes + [max_reqs]


class ContextWriteGraphs:
    """The drafter's context write alone (a cold drafter's proposal under vLLM's V2 speculator,
    `patches/cold_drafter_v2.py`), replayed as one CUDA graph per token count T <= rows.

    fixed buffer <- the step's aux rows [T, n_targets * D] (the target's stream means, concatenated)
    graph:  main_x = combine_hidden_states(aux); each stage's window rows stored at `slots[i]` (vLLM's slot mapping
            of the step for that stage's cache group; positions and slots are the runner's persistent buffers)

    A graph is keyed by T and the addresses of the positions and slot buffers it reads (a changed buffer gets a
    new capture); the first step of a key runs eagerly (warm-up, and that step's rows), the capture follows it.
    Larger steps (prefills), and all steps after a failed capture, run eagerly."""

    def __init__(self, drafter: DSparkDrafter, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        self.drafter, self.rows = drafter, rows
        self.aux = torch.zeros(rows, width, dtype=dtype, device=device)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps served by a graph

    def store(self, aux: list[torch.Tensor], positions: torch.Tensor, slots: list[torch.Tensor]) -> None:
        """aux: the target's aux hidden states (each [>= T, D]); positions, slots: [T] (slots per stage, in
        `get_draft_kv_cache_layer_names` order) -> every stage's context rows of the T tokens stored."""
        t = positions.shape[0]
        if t > self.rows or self.pool is None:
            self._write(torch.cat([a[:t] for a in aux], dim=-1), positions, slots)
            return
        torch.cat([a[:t] for a in aux], dim=-1, out=self.aux[:t])
        key = (t, positions.data_ptr(), *(s.data_ptr() for s in slots))
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        self._write(self.aux[:t], positions, slots)
        self._capture(key, positions, slots)

    def _write(self, aux: torch.Tensor, positions: torch.Tensor, slots: list[torch.Tensor]) -> None:
        self.drafter.precompute_and_store_context_kv(self.drafter.combine_hidden_states(aux), positions, slots)

    def _capture(self, key: tuple, positions: torch.Tensor, slots: list[torch.Tensor]) -> None:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=current_stream(), capture_error_mode="thread_local"):
                self._write(self.aux[:key[0]], positions, slots)
        except (RuntimeError, AssertionError) as e:
            logger.warning("vllm-deepinfer DSpark: capturing the context write of %d tokens failed (%s); it stays "
                           "eager", key[0], e)
            self.pool = None
            return
        self.graphs[key] = g


class DraftStepGraphs:
    """Fixed buffers and graphs of the DSpark draft step (module docstring).

    groups: KV-cache group id -> the drafter cache layers in it; k: num_speculative_tokens (the widest
    verification has 1 + k tokens per request); capture_graphs: False runs the fixed-buffer step eagerly (what
    the graphs replay; CPU tests check it there)."""

    def __init__(self, drafter: DSparkDrafter, capture: StreamCapture, vllm_config, groups: dict[int, list[str]],
                 k: int, max_reqs: int, device: torch.device, capture_graphs: bool):
        self.drafter, self.capture, self.vllm_config, self.groups, self.k = drafter, capture, vllm_config, groups, k
        rows = capture.features.shape[0]
        self.sizes = [r for r in padded_sizes(max_reqs) if r * (1 + k) <= rows]
        r_max = self.sizes[-1] if self.sizes else 0
        t_max = r_max * (1 + k)
        self.offsets = torch.zeros(r_max + 1, dtype=torch.int32, device=device)
        self.n_tokens = torch.zeros(1, dtype=torch.int32, device=device)
        self.positions = torch.zeros(t_max, dtype=torch.int64, device=device)
        self.anchors = torch.zeros(r_max, dtype=torch.int64, device=device)
        self.anchor_pos = torch.zeros(r_max, dtype=torch.int64, device=device)
        self.token = torch.arange(t_max, dtype=torch.int32, device=device)
        self.rows = torch.arange(r_max, device=device)
        self.tables: dict[int, torch.Tensor] = {}  # group id -> [r_max, blocks] int32, made on first use
        self.pool = torch.cuda.graph_pool_handle() if capture_graphs else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.steps = 0  # proposals served by this path (eager first runs included)

    def size_for(self, num_reqs: int, widest: int) -> int | None:
        """The padded request count R for a step of num_reqs requests with at most `widest` tokens each, or
        None (the step stays eager)."""
        if widest > 1 + self.k:
            return None
        return next((r for r in self.sizes if r >= num_reqs), None)

    def propose(self, r: int, n: int, metadata: dict[str, PagedCacheMetadata], tables: dict[int, torch.Tensor],
                query_start_loc: torch.Tensor, num_tokens: int, positions: torch.Tensor, anchors: torch.Tensor,
                anchor_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One proposal of N = n drafts (0: the context rows only) for B = len(anchors) <= r requests.
        metadata: the step's drafter cache metadata (by layer); tables: group id -> block table [>= B, blocks];
        query_start_loc: [B + 1] device offsets of the step's num_tokens target tokens; positions: [num_tokens];
        anchors, anchor_pos: [B].
        -> (tokens [B, n] int64, confidence [B, n] fp32), fresh tensors."""
        b = anchors.shape[0]
        self._load(r, b, tables, query_start_loc, num_tokens, positions, anchors, anchor_pos)
        fixed = {name: dataclasses.replace(metadata[name], block_table=self.tables[gid][:r], num_reqs=r)
                 for gid, names in self.groups.items() for name in names}
        self.steps += 1
        with set_forward_context(fixed, self.vllm_config, num_tokens=r * (1 + self.k)):
            graph = self.graphs.get((r, n))
            if graph is not None:
                graph[0].replay()
                out = graph[1]
            else:
                out = self._step(r, n, fixed)
                if self.pool is not None:  # `out` (this step's) stays outside the graph's pool
                    self._capture(r, n, fixed)
        return out[0][:b].clone(), out[1][:b].clone()

    def _capture(self, r: int, n: int, metadata: dict[str, PagedCacheMetadata]) -> None:
        """Capture `_step` for (r, n); if capturing fails, warn once and stay on the eager fixed-buffer step.

        Captured on vLLM's current stream, where the eager steps ran: kernels that take a per-stream workspace
        from vLLM's workspace manager (Marlin's locks) find the one allocated before the manager was locked; a
        side stream would ask for a new one and fail (H200, 2026-12-03)."""
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=current_stream(), capture_error_mode="thread_local"):
                captured = self._step(r, n, metadata)
        except (RuntimeError, AssertionError) as e:
            logger.warning("vllm-deepinfer DSpark: capturing the draft step for %d requests failed (%s); "
                           "drafting stays eager", r, e)
            self.pool = None
            return
        self.graphs[(r, n)] = (g, captured)

    def _load(self, r: int, b: int, tables: dict[int, torch.Tensor], query_start_loc: torch.Tensor,
              num_tokens: int, positions: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor) -> None:
        """Copy the step's inputs into the fixed buffers; padding requests get no tokens and block 0."""
        t_pad = r * (1 + self.k)
        self.offsets[: b + 1].copy_(query_start_loc[: b + 1])
        self.offsets[b + 1: r + 1].fill_(num_tokens)
        self.n_tokens.fill_(num_tokens)
        self.positions[:num_tokens].copy_(positions[:num_tokens])
        self.positions[num_tokens:t_pad].zero_()
        self.anchors[:b].copy_(anchors)
        self.anchors[b:r].zero_()
        self.anchor_pos[:b].copy_(anchor_pos)
        self.anchor_pos[b:r].zero_()
        for gid, table in tables.items():
            fixed = self.tables.get(gid)
            if fixed is None or fixed.shape[1] != table.shape[1]:
                fixed = self.tables[gid] = table.new_zeros(self.rows.shape[0], table.shape[1])
                self.graphs.clear()  # captured against the old buffer
            fixed[:b].copy_(table[:b])
            fixed[b:r].zero_()

    def _step(self, r: int, n: int, metadata: dict[str, PagedCacheMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured body, on the fixed buffers only -> (tokens [r, n], confidence [r, n])."""
        t_pad = r * (1 + self.k)
        token = self.token[:t_pad]
        req = torch.searchsorted(self.offsets[1: r + 1], token, right=True).clamp_(max=r - 1)
        keep = self.capture.valid[:t_pad] & (token < self.n_tokens)
        self.drafter.write_context(self.capture.features[:t_pad], req, self.positions[:t_pad], metadata, keep=keep)
        if n == 0:  # a cold drafter's proposal (`schedule.ColdDrafter`): the context rows only
            none = self.anchors.new_empty(r, 0)
            return none, none.float()
        block = DraftBatch(self.rows[:r], self.anchor_pos[:r], n, metadata)
        draft = self.drafter.draft(self.anchors[:r], block)
        return draft.tokens, draft.confidence
