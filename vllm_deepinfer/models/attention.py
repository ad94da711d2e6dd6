"""Hybrid sparse attention of one layer (model-spec §3.4, §3.7).

Keys of a query at position p: its own layer's window (the last W positions, itself included) and,
for compressed layers, rows of the KV source's compressed cache: all visible rows (V4 HCA) or the
rows its index source selected (V4 CSA, V4.1). Values equal keys; a learned sink absorbs mass.

Tensor parallel (vLLM's TP group, the layout of vLLM's in-tree V4/V4.1): each rank owns H/tp query
heads (`wq_b` column-parallel, `attn_sink` split by heads) and the matching o_groups/tp groups of the
grouped `wo_a` (column-parallel); `wo_b` is row-parallel (all-reduce). `wq_a`, `wkv`, the compressor and
the indexer are replicated, so every rank holds the full latent KV, compressed rows and index keys, as
in vLLM's MLA models, and selects the same rows.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_deepinfer import ops
from vllm_deepinfer.attention.caches import PagedCache, RecordCache
from vllm_deepinfer.config import V4, ArchConfig, LayerPlan
from vllm_deepinfer.models.compressor import Compressor
from vllm_deepinfer.models.indexer import Indexer
from vllm_deepinfer.models.layers import ColumnLinear, Linear, RMSNorm, RowLinear, _param, head_sharded
from vllm_deepinfer.models.rope import RotaryTable
from vllm_deepinfer.models.step import Retained, StepBatch
from vllm_deepinfer.ops import quant


class Attention(nn.Module):
    queries_and_keys_share_input = True  # wq_a and wkv read the same x

    def __init__(self, arch: ArchConfig, plan: LayerPlan, rope: RotaryTable, prefix: str, page_bytes: int,
                 kv_records: bool = False):
        """`kv_records`: window and compressed KV as fp8_ds_mla records (`RecordCache`), else exact rows."""
        super().__init__()
        self.plan, self.rope = plan, rope
        d, h = arch.head_dim, arch.num_heads
        self.wq_a = Linear(arch.hidden_size, arch.q_lora_rank, prefix=f"{prefix}.wq_a")
        self.q_norm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
        self.wq_b = ColumnLinear(arch.q_lora_rank, h * d, prefix=f"{prefix}.wq_b")
        self.wkv = Linear(arch.hidden_size, d, prefix=f"{prefix}.wkv")
        self.kv_norm = RMSNorm(d, arch.rms_norm_eps)
        if self.queries_and_keys_share_input:  # one GEMM where Marlin serves both (in-tree: fused_wqa_wkv)
            self.wq_a.fuse_outputs(self.wkv)
        self.wo_a = ColumnLinear(h * d // arch.o_groups, arch.o_groups * arch.o_lora_rank, prefix=f"{prefix}.wo_a")
        self.wo_b = RowLinear(arch.o_groups * arch.o_lora_rank, arch.hidden_size, prefix=f"{prefix}.wo_b")
        tp = self.wq_b.tp_size
        # this rank's query heads and wo_a groups (ArchConfig.check_tensor_parallel guarantees divisibility)
        self.n_heads, self.head_dim, self.groups = h // tp, d, arch.o_groups // tp
        self.wo_a.groups = self.groups
        self.window, self.eps, self.scale = arch.window, arch.rms_norm_eps, arch.softmax_scale
        self.per_head_q_norm = arch.family == V4  # V4.1: "qr is normed before wq_b" (spec §7 Q6)
        self.attn_sink = head_sharded(_param(h // tp, dtype=torch.float32))
        dtype = torch.get_default_dtype()
        self.kv_records = kv_records
        self.parity_kv = quant.enabled("kv") and not kv_records  # records store exactly these values
        self.parity_wo_a = arch.family == V4 and quant.enabled("act")
        kv_cache = RecordCache if kv_records else PagedCache
        self.window_cache = kv_cache(f"{prefix}.window_cache", d, dtype, page_bytes, window=arch.window)
        self.compressor = self.compressed_cache = self.indexer = None
        if plan.owns_compressor:
            self.compressor = Compressor(arch.hidden_size, d, plan.ratio, overlap=plan.compressor_overlap,
                                         gated=plan.compressor_gated, with_ape=arch.family == V4,
                                         eps=arch.rms_norm_eps, prefix=f"{prefix}.compressor", page_bytes=page_bytes)
            self.compressed_cache = kv_cache(f"{prefix}.compressed_cache", d, dtype, page_bytes,
                                             tokens_per_row=plan.ratio)
        if plan.owns_indexer:
            self.indexer = Indexer(arch, plan, rope, f"{prefix}.indexer", page_bytes)
        # Caches of other layers (V4.1 sharing); set by the model once all layers exist.
        self.kv_source: PagedCache | None = self.compressed_cache

    def forward(self, x: torch.Tensor, batch: StepBatch, retained: Retained | None = None) -> torch.Tensor:
        """x: [T, D] (normalised attention input) -> [T, D].

        `retained` (bounded replay, the cut layer and those past it): every token's window KV (and the
        cut's compressed KV and index keys) are written, the queries run on the retained rows only -> [T', D].
        """
        cos, sin = batch.token_cos_sin(self.rope)
        cq, kv = self.wq_a.forward_group(x)  # x wq_a^T, x wkv^T
        kv = ops.apply_rope_(self.kv_norm(kv), cos, sin)  # in place: fresh tensors (here and below)
        if self.parity_kv:  # fp8_ds_mla window record
            kv = quant.kv_record_roundtrip(kv, rope_dim=2 * cos.shape[-1])
        if self.compressor is not None and batch.has_cache:
            self._compress(x, batch)
        if retained is not None:
            if batch.prefill is not None:  # every prefill token's window row; the retained ones attend below
                pf = batch.prefill
                self.window_cache.write(batch.meta(self.window_cache), pf.req, pf.pos, kv[pf.start:pf.end])
            elif batch.token_spans:  # batch-invariant mode: the same for every token of the step's requests
                n = batch.token_spans[-1].end
                self.window_cache.write(batch.meta(self.window_cache), batch.req[:n], batch.dec_positions[:n], kv[:n])
            r, batch = retained.rows, retained.batch
            x, cq, kv = x[r], cq[r], kv[r]
            if not r.shape[0]:  # every token of the step stops at this layer
                return x
            cos, sin = batch.token_cos_sin(self.rope)
        cq = self.q_norm(cq)  # queries only for the rows that leave the layer
        q = self.wq_b(cq).view(x.shape[0], self.n_heads, self.head_dim)
        if self.per_head_q_norm:
            q = ops.rms_norm(q, None, self.eps)
        q = ops.apply_rope_(q, cos, sin)
        if not batch.has_cache:  # vLLM dummy/profiling run (activations as in a real step): no cache to attend to
            return torch.zeros_like(x)
        selected = None
        if self.indexer is not None:
            selected = self.indexer(x, cq, batch)
        elif self.plan.index_source is not None:
            selected = batch.topk[self.plan.index_source]
        nd, pf = batch.n_dec, batch.prefill
        dec = pre = None
        if nd:
            dec = self._attend_decode(q[:nd], kv[:nd], batch, None if selected is None else selected[:nd])
        if pf is not None:
            rows = slice(pf.start, pf.end)
            stored = retained is not None  # window rows stored above
            pre = self._attend_prefill(q[rows], None if stored else kv[rows], batch,
                                       None if selected is None else selected[rows])
        out = batch.assemble(dec, pre)  # rows of padding tokens stay defined (0)
        if self.parity_wo_a:  # V4 fp8_einsum wo_a input: fp32 inverse RoPE, then per head 1x128 UE8M0
            out = quant.act_roundtrip(ops.apply_rope(out.float(), cos, sin, inverse=True), 128,
                                      bf16_first=False).to(out.dtype)
        else:
            out = ops.apply_rope_(out, cos, sin, inverse=True)
        # z = grouped wo_a product; wo_b as a Linear (parity: its W8A8 input quantiser runs on z)
        return self.wo_b(self.wo_a.matmul(out.flatten(1)))

    def _compress(self, x: torch.Tensor, batch: StepBatch) -> None:
        """Pool the groups closed in this step into compressed rows (and V4.1 index keys)."""
        closed = self.compressor(x, batch)
        for c in closed:
            cos, sin = self.rope.cos_sin(c.groups, self.plan.ratio)
            rows = ops.apply_rope(c.latent, cos, sin)
            if self.parity_kv:  # fp8_ds_mla compressed record
                rows = quant.kv_record_roundtrip(rows, rope_dim=2 * cos.shape[-1])
            self.compressed_cache.write(batch.meta(self.compressed_cache), c.req, c.groups, rows, keep=c.keep)
        if self.indexer is not None and self.indexer.key_cache is not None:
            self.indexer.write_keys(x, batch, latents=closed)

    def _attend_prefill(self, q: torch.Tensor, kv: torch.Tensor | None, batch: StepBatch,
                        selected: torch.Tensor | None) -> torch.Tensor:
        """All prefill spans at once. q: [P, H, d]; kv: [P, d] window rows to store (None: stored
        already); selected: [P, k] row ids of each token's request (-1 = none) or None (HCA) -> [P, H, d].

        Keys are one packed buffer: every span's window rows (its window floor .. last position,
        `PrefillLayout.window`), then every span's compressed rows 0 .. n_rows_s - 1
        (`PrefillLayout.compressed`); each token gets the packed ids of its own keys: its last W
        positions at or above its window lower bound, and its selected (HCA: visible) rows.
        Peak temporaries: (Rw + Rc) * d for the keys (Rw <= P + spans * (W - 1), Rc = the spans'
        compressed rows) plus P * (W + k) ids; never [P, Rw + Rc]. Past the bounded-replay cut, window
        rows below a request's `replay_from(batch.replay_keep)` were never written: the window floor excludes them.
        """
        pf = batch.prefill
        meta = batch.meta(self.window_cache)
        dev = q.device
        if kv is not None:
            self.window_cache.write(meta, pf.req, pf.pos, kv)
        win = pf.window(self.window, batch.replay_keep)
        keys = [self.window_cache.read(meta, win.row_req, win.row_pos)]
        window = pf.pos.unsqueeze(1) - self.window + 1 + torch.arange(self.window, device=dev)     # [P, W]
        ids = [torch.where(window >= win.lo.unsqueeze(1), window + win.base.unsqueeze(1), -1)]
        if self.plan.ratio > 0:
            c = pf.compressed(self.plan.ratio)
            if c.n_cols > 0:
                keys.append(self.kv_source.read(batch.meta(self.kv_source), c.row_req, c.row_id))
                if selected is None:  # HCA: every visible row
                    every = torch.arange(c.n_cols, device=dev)
                    selected = torch.where(every < c.n_visible.unsqueeze(1), every, -1)
                base = (c.base + win.n_rows).unsqueeze(1)
                ids.append(torch.where(selected >= 0, selected + base, -1))
        return ops.sparse_attention_indexed(q, torch.cat(keys), torch.cat(ids, dim=1), self.attn_sink, self.scale)

    def _attend_decode(self, q: torch.Tensor, kv: torch.Tensor, batch: StepBatch,
                       selected: torch.Tensor | None) -> torch.Tensor:
        """The one-token requests (fixed shapes, no host sync). q: [n_dec, H, d]; kv: [n_dec, d] -> [n_dec, H, d].

        Keys of a query: its last W window rows, then its selected compressed rows (HCA: every row up to
        max_model_len / m, masked to the visible ones), read in place from the two paged caches by slot.
        """
        meta = batch.meta(self.window_cache)
        pos = batch.dec_positions
        self.window_cache.write(meta, batch.req, pos, kv, keep=batch.live)
        win = self.window_cache.range_slots(meta, batch.req, batch.dec_window_start(self.window), self.window)  # [T, W]
        src, sel = self.window_cache, win[:, :0]  # SWA-only layer: an empty second key source
        if self.plan.ratio > 0:
            src, src_meta = self.kv_source, batch.meta(self.kv_source)
            if selected is None:  # HCA: every visible row, (pos + 1) // m of them
                zero = batch.memo("zero positions", lambda: torch.zeros_like(pos))
                sel = src.range_slots(src_meta, batch.req, zero, meta.max_model_len // self.plan.ratio + 1,
                                      batch.dec_visible_rows(self.plan.ratio))
            else:
                sel = src.masked_slots(src_meta, batch.req.unsqueeze(1), selected)
        if self.kv_records:  # both caches hold records, R of them per block
            return ops.sparse_attention_records(q, self.window_cache.kv_cache, win, src.kv_cache, sel,
                                                self.window_cache.rows_per_block, self.attn_sink, self.scale)
        return ops.sparse_attention_paged(q, self.window_cache.rows, win, src.rows, sel, self.attn_sink, self.scale)
