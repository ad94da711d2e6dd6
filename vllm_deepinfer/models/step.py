"""Per-forward batch state shared by all layers of one step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_deepinfer import ops
from vllm_deepinfer.attention.backend import PagedCacheMetadata
from vllm_deepinfer.attention.caches import PagedCache


@dataclasses.dataclass
class RequestSpan:
    """Tokens [start, end) of the batch belong to request `req`, at positions first..first+n-1.

    `prompt_len` (bounded replay): the request's prompt length P; layers from the cut on run only its
    positions >= P - keep of their layer (`StepBatch.retained`); -1 = every position runs every layer.
    """

    req: int
    start: int
    end: int
    first_pos: int
    prompt_len: int = -1

    @property
    def last_pos(self) -> int:
        """Position of the span's last token (host arithmetic: no device read)."""
        return self.first_pos + self.end - self.start - 1

    def closed_groups(self, m: int) -> range:
        """Groups g of m positions closed by a token of this span (position m*g + m - 1 lies in it)."""
        return range(-(-(self.first_pos + 1) // m) - 1, (self.last_pos + 1) // m)

    def replay_from(self, keep: int | None) -> int:
        """First position of the request among a layer's last `keep` prompt positions (None: 0)."""
        return max(0, self.prompt_len - keep) if keep is not None and self.prompt_len >= 0 else 0

    def replay_skip(self, keep: int) -> int:
        """Leading tokens of the span outside the request's last `keep` prompt positions."""
        return min(max(0, self.replay_from(keep) - self.first_pos), self.end - self.start)

    def window_floor(self, window: int, floor_keep: int | None = None) -> int:
        """Lowest position any token of the span attends to in a window of `window` positions
        (`floor_keep`: a layer past the bounded-replay cut, whose rows below `replay_from(floor_keep)` are unwritten)."""
        return max(0, self.first_pos - window + 1, self.replay_from(floor_keep))


@dataclasses.dataclass
class WindowLayout:
    """Window rows of all prefill spans packed in one buffer: span s contributes its positions
    floor_s..last_s (rows `row_req`, `row_pos` [Rw]). Token t's window position p is packed row
    base[t] + p, valid where p >= lo[t] = max(pos - W + 1, floor of its request)."""

    row_req: torch.Tensor
    row_pos: torch.Tensor
    base: torch.Tensor
    lo: torch.Tensor

    @property
    def n_rows(self) -> int:
        return self.row_req.shape[0]


@dataclasses.dataclass
class CompressedLayout:
    """Compressed rows (ratio m) of all prefill spans packed in one buffer: span s contributes its rows
    0..n_rows_s-1, n_rows_s = (last_s + 1) // m (`row_req`, `row_id` [Rc]). Token t's row j is packed
    row base[t] + j; it sees n_visible[t] = (pos + 1) // m rows; n_rows[t] is its span's count;
    n_cols = max_s n_rows_s (host int: the width of per-token row lists)."""

    row_req: torch.Tensor
    row_id: torch.Tensor
    base: torch.Tensor
    n_visible: torch.Tensor
    n_rows: torch.Tensor
    n_cols: int


@dataclasses.dataclass
class PrefillLayout:
    """The prefill tokens [start, end) of a step (every span after the one-token requests), as device
    index tensors built once per step (and per window / ratio) from host ints, so layers handle all
    spans with a constant number of ops and no device read: `req` [P] block-table row and `pos` [P]
    position of each token (P = end - start)."""

    spans: list[RequestSpan]
    start: int
    end: int
    req: torch.Tensor
    pos: torch.Tensor
    _host: dict = dataclasses.field(default_factory=dict, repr=False)
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, spans: list[RequestSpan], device: torch.device) -> "PrefillLayout":
        """Layout of `spans` (consecutive, non-empty, in batch order)."""
        n = np.array([s.end - s.start for s in spans], dtype=np.int64)
        first = np.array([s.first_pos for s in spans], dtype=np.int64)
        req = np.repeat(np.array([s.req for s in spans], dtype=np.int64), n)
        offset = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)            # index within the span
        pos = np.repeat(first, n) + offset
        return cls(spans, spans[0].start, spans[-1].end, *_dev(req, pos, device=device), {"n": n, "pos": pos})

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    def window(self, w: int, floor_keep: int | None = None) -> WindowLayout:
        """Packed window rows of `w` positions (memoised per step); `floor_keep`: see `RequestSpan.window_floor`."""
        if ("w", w, floor_keep) not in self._memo:
            n, pos = self._host["n"], self._host["pos"]
            floor = np.array([s.window_floor(w, floor_keep) for s in self.spans], dtype=np.int64)
            last = np.array([s.last_pos for s in self.spans], dtype=np.int64)
            count = last - floor + 1
            row_start = np.cumsum(count) - count
            row_req = np.repeat(np.array([s.req for s in self.spans], dtype=np.int64), count)
            row_pos = np.repeat(floor, count) + np.arange(int(count.sum())) - np.repeat(row_start, count)
            base = np.repeat(row_start - floor, n)
            lo = np.maximum(pos - w + 1, np.repeat(floor, n))
            dev = self.req.device
            self._memo["w", w, floor_keep] = WindowLayout(*_dev(row_req, row_pos, base, lo, device=dev))
        return self._memo["w", w, floor_keep]

    def compressed(self, m: int) -> CompressedLayout:
        """Packed compressed rows of ratio `m` (memoised per step)."""
        if ("c", m) not in self._memo:
            n, pos = self._host["n"], self._host["pos"]
            rows = np.array([(s.last_pos + 1) // m for s in self.spans], dtype=np.int64)
            row_start = np.cumsum(rows) - rows
            row_req = np.repeat(np.array([s.req for s in self.spans], dtype=np.int64), rows)
            row_id = np.arange(int(rows.sum())) - np.repeat(row_start, rows)
            dev = self.req.device
            self._memo["c", m] = CompressedLayout(
                *_dev(row_req, row_id, np.repeat(row_start, n), (pos + 1) // m, np.repeat(rows, n), device=dev),
                int(rows.max(initial=0)))
        return self._memo["c", m]

    def closed(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request [G], group [G]) of every group of m positions that a prefill token closes."""
        if ("g", m) not in self._memo:
            groups = [s.closed_groups(m) for s in self.spans]
            req = np.repeat(np.array([s.req for s in self.spans], dtype=np.int64), [len(g) for g in groups])
            g = np.concatenate([np.arange(r.start, r.stop, dtype=np.int64) for r in groups] or [np.zeros(0, np.int64)])
            self._memo["g", m] = tuple(_dev(req, g, device=self.req.device))
        return self._memo["g", m]


def _dev(*arrays: np.ndarray, device: torch.device) -> list[torch.Tensor]:
    """Host int arrays -> int64 device tensors, in one copy that does not wait for the device.

    A plain `.to(cuda)` of pageable memory synchronises the stream (PyTorch's copy then calls
    cudaStreamSynchronize), so every layout built inside a layer drained the GPU's queue and the
    host could never run ahead of the kernels of an eager prefill. Here the arrays go through one
    pinned buffer (PyTorch's caching host allocator keeps it until the copy has run) and a
    non-blocking copy; the results are views of one device buffer."""
    sizes = [a.size for a in arrays]
    cuda = device.type == "cuda"
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=cuda)
    np.concatenate([np.ravel(a) for a in arrays], out=host.numpy(), casting="unsafe")
    return list((host.to(device, non_blocking=True) if cuda else host.to(device)).split(sizes))


@dataclasses.dataclass
class Retained:
    """Bounded replay: the tokens of a (sub-)batch that leave a layer from the cut on. rows: [T']
    indices into that batch's tokens (one-token requests first, as in the step); batch: their sub-batch."""

    rows: torch.Tensor
    batch: StepBatch


@dataclasses.dataclass
class StepBatch:
    """Layout of the scheduled tokens plus the buffers that index sources publish to consumers.

    token_ids/positions: [T]; `topk[l]`: [T, k] compressed-row ids selected by index source l
    (-1 = none); `candidates[l]`: [T, n_blocks] candidate block ids published by layer l.

    The first `n_dec` tokens take every layer's fixed-shape per-token path (`req` [n_dec] block-table
    row of each token, `live` [n_dec] False for the padding of a captured CUDA graph), which reads no
    host copy of the batch layout: in a mixed step the leading one-token requests (vLLM orders decodes first;
    token i is request i), and under adaptive verification first the leading verification requests whose
    host lengths may be an even split of the drafts (`PagedCacheMetadata.num_trimmed`; their tokens' requests
    come from the device offsets, their host total is exact); in a step of at most 1 + k tokens per request
    (decode, or the verification of up to k drafts: `PagedCacheMetadata.per_token`) every token. The path writes every
    token's cache rows before reading any, so a request's earlier tokens of the step are visible to its
    later ones. `spans` are the remaining requests (prefill chunks), all handled at once through
    `prefill` (None when there are none: a per-token step, what vLLM captures as a full CUDA graph).
    Tokens after the last span (padding) belong to no request. `replay_keep` (bounded replay, layers
    past the cut): the keep of the layer before, so window rows below a span's `replay_from(replay_keep)`
    were never written (None: every row was).

    Batch-invariant mode (`ops.batch_invariant()`): every token takes the fixed-shape per-token path
    (`req[i]` = the request of token i, `spans` empty), so a token's keys, index scores, selection and
    pooled groups are computed by the same ops in the same order whether it is decoded, prefilled, or
    recomputed, and whatever chunk it falls in. With bounded replay on, `token_spans` describe the requests
    of such a step on the host (token ranges, first positions, prompt lengths) so that `retained` can drop
    a request's early prompt tokens past the cut; every kept token is still computed by the same per-token
    ops, so its output is bitwise that of full prefill (empty in decode steps, where no token drops).
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
    prefill: PrefillLayout | None = None
    replay_keep: int | None = None
    token_spans: list[RequestSpan] = dataclasses.field(default_factory=list)
    _memo: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.prefill is None and self.spans:
            self.prefill = PrefillLayout.build(self.spans, self.token_ids.device)

    @property
    def has_cache(self) -> bool:
        """False in vLLM's dummy/profiling runs, which bring no cache metadata."""
        return bool(self.attn_metadata)

    @property
    def dec_positions(self) -> torch.Tensor:
        """Positions of the per-token path's tokens, [n_dec] int64."""
        return self.positions[: self.n_dec].long()

    def dec_visible_rows(self, m: int) -> torch.Tensor:
        """Compressed rows of ratio m each per-token path token sees, (pos + 1) // m: [n_dec] (memoised per step)."""
        return self.memo(("visible rows", m), lambda: (self.dec_positions + 1) // m)

    def dec_closes_group(self, m: int) -> torch.Tensor:
        """Whether each per-token path token closes its group of m (and is live): [n_dec] bool (memoised)."""
        return self.memo(("closes group", m), lambda: self.live & ((self.dec_positions + 1) % m == 0))

    def dec_window_start(self, w: int) -> torch.Tensor:
        """First position of each per-token path token's window of w: pos - (w - 1), [n_dec] (memoised)."""
        return self.memo(("window start", w), lambda: self.dec_positions - (w - 1))

    def assemble(self, dec: torch.Tensor | None, prefill: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor:
        """Rows of all T tokens from the decode rows [n_dec, ...] and the prefill rows [P, ...]; rows of
        padding tokens (after the last span) are `fill`."""
        parts = [p for p in (dec, prefill) if p is not None]
        n = sum(p.shape[0] for p in parts)
        t = self.token_ids.shape[0]
        if n < t:
            parts.append(parts[0].new_full((t - n, *parts[0].shape[1:]), fill))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def memo(self, key, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per step (and per `key`) for every layer that asks."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def token_cos_sin(self, table) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of every token's position in rotary `table`, computed once per step and table."""
        return self.memo(("rope", id(table)), lambda: table.cos_sin(self.positions))

    def meta(self, cache: PagedCache) -> PagedCacheMetadata:
        return self.attn_metadata[cache.prefix]

    def __iter__(self) -> Iterator[RequestSpan]:
        return iter(self.spans)

    @property
    def replay_spans(self) -> list[RequestSpan]:
        """The requests bounded replay may trim: the prefill spans, or in batch-invariant mode `token_spans`."""
        return self.token_spans or self.spans

    def replay_tokens(self) -> int:
        """Tokens of `replay_spans` (host int)."""
        return sum(s.end - s.start for s in self.replay_spans)

    def retained(self, keep: int) -> Retained | None:
        """Bounded replay: the sub-batch of the tokens among their request's last `keep` prompt
        positions (every one-token request, the kept tail of each span; in batch-invariant mode the kept
        tail of each request's tokens, all on the per-token path); None when no token drops.
        The sub-batch keeps this batch's `replay_keep` (the window floor of the layer it runs in)."""
        spans = self.replay_spans
        if not any(s.replay_skip(keep) for s in spans):
            return None
        per_token = bool(self.token_spans)
        t = 0 if per_token else self.n_dec
        parts, kept = [np.arange(t)], []
        for s in spans:
            skip = s.replay_skip(keep)
            n = s.end - s.start - skip
            if n:
                parts.append(np.arange(s.start + skip, s.end))
                kept.append(RequestSpan(s.req, t, t + n, s.first_pos + skip, s.prompt_len))
                t += n
        rows, = _dev(np.concatenate(parts), device=self.token_ids.device)  # host-built: one copy per layer
        # per-token step: every kept token stays on that path; else the one-token requests lead, the spans follow
        layout = (dict(spans=[], n_dec=t, req=self.req[rows], live=self.live[rows], token_spans=kept) if per_token
                  else dict(spans=kept, n_dec=self.n_dec, req=self.req, live=self.live))
        sub = StepBatch(self.token_ids[rows], self.positions[rows], attn_metadata=self.attn_metadata,
                        topk={l: v[rows] for l, v in self.topk.items()},
                        candidates={l: v[rows] for l, v in self.candidates.items()}, replay_keep=self.replay_keep,
                        **layout)
        return Retained(rows, sub)

    def replay_rows(self, keeps: tuple[int, ...]) -> list[int]:
        """Host row counts leaving the layers whose output keeps are `keeps` (non-increasing), as chained
        `retained` calls give them: every token (padding too) until one drops, then the one-token requests
        plus each span's kept tail."""
        rows, dropped = [], False
        kept_max = (0 if self.token_spans else self.n_dec) + self.replay_tokens()
        for keep in keeps:
            skips = [s.replay_skip(keep) for s in self.replay_spans]
            dropped = dropped or any(skips)
            rows.append(kept_max - sum(skips) if dropped else self.token_ids.shape[0])
        return rows

    def with_replay_keep(self, keep: int) -> "StepBatch":
        """This batch as the input of the layer after one that kept `keep` prompt positions."""
        return dataclasses.replace(self, replay_keep=keep)

    @classmethod
    def from_forward_context(cls, token_ids: torch.Tensor, positions: torch.Tensor,
                             replay: bool = False) -> "StepBatch":
        """The step's layout from vLLM's forward context. `replay` (bounded replay on): spans carry their
        request's prompt length (`RequestSpan.prompt_len`; requests that ask for prompt logprobs do not)."""
        attn_metadata = None
        if is_forward_context_available():
            attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, list):  # micro-batching is not used by this model
            attn_metadata = attn_metadata[0] if attn_metadata else None
        return cls.from_metadata(token_ids, positions, attn_metadata, replay)

    @classmethod
    def from_metadata(cls, token_ids: torch.Tensor, positions: torch.Tensor,
                      attn_metadata: dict[str, PagedCacheMetadata] | None,
                      replay: bool = False) -> "StepBatch":
        """The step's layout from its per-cache metadata (`from_forward_context`)."""
        if not attn_metadata:
            return cls(token_ids, positions, [], None)
        meta = next(iter(attn_metadata.values()))
        t, dev = token_ids.shape[0], token_ids.device
        if meta.per_token or ops.batch_invariant():  # decode / verification (maybe graph-padded); invariant: all
            qsl = meta.query_start_loc_device
            req = _token_requests(qsl, t)
            live = (torch.arange(t, device=dev) < qsl[-1]) & (meta.seq_lens[req] > 0)
            # invariant mode with replay: host spans of a step that may drop tokens (not decode: no host work)
            spans = _request_spans(meta, positions, replay, 0) if replay and not meta.per_token else []
            return cls(token_ids, positions, [], attn_metadata, n_dec=t, req=req, live=live, token_spans=spans)
        qsl = meta.query_start_loc[: meta.num_reqs + 1]                 # host tensor
        lead = (qsl[1:] - qsl[:-1]) == 1
        lead[: meta.num_trimmed] = True  # trimmed verifications: host lengths may be split, their total is exact
        n_lead = int(torch.cumprod(lead.long(), 0).sum()) if lead.numel() else 0
        n_dec = int(qsl[n_lead])
        req = _token_requests(meta.query_start_loc_device[: n_lead + 1], n_dec) if meta.num_trimmed \
            else torch.arange(n_dec, device=dev)
        return cls(token_ids, positions, _request_spans(meta, positions, replay, n_lead), attn_metadata, n_dec=n_dec,
                   req=req, live=torch.ones(n_dec, dtype=torch.bool, device=dev))


def _request_spans(meta: PagedCacheMetadata, positions: torch.Tensor, replay: bool, first: int) -> list[RequestSpan]:
    """Host spans of the step's requests `first`.. (those with tokens; host offsets exact from `first` on), with
    their prompt lengths when `replay` (bounded replay on and the runner gave them; else -1)."""
    qsl = meta.query_start_loc[: meta.num_reqs + 1]                     # host tensor
    if meta.seq_lens_cpu is not None:  # host copy: first position = tokens after the step - tokens of the step
        firsts = (meta.seq_lens_cpu[: meta.num_reqs] - (qsl[1:] - qsl[:-1])).tolist()
    else:  # one device read per step
        firsts = positions[qsl[:-1].clamp(max=max(positions.numel() - 1, 0)).to(positions.device)].tolist()
    qsl = qsl.tolist()
    prompt_lens = list(meta.prompt_lens) if replay and meta.prompt_lens is not None else [-1] * meta.num_reqs
    return [RequestSpan(r, qsl[r], qsl[r + 1], firsts[r], int(prompt_lens[r]))
            for r in range(first, meta.num_reqs) if qsl[r + 1] > qsl[r]]


def _token_requests(qsl: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Block-table row of each of the first `n_tokens` tokens, [n_tokens] int64, from device offsets qsl [R + 1]
    (tokens past qsl[R], graph padding, get row R - 1)."""
    i = torch.arange(n_tokens, device=qsl.device)
    return torch.searchsorted(qsl[1:], i.to(qsl.dtype), right=True).clamp(max=qsl.numel() - 2).long()
