"""Engram n-gram memory of DeepSeek-V4.1 (model-spec §3.9).

For each token, the n-grams (orders 2..max) ending at it are hashed into prime-sized buckets of
one FP8 table per Engram layer; the looked-up rows are projected to per-stream keys and one shared
value, and a per-stream gate adds the value into the residual streams. Previous token ids come
from a per-request token-history cache (a paged sliding window of max_ngram - 1 tokens), so
n-grams cross chunk and step boundaries.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vllm_deepinfer import ops
from vllm_deepinfer.attention.caches import PagedCache
from vllm_deepinfer.checkpoint import engram_hash
from vllm_deepinfer.checkpoint.formats import dequant_fp8_rows
from vllm_deepinfer.config import ArchConfig
from vllm_deepinfer.models.layers import Linear, _param
from vllm_deepinfer.models.step import RequestSpan, StepBatch
from vllm_deepinfer.moe.layer import IMAGE_TOKEN_SPAN


class EngramHasher(nn.Module):
    """Model-wide n-gram hashing state: token map, per-layer multipliers, primes and offsets."""

    def __init__(self, arch: ArchConfig, tokenizer_dir: str | Path):
        super().__init__()
        # from_numpy ignores the default device that vLLM builds the model under; place the map there.
        token_map = torch.from_numpy(engram_hash.compressed_token_map(str(tokenizer_dir))).long()
        token_map = token_map.to(torch.get_default_device())
        n_compressed = int(token_map.max()) + 1
        if n_compressed != arch.engram_compressed_vocab_size:
            raise ValueError(f"config field 'engram_compressed_vocab_size' is {arch.engram_compressed_vocab_size}, "
                             f"but the tokenizer in {tokenizer_dir} normalises to {n_compressed} ids")
        pad = int(token_map[arch.engram_pad_token_id])
        if arch.vocab_size > token_map.numel():  # ids the tokenizer never emits hash like padding
            token_map = torch.cat((token_map, torch.full((arch.vocab_size - token_map.numel(),), pad)))
        self.register_buffer("token_map", token_map, persistent=False)
        self.pad_id, self.max_ngram, self.n_heads = pad, arch.engram_max_ngram_size, arch.engram_n_heads
        self.image_token_id = arch.image_token_id
        primes = engram_hash.bucket_primes(arch.engram_vocab_size, arch.engram_n_heads, arch.engram_max_ngram_size,
                                           len(arch.engram_layer_ids))
        if [sum(p) for p in primes] != list(arch.engram_num_embeddings):
            raise ValueError(f"config field 'engram_num_embeddings' is {list(arch.engram_num_embeddings)}; "
                             f"the bucket primes give {[sum(p) for p in primes]}")
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(engram_hash.bucket_offsets(primes), dtype=torch.long),
                             persistent=False)
        mult = [engram_hash.hash_multipliers(l, n_compressed, self.max_ngram) for l in arch.engram_layer_ids]
        self.register_buffer("multipliers", torch.tensor(mult, dtype=torch.long), persistent=False)

    def hash_ids(self, table: int, history: torch.Tensor, history_valid: torch.Tensor) -> torch.Tensor:
        """Bucket rows of new tokens from their token history.

        history: [..., n + max_ngram - 1] raw token ids at positions first-(max_ngram-1) .. last;
        history_valid: same shape, False before the sequence start. Returns [..., n, (max_ngram-1) * n_heads].
        """
        k = self.max_ngram
        ids = self.token_map[history.long().clamp(0, self.token_map.numel() - 1)]  # padding rows may hold anything
        is_image = (history >= self.image_token_id) & (history < self.image_token_id + IMAGE_TOKEN_SPAN)
        dead = ~history_valid | (is_image if self.image_token_id >= 0 else torch.zeros_like(is_image))
        n = history.shape[-1] - (k - 1)
        dev = history.device
        look = torch.arange(n, device=dev).unsqueeze(1) + (k - 1) - torch.arange(k, device=dev)     # [n, k]: shift s back from token
        alive = torch.cumprod((~dead[..., look]).long(), dim=-1).bool()
        vals = torch.where(alive, ids[..., look], self.pad_id)                                     # [..., n, k]
        rolling = torch.zeros(vals.shape[:-1], dtype=torch.long, device=dev)
        cols = []
        for s in range(k):
            rolling = rolling ^ (vals[..., s] * self.multipliers[table, s])
            if s > 0:
                c = slice((s - 1) * self.n_heads, s * self.n_heads)
                cols.append(rolling.unsqueeze(-1) % self.primes[table, c] + self.offsets[table, c])
        return torch.cat(cols, dim=-1)


class Engram(nn.Module):
    """One Engram layer: table lookup, projection and gated injection into the streams."""

    def __init__(self, arch: ArchConfig, table: int, hasher: EngramHasher, history: PagedCache):
        super().__init__()
        self.table, self.hasher, self.history = table, [hasher], history
        self.hc, self.hidden, self.eps = arch.hc_mult, arch.hidden_size, arch.rms_norm_eps
        n_rows, d = arch.engram_num_embeddings[table], arch.engram_head_dim
        n_cols = (arch.engram_max_ngram_size - 1) * arch.engram_n_heads
        self.embed = EngramTable(n_rows, d)
        self.wkv = Linear(n_cols * d, (self.hc + 1) * self.hidden)
        self.q_weight = _param(self.hc, self.hidden)
        self.k_weight = _param(self.hc, self.hidden)
        self.image_token_id = arch.image_token_id

    def forward(self, streams: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """streams: [T, h, D] -> [T, h, D] with the gated Engram value added."""
        if not batch.has_cache:
            return streams
        hasher = self.hasher[0]
        rows = [hasher.hash_ids(self.table, *self.lookback_decode(batch))[:, 0]] if batch.n_dec else []
        rows = torch.cat(rows + [hasher.hash_ids(self.table, *self.lookback(batch, span)) for span in batch])
        emb = self.embed(rows).flatten(1)                                     # [T, cols * d]
        kv = self.wkv(emb).view(-1, self.hc + 1, self.hidden)
        keys, value = kv[:, : self.hc], kv[:, self.hc]
        xn = ops.rms_norm(streams, None, self.eps).float()
        kn = ops.rms_norm(keys, None, self.eps).float()
        dot = (xn * kn * (self.q_weight.float() * self.k_weight.float())).sum(-1) / self.hidden ** 0.5
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())   # [T, h]
        if self.image_token_id >= 0:
            ids = batch.token_ids
            is_image = (ids >= self.image_token_id) & (ids < self.image_token_id + IMAGE_TOKEN_SPAN)
            gate = gate.masked_fill(is_image.unsqueeze(1), 0.0)
        return (streams.float() + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(streams.dtype)

    def lookback(self, batch: StepBatch, span: RequestSpan) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids of the span plus the max_ngram-1 before it (from the history cache)."""
        k = self.hasher[0].max_ngram
        pos = span.pos(batch.positions.device, before=k - 1)
        valid = pos >= 0
        meta = batch.meta(self.history)
        ids = self.history.read(meta, span.req, pos.clamp(min=0))[:, 0]
        return torch.where(valid, ids, 0), valid

    def lookback_decode(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One-token requests: each token's id and the max_ngram-1 before it, [n_dec, max_ngram] each."""
        k = self.hasher[0].max_ngram
        pos = batch.dec_positions.unsqueeze(1) - (k - 1) + torch.arange(k, device=batch.positions.device)
        valid = pos >= 0
        ids = self.history.read(batch.meta(self.history), batch.req.unsqueeze(1), pos.clamp(min=0))[..., 0]
        return torch.where(valid, ids, 0), valid


class EngramTable(nn.Module):
    """FP8 table with one E8M0 scale per 32 values per row, decoded on lookup."""

    def __init__(self, n_rows: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(n_rows, dim, dtype=torch.float8_e4m3fn), persistent=False)
        self.register_buffer("scale", torch.zeros(n_rows, dim // 32, dtype=torch.float8_e8m0fnu), persistent=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, C] -> [T, C, dim] fp32 (no host round trip: the loader has rejected NaN codes)."""
        flat = rows.flatten()
        return dequant_fp8_rows(self.weight[flat], self.scale[flat], checked=False).view(*rows.shape, -1)


def write_token_history(history: PagedCache, batch: StepBatch) -> None:
    """Record this step's token ids in the shared token-history cache (before any Engram layer)."""
    if not batch.has_cache:
        return
    if batch.n_dec:
        ids = batch.token_ids[: batch.n_dec].view(-1, 1).expand(-1, history.width)
        history.write(batch.meta(history), batch.req, batch.dec_positions, ids, keep=batch.live)
    for span in batch:
        pos = span.pos(batch.positions.device)
        ids = batch.token_ids[span.start:span.end].view(-1, 1).expand(-1, history.width)
        history.write(batch.meta(history), span.req, pos, ids)
