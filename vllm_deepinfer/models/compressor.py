"""KV compressor: one pooled row per m tokens (model-spec §3.5).

Per token it stores [kv ‖ score] (fp32) in a sliding-window state cache, so a group that spans
scheduler steps (chunked prefill, decode, recompute) is finished from the cache; when a token
closes a group it pools the group's rows with a per-dimension softmax over the slots.

* V4 ratio 4 (CSA), overlap: width 2w; a row pools the previous block's first halves and the
  current block's second halves (8 slots). V4 ratio 128 (HCA): width w, 128 slots. V4 adds `ape`.
* V4.1 ratio 2: gated, no ape, no overlap (2 slots). V4.1 ratio 1: ungated, the row is x W_kv.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from vllm_deepinfer import ops
from vllm_deepinfer.attention.caches import PagedCache
from vllm_deepinfer.models.layers import Linear, RMSNorm, _param
from vllm_deepinfer.models.step import StepBatch


@dataclasses.dataclass
class ClosedRows:
    """Compressed rows closed in one step: row `groups[i]` of request `req[i]` ([G]), normalised
    latent [G, w] fp32 without RoPE; `keep` [G] (decode path) is False for rows that are not really
    closed (fixed shapes: they are written to the null block)."""

    req: torch.Tensor
    groups: torch.Tensor
    latent: torch.Tensor
    keep: torch.Tensor | None = None


class Compressor(nn.Module):
    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, gated: bool, with_ape: bool,
                 eps: float, prefix: str, page_bytes: int):
        super().__init__()
        self.width, self.ratio, self.overlap, self.gated = width, ratio, overlap, gated
        c = 2 if overlap else 1
        # BF16 in the checkpoint, held in the model dtype; the projections run with fp32 outputs
        self.wkv = Linear(hidden, c * width)
        self.wgate = Linear(hidden, c * width) if gated else None
        self.ape = _param(ratio, c * width, dtype=torch.float32) if with_ape else None
        self.norm = RMSNorm(width, eps)
        self.state_cache = None
        if gated:
            span = (2 if overlap else 1) * ratio
            self.state_cache = PagedCache(f"{prefix}.state_cache", 2 * c * width, torch.float32, page_bytes,
                                          window=span)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> list[ClosedRows]:
        """Write this step's token state and pool every group a token of this step closes.

        x: [T, D] (the attention input). Returns the closed rows: one record for the one-token
        requests, one for all prefill spans — latents still without RoPE, applied at position m * g.
        """
        kv = ops.linear_fp32_out(x, self.wkv.weight)
        m, nd, pf = self.ratio, batch.n_dec, batch.prefill
        pos = batch.dec_positions
        if not self.gated:  # ratio 1: every token is its own group
            out = [ClosedRows(batch.req, pos, self.norm(kv[:nd]), batch.live)] if nd else []
            if pf is not None:
                out.append(ClosedRows(pf.req, pf.pos, self.norm(kv[pf.start:pf.end])))
            return out
        score = ops.linear_fp32_out(x, self.wgate.weight)
        if self.ape is not None:
            score = score + self.ape[batch.positions.long() % m]
        state = torch.cat((kv, score), dim=-1)
        meta = batch.meta(self.state_cache)
        out = []
        if nd:  # one-token requests: each pools its group; only tokens that close one keep the row
            self.state_cache.write(meta, batch.req, pos, state[:nd], keep=batch.live)
            g = batch.memo(("group", m), lambda: pos // m)  # the same for every layer of this ratio
            slots = batch.memo(("pool slots", m, self.overlap), lambda: self._slots(g))
            latent = self.norm(self._pool(meta, batch.req.unsqueeze(1), slots))
            out.append(ClosedRows(batch.req, g, latent, batch.dec_closes_group(m)))
        if pf is not None:  # prefill: all spans' states in one write, all closed groups in one pool
            self.state_cache.write(meta, pf.req, pf.pos, state[pf.start:pf.end])
            req, g = pf.closed(m)
            if g.numel():
                out.append(ClosedRows(req, g, self.norm(self._pool(meta, req.unsqueeze(1), self._slots(g)))))
        return out

    def _slots(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """groups [G] -> (positions [G, S] of the token states each group pools, clamped to >= 0; invalid [G, S, 1]:
        the positions before the first token), S = 2m with overlap, else m."""
        m = self.ratio
        n_slots = 2 * m if self.overlap else m
        first = groups * m - (m if self.overlap else 0)
        tok = first.unsqueeze(1) + torch.arange(n_slots, device=groups.device)            # [G, S]
        return tok.clamp(min=0), (tok < 0).unsqueeze(-1)

    def _pool(self, meta, req: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Softmax-pool the cached token states at `slots` (`_slots` of the groups; requests req [G, 1]) -> [G, w]
        fp32."""
        m, w = self.ratio, self.width
        tok, invalid = slots
        rows = self.state_cache.read(meta, req, tok).float()                              # [G, S, 2cw]
        c = 2 if self.overlap else 1
        kv, score = rows[..., : c * w], rows[..., c * w:]
        if self.overlap:  # previous block through its first half, current block through its second
            kv = torch.cat((kv[:, :m, :w], kv[:, m:, w:]), dim=1)
            score = torch.cat((score[:, :m, :w], score[:, m:, w:]), dim=1)
        kv = kv.masked_fill(invalid, 0.0)
        score = score.masked_fill(invalid, float("-inf"))
        return ops.softmax_pool(kv, score)
