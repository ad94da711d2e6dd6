"""Per-forward batch state shared by all layers of one step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_deepinfer import ops
from vllm_deepinfer.attention.backend import PagedCacheMetadata
from vllm_deepinfer.attention.caches import PagedCache


@dataclasses.dataclass
class RequestSpan:
    """Tokens [start, end) of the batch belong to request `req`, at positions first..first+n-1."""

    req: int
    start: int
    end: int
    first_pos: int

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
class StepBatch:
    """Layout of the scheduled tokens plus the buffers that index sources publish to consumers.

    token_ids/positions: [T]; `topk[l]`: [T, k] compressed-row ids selected by index source l
    (-1 = none); `candidates[l]`: [T, n_blocks] candidate block ids published by layer l.

    The first `n_dec` tokens belong to one-token requests (vLLM orders decodes first): token i is
    request i, and every layer handles them with its fixed-shape path (`req` [n_dec] block-table
    rows, `live` [n_dec] False for the padding of a captured CUDA graph), which reads no host copy of
    the batch layout. `spans` are the remaining requests (prefill chunks), handled one by one; a
    uniform decode step has none and is what vLLM captures as a full CUDA graph.

    Batch-invariant mode (`ops.batch_invariant()`): every token takes the fixed-shape per-token path
    (`req[i]` = the request of token i, `spans` empty), so a token's keys, index scores, selection and
    pooled groups are computed by the same ops in the same order whether it is decoded, prefilled,
    or recomputed, and whatever chunk it falls in. The path writes every token's cache rows before
    reading any, so a request's earlier tokens of the same step are visible to its later ones.
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

    @classmethod
    def from_forward_context(cls, token_ids: torch.Tensor, positions: torch.Tensor) -> "StepBatch":
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
        if ops.batch_invariant():
            counts = qsl[1:] - qsl[:-1]
            req = torch.repeat_interleave(torch.arange(meta.num_reqs), counts)
            live = torch.arange(t) < req.numel()
            req = torch.nn.functional.pad(req, (0, t - req.numel()))
            return cls(token_ids, positions, [], attn_metadata, n_dec=t, req=req.to(dev), live=live.to(dev))
        one = (qsl[1:] - qsl[:-1]) == 1
        n_dec = int(torch.cumprod(one.long(), 0).sum()) if one.numel() else 0
        firsts = positions[qsl[:-1].clamp(max=max(positions.numel() - 1, 0)).to(positions.device)].tolist()
        qsl = qsl.tolist()
        spans = [RequestSpan(r, qsl[r], qsl[r + 1], firsts[r]) for r in range(n_dec, meta.num_reqs)
                 if qsl[r + 1] > qsl[r]]
        return cls(token_ids, positions, spans, attn_metadata, n_dec=n_dec, req=torch.arange(n_dec, device=dev),
                   live=torch.ones(n_dec, dtype=torch.bool, device=dev))
