"""Per-forward batch state shared by all layers of one step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_deepinfer.attention.backend import PagedCacheMetadata
from vllm_deepinfer.attention.caches import PagedCache


@dataclasses.dataclass
class RequestSpan:
    """Tokens [start, end) of the batch belong to request `req`, at positions first..first+n-1.

    `replay_from` (bounded replay): the request's first position that runs the layers past the cut;
    their window rows below it are never written (0 = every position runs every layer).
    """

    req: int
    start: int
    end: int
    first_pos: int
    replay_from: int = 0

    @property
    def last_pos(self) -> int:
        """Position of the span's last token (host arithmetic: no device read)."""
        return self.first_pos + self.end - self.start - 1

    def closed_groups(self, m: int) -> range:
        """Groups g of m positions closed by a token of this span (position m*g + m - 1 lies in it)."""
        return range(-(-(self.first_pos + 1) // m) - 1, (self.last_pos + 1) // m)

    def pos(self, device: torch.device, before: int = 0) -> torch.Tensor:
        """Positions of the span's tokens, preceded by `before` earlier positions (may be negative)."""
        return torch.arange(self.first_pos - before, self.first_pos + self.end - self.start, device=device)


@dataclasses.dataclass
class Retained:
    """Bounded replay: the tokens of a step that run the layers past the cut. rows: [T'] indices
    into the step's tokens (one-token requests first, as in the step); batch: their sub-batch."""

    rows: torch.Tensor
    batch: StepBatch


@dataclasses.dataclass
class StepBatch:
    """Layout of the scheduled tokens plus the buffers that index sources publish to consumers.

    token_ids/positions: [T]; `topk[l]`: [T, k] compressed-row ids selected by index source l
    (-1 = none); `candidates[l]`: [T, n_blocks] candidate block ids published by layer l.

    The first `n_dec` tokens belong to one-token requests (vLLM orders decodes first): token i is
    request i, and every layer handles them with its fixed-shape path (`req` [n_dec] block-table
    rows, `live` [n_dec] False for the padding of a captured CUDA graph), which reads no host copy of
    the batch layout. `spans` are the remaining requests (prefill chunks), handled one by one; a
    uniform decode step has none and is what vLLM captures as a full CUDA graph.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    spans: list[RequestSpan]
    attn_metadata: dict[str, PagedCacheMetadata] | None
    n_dec: int = 0
    req: torch.Tensor | None = None
    live: torch.Tensor | None = None
    topk: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    _rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)

    @property
    def has_cache(self) -> bool:
        """False in vLLM's dummy/profiling runs, which bring no cache metadata."""
        return bool(self.attn_metadata)

    @property
    def dec_positions(self) -> torch.Tensor:
        """Positions of the one-token requests, [n_dec] int64."""
        return self.positions[: self.n_dec].long()

    def token_cos_sin(self, table) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of every token's position in rotary `table`, computed once per step and table."""
        if id(table) not in self._rope:
            self._rope[id(table)] = table.cos_sin(self.positions)
        return self._rope[id(table)]

    def meta(self, cache: PagedCache) -> PagedCacheMetadata:
        return self.attn_metadata[cache.prefix]

    def __iter__(self) -> Iterator[RequestSpan]:
        return iter(self.spans)

    def retained(self) -> Retained | None:
        """Bounded replay: the sub-batch of the tokens at or after their request's `replay_from` (every
        one-token request, the retained tail of each span); None when this step drops no token."""
        if all(s.first_pos >= s.replay_from for s in self.spans):
            return None
        dev, t = self.token_ids.device, self.n_dec
        parts, spans = [torch.arange(t, device=dev)], []
        for s in self.spans:
            skip = min(max(0, s.replay_from - s.first_pos), s.end - s.start)
            n = s.end - s.start - skip
            if n:
                parts.append(torch.arange(s.start + skip, s.end, device=dev))
                spans.append(RequestSpan(s.req, t, t + n, s.first_pos + skip, s.replay_from))
                t += n
        rows = torch.cat(parts)
        sub = StepBatch(self.token_ids[rows], self.positions[rows], spans, self.attn_metadata, self.n_dec, self.req,
                        self.live, {l: v[rows] for l, v in self.topk.items()},
                        {l: v[rows] for l, v in self.candidates.items()})
        return Retained(rows, sub)

    @classmethod
    def from_forward_context(cls, token_ids: torch.Tensor, positions: torch.Tensor,
                             replay_keep: int | None = None) -> "StepBatch":
        """The step's layout from vLLM's forward context. `replay_keep` (bounded replay on): each
        request's last `replay_keep` prompt positions run the layers past the cut (`RequestSpan.replay_from`)."""
        attn_metadata = None
        if is_forward_context_available():
            attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, list):  # micro-batching is not used by this model
            attn_metadata = attn_metadata[0] if attn_metadata else None
        if not attn_metadata:
            return cls(token_ids, positions, [], None)
        meta = next(iter(attn_metadata.values()))
        t, dev = token_ids.shape[0], token_ids.device
        if meta.decode and meta.block_table.shape[0] >= t:  # uniform decode, possibly graph-padded
            n = min(t, meta.seq_lens.shape[0])
            live = torch.zeros(t, dtype=torch.bool, device=dev)
            live[:n] = meta.seq_lens[:n] > 0
            return cls(token_ids, positions, [], attn_metadata, n_dec=t, req=torch.arange(t, device=dev), live=live)
        qsl = meta.query_start_loc[: meta.num_reqs + 1]                 # host tensor
        one = (qsl[1:] - qsl[:-1]) == 1
        n_dec = int(torch.cumprod(one.long(), 0).sum()) if one.numel() else 0
        firsts = positions[qsl[:-1].clamp(max=max(positions.numel() - 1, 0)).to(positions.device)].tolist()
        qsl = qsl.tolist()
        starts = [0] * meta.num_reqs
        if replay_keep is not None and meta.prompt_lens is not None:
            starts = [max(0, p - replay_keep) if p >= 0 else 0 for p in meta.prompt_lens]
        spans = [RequestSpan(r, qsl[r], qsl[r + 1], firsts[r], starts[r]) for r in range(n_dec, meta.num_reqs)
                 if qsl[r + 1] > qsl[r]]
        return cls(token_ids, positions, spans, attn_metadata, n_dec=n_dec, req=torch.arange(n_dec, device=dev),
                   live=torch.ones(n_dec, dtype=torch.bool, device=dev))
