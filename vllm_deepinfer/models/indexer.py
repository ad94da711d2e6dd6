"""Lightning indexer: top-k selection of compressed rows (model-spec §3.6).

An index source scores every valid compressed row of its key cache and publishes the top-k row
ids per token in `StepBatch.topk`; index consumers reuse them (V4.1 index sharing). The V4.1
candidate source also publishes the best `candidate_topk_blocks` blocks of rows, to which later
index sources restrict their scores (two-level filter). Index keys are written here too: V4 pools
them with the indexer's own compressor; V4.1 derives them from the KV source's latent rows.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_deepinfer import ops
from vllm_deepinfer.attention.caches import PagedCache
from vllm_deepinfer.config import V4, ArchConfig, LayerPlan
from vllm_deepinfer.models.compressor import Compressor
from vllm_deepinfer.models.layers import Linear, RMSNorm
from vllm_deepinfer.models.rope import RotaryTable
from vllm_deepinfer.models.step import StepBatch
from vllm_deepinfer.ops import quant


SCORE_TILE_BYTES = 512 << 20  # bound of the prefill scoring temporaries of one token tile


class Indexer(nn.Module):
    def __init__(self, arch: ArchConfig, plan: LayerPlan, rope: RotaryTable, prefix: str, page_bytes: int):
        super().__init__()
        self.plan, self.rope = plan, rope
        self.n_heads, self.head_dim, self.topk = arch.index_n_heads, arch.index_head_dim, arch.index_topk
        self.ratio = plan.ratio
        self.parity_k, self.parity_q = quant.enabled("index_k"), quant.enabled("index_q")
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        self.block_rows, self.n_blocks = arch.candidate_block_size, arch.candidate_topk_blocks
        self.candidate_layer = arch.candidate_source_layer_id
        self.wq_b = Linear(arch.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(arch.hidden_size, self.n_heads)
        self.compressor = self.wk = self.k_norm = self.key_cache = None
        if plan.owns_index_keys:
            if arch.family == V4:
                self.compressor = Compressor(arch.hidden_size, self.head_dim, plan.ratio, overlap=True, gated=True,
                                             with_ape=True, eps=arch.rms_norm_eps,
                                             prefix=f"{prefix}.compressor", page_bytes=page_bytes)
            else:
                self.wk = Linear(arch.head_dim, self.head_dim)
                self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.key_cache = PagedCache(f"{prefix}.key_cache", self.head_dim, torch.get_default_dtype(), page_bytes,
                                        tokens_per_row=plan.ratio)
        self.key_source: PagedCache | None = self.key_cache  # set by the model for V4.1 non-owners

    # -- keys ----------------------------------------------------------------------------------
    def write_keys(self, x: torch.Tensor, batch: StepBatch, latents=None) -> None:
        """Store index keys of the rows closed in this step.

        V4: pooled from x [T, D] by the indexer's compressor. V4.1: `latents`, the closed rows of
        the KV source's compressor.
        """
        closed = self.compressor(x, batch) if self.compressor is not None else latents
        for c in closed:
            latent = c.latent
            if self.compressor is None:
                latent = self.k_norm(self.wk(latent.to(self.wk.weight.dtype)).float())
            cos, sin = self.rope.cos_sin(c.groups, self.ratio)
            keys = ops.apply_rope(latent, cos, sin)
            if self.parity_k:  # FP8 index K cache, one pow2 scale per row
                keys = quant.index_key_roundtrip(keys)
            self.key_cache.write(batch.meta(self.key_cache), c.req, c.groups, keys, keep=c.keep)

    # -- selection -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cq: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Select rows for every token and publish them. x: [T, D]; cq: [T, Q] -> ids [T, k] (-1 = none)."""
        t = x.shape[0]
        q = self.wq_b(cq).view(t, self.n_heads, self.head_dim)
        cos, sin = batch.token_cos_sin(self.rope)
        q = ops.apply_rope_(q, cos, sin)  # in place: wq_b's fresh output
        if self.parity_q:  # FP8 index q, one pow2 scale per (token, head)
            q = quant.index_query_roundtrip(q)
        w = self.weights_proj(x).float() * self.weight_scale
        nd, pf = batch.n_dec, batch.prefill
        cands = batch.candidates.get(self.candidate_layer) if self.plan.candidate_consumer else None
        dec = pre = (None, None)
        if nd:
            dec = self._select_decode(q[:nd], w[:nd], batch, None if cands is None else cands[:nd])
        if pf is not None:
            rows = slice(pf.start, pf.end)
            pre = self._select_prefill(q[rows], w[rows], batch, None if cands is None else cands[rows])
        ids = batch.assemble(dec[0], pre[0], fill=-1)
        batch.topk[self.plan.layer_id] = ids
        if self.plan.candidate_source:
            batch.candidates[self.plan.layer_id] = batch.assemble(dec[1], pre[1], fill=-1)
        return ids

    def _select_prefill(self, q: torch.Tensor, w: torch.Tensor, batch: StepBatch,
                        cands: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Selection for all prefill tokens at once. q: [P, H_I, d_I]; w: [P, H_I]; cands: published
        candidate blocks [P, n_blocks] (consumers). Returns ids [P, k] and, for the candidate source,
        its blocks [P, n_blocks].

        Every span's index-key rows are packed into one buffer (`PrefillLayout.compressed`); token t
        scores only its own request's visible rows (`ops.indexer_scores_ragged`), in token tiles of
        `_token_tile` so the score temporaries stay under SCORE_TILE_BYTES whatever the total key
        count: peak about tile * n_cols * per-entry bytes, n_cols = the longest span's row count.
        Tokens of a span with at most k rows select all their visible rows (ascending) and publish
        no candidate blocks.
        """
        pf, dev = batch.prefill, q.device
        c = pf.compressed(self.ratio)
        n = q.shape[0]
        cols = torch.arange(self.topk, device=dev)
        ids = torch.where(cols < c.n_visible.unsqueeze(1), cols, -1)          # spans with <= k rows
        blocks = (torch.full((n, max(self.n_blocks, 1)), -1, dtype=torch.long, device=dev)
                  if self.plan.candidate_source else None)
        if c.n_cols <= self.topk:  # every span selects all its visible rows
            return ids, blocks
        keys = self.key_source.read(batch.meta(self.key_source), c.row_req, c.row_id)
        full = c.n_rows <= self.topk
        tile = self._token_tile(c.n_cols)
        sel, cand = [], []
        for s in range(0, n, tile):
            t = slice(s, s + tile)
            scores = ops.indexer_scores_ragged(q[t], w[t], keys, c.base[t], c.n_visible[t], c.n_cols)
            if blocks is not None:
                cand.append(self._candidate_blocks(scores, c.n_visible[t]))
            if cands is not None:
                scores = self._restrict_to_blocks(scores, cands[t])
            sel.append(ops.topk_rows(scores, self.topk, c.n_visible[t]))
        sel = sel[0] if len(sel) == 1 else torch.cat(sel)
        ids = torch.where(full.unsqueeze(1), ids, sel)
        if blocks is not None:
            blocks = torch.where(full.unsqueeze(1), blocks, cand[0] if len(cand) == 1 else torch.cat(cand))
        return ids, blocks

    @staticmethod
    def _token_tile(n_cols: int) -> int:
        """Tokens per scoring tile: [tile, n_cols] scores plus their sort (~32 B per entry) within
        SCORE_TILE_BYTES (the ops bound their own temporaries below that)."""
        return max(1, SCORE_TILE_BYTES // (n_cols * 32))

    def _select_decode(self, q: torch.Tensor, w: torch.Tensor, batch: StepBatch,
                       cands: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fixed-shape selection for the one-token requests: every row up to max_model_len / m is scored.

        q: [n_dec, H_I, d_I]; w: [n_dec, H_I]; cands: published candidate blocks [n_dec, n_blocks] (consumers).
        Returns ids [n_dec, k] and, for the candidate source, its blocks [n_dec, n_blocks].
        """
        meta = batch.meta(self.key_source)
        n_valid = batch.dec_visible_rows(self.ratio)                                        # [n]
        scores = ops.indexer_scores_paged(q, w, self.key_source.rows, meta.block_table[batch.req], n_valid,
                                          meta.max_model_len // self.ratio + 1, self.key_source.rows_per_block)
        blocks = self._candidate_blocks(scores, n_valid) if self.plan.candidate_source else None
        if cands is not None:
            scores = self._restrict_to_blocks(scores, cands)
        return ops.topk_rows(scores, self.topk, n_valid), blocks

    def _candidate_blocks(self, scores: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        """Block score = max over its rows; the newest valid block is forced. scores: [n, n_rows] (-inf from
        n_valid[t] on) -> [n, n_blocks]. Blocks past the newest are -inf: the top-k reads newest + 1 blocks."""
        n, n_rows = scores.shape
        nb = -(-n_rows // self.block_rows)
        padded = torch.nn.functional.pad(scores, (0, nb * self.block_rows - n_rows), value=float("-inf"))
        block_scores = padded.view(n, nb, self.block_rows).amax(-1)
        newest = ((n_valid - 1) // self.block_rows).clamp(min=0)
        block_scores.scatter_(1, newest.unsqueeze(1), float("inf"))
        return ops.topk_rows(block_scores, self.n_blocks, newest + 1)

    def _restrict_to_blocks(self, scores: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Keep only rows inside the published candidate blocks [n, n_blocks] (-1 = none)."""
        n, n_rows = scores.shape
        nb = -(-n_rows // self.block_rows)
        keep = torch.zeros(n, nb + 1, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, torch.where(blocks >= 0, blocks, nb), True)
        keep = keep[:, :nb].repeat_interleave(self.block_rows, dim=1)[:, :n_rows]
        return scores.masked_fill(~keep, float("-inf"))
