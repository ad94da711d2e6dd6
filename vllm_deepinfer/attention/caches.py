"""Paged caches of the hybrid attention state, as vLLM KV cache layers.

One `PagedCache` per cache kind per owning layer (model-spec §6.1):

| kind            | rows                         | spec                                  |
|-----------------|------------------------------|---------------------------------------|
| window KV       | one per token                | SlidingWindowMLASpec, window W        |
| compressed KV   | one per m tokens             | MLAAttentionSpec, tokens_per_state m  |
| index keys      | one per m tokens             | MLAAttentionSpec, tokens_per_state m  |
| compressor state| one per token ([kv ‖ score]) | SlidingWindowMLASpec, window = span   |
| token history   | one per token (token id)     | SlidingWindowMLASpec, window n-1      |

All specs of a model share one page size (`page_bytes`), so vLLM groups them without padding or
repacking; each spec's block size is page_bytes / row_bytes * m. Rows are addressed from
(request, position) through the group's block table: row `i` of a cache with m tokens per row
lives in block `block_table[req, i*m // block_size]`, slot `(i*m % block_size) // m`.

`--kv-cache-dtype fp8_ds_mla` (alias `fp8`; `kv_records`) stores the main model's window and compressed KV as
vLLM's 584-B ``fp8_ds_mla`` records (`RecordCache`): page_bytes // 584 records per page (112 of a 64-token
bf16 page: 1.75x the rows), the page's tail unused; such a block size carries a factor 7, so the scheduler's
block size (the LCM of all groups, where prefix-cache hits land) grows 7x.

V4.1 bounded replay (`models/replay.py`) changes two things: the window KV of the layers past the
cut (rows below a request's replay start are never written) is kept out of prefix caching and a
prefix hit is rewound by `keep` tokens (`ReplayWindowSpec`); with prefix caching on, the other
sliding-window caches retain `keep` more tokens, so a rewound hit resumes from cached rows.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import (
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

from vllm_deepinfer import ops
from vllm_deepinfer.attention.backend import PagedCacheBackend, PagedCacheMetadata
from vllm_deepinfer.ops import quant

#: --kv-cache-dtype values: exact rows of the model dtype, or fp8_ds_mla records ("fp8" is vLLM's alias).
EXACT_KV_DTYPES, RECORD_KV_DTYPES = ("auto", "bfloat16"), ("fp8_ds_mla", "fp8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayWindowSpec(SlidingWindowMLASpec):
    """Window KV past the bounded-replay cut: out of prefix caching (`bounded_replay`), and a hit is
    rewound by `replay_tokens` (the keep length; vLLM's own spec rewinds by the window), so the
    recomputed tail covers every retained row. Its block manager: `patches/replay_window_manager.py`."""

    replay_tokens: int = 0

    @property
    def prefix_replay_tokens(self) -> int:
        return self.replay_tokens

    @classmethod
    def merge(cls, specs: list["ReplayWindowSpec"]) -> "ReplayWindowSpec":
        # vLLM probes merges with any same-layout spec (AssertionError/ValueError = incompatible)
        assert all(isinstance(s, ReplayWindowSpec) for s in specs), "replay windows group only with replay windows"
        assert len({s.replay_tokens for s in specs}) == 1, "all replay windows of a group must agree"
        return dataclasses.replace(super().merge(specs), replay_tokens=specs[0].replay_tokens)


def cache_page_bytes(vllm_config: VllmConfig, head_dim: int, dtype: torch.dtype) -> int:
    """Common page size: one window-KV block of `cache_config.block_size` tokens."""
    block = vllm_config.cache_config.block_size
    if block < 16 or block & (block - 1):
        raise ValueError(f"DeepInfer caches need a power-of-two --block-size >= 16, got {block}")
    return block * head_dim * dtype.itemsize


def kv_records(vllm_config: VllmConfig) -> bool:
    """Whether --kv-cache-dtype asks for fp8_ds_mla records (the alias `fp8` is written back as `fp8_ds_mla`,
    as vLLM's in-tree V4 does); any value but those and auto/bfloat16 is an error."""
    cache = vllm_config.cache_config
    if cache.cache_dtype in EXACT_KV_DTYPES:
        return False
    if cache.cache_dtype not in RECORD_KV_DTYPES:
        raise ValueError(f"DeepInfer models take --kv-cache-dtype {' / '.join(EXACT_KV_DTYPES)} (exact rows of the "
                         f"model dtype) or {' / '.join(RECORD_KV_DTYPES)} (fp8_ds_mla window/compressed KV records), "
                         f"got {cache.cache_dtype!r}")
    cache.cache_dtype = "fp8_ds_mla"
    return True


class PagedCache(nn.Module, AttentionLayerBase):
    """One paged cache of `width` values of `dtype` per row, one row per `tokens_per_row` tokens.

    `window` (in tokens) makes it a sliding-window cache whose old blocks vLLM frees; None keeps
    every row (compressed KV, index keys).
    """

    whole_pages: ClassVar[bool] = True  # a page holds whole rows and nothing else

    def __init__(self, prefix: str, width: int, dtype: torch.dtype, page_bytes: int,
                 tokens_per_row: int = 1, window: int | None = None):
        super().__init__()
        self.prefix = prefix
        self.width = width
        self.dtype = dtype
        self.tokens_per_row = tokens_per_row
        self.window = window
        row_bytes = width * dtype.itemsize
        if page_bytes % row_bytes and self.whole_pages:
            raise ValueError(f"{prefix}: page of {page_bytes} B does not hold whole {row_bytes}-B rows")
        self.rows_per_block = page_bytes // row_bytes
        self.block_size = self.rows_per_block * tokens_per_row
        self.kv_cache = torch.tensor([])
        # Bounded replay, set by the model: `replay_tokens` > 0 marks window KV past the cut;
        # `retain_tokens` extends the window vLLM keeps (prefix hits rewound by that many tokens).
        self.replay_tokens = self.retain_tokens = 0
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    # -- vLLM layer contract ---------------------------------------------------------------
    def get_attn_backend(self):
        return PagedCacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        common = dict(block_size=self.block_size, num_kv_heads=1, head_size=self.width, dtype=self.dtype)
        if self.replay_tokens:
            return ReplayWindowSpec(sliding_window=self.window, bounded_replay=True, replay_tokens=self.replay_tokens,
                                    **common)
        if self.window is not None:
            return SlidingWindowMLASpec(sliding_window=self.window + self.retain_tokens, **common)
        return MLAAttentionSpec(tokens_per_state=self.tokens_per_row, **common)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_blocks, 1, rows_per_block, width] (any element type of the same bytes)."""
        if kv_cache.dtype != self.dtype:
            kv_cache = kv_cache.view(self.dtype)
        self.kv_cache = kv_cache.view(kv_cache.shape[0], self.rows_per_block, self.width)

    def forward(self):  # caches are read and written by their owning layers
        raise NotImplementedError

    # -- addressing ------------------------------------------------------------------------
    @property
    def rows(self) -> torch.Tensor:
        """All cache rows, [num_blocks * rows_per_block, width]."""
        return self.kv_cache.view(-1, self.width)

    def row_slots(self, meta: PagedCacheMetadata, req: int | torch.Tensor, row_ids: torch.Tensor,
                  masked: bool = False, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Flat slots of rows `row_ids` of request(s) `req` in `rows` (req broadcasts against row_ids;
        `ops.row_slots`).

        Row ids are clamped into the block table, so any id (e.g. of a padded token) maps to some slot;
        callers mask what they read (`masked`: -1 where the id is -1) and send writes they must drop to the
        null block (`keep` False: slot 0).
        """
        if not isinstance(req, torch.Tensor):
            req = torch.full((row_ids.shape[0],), req, dtype=torch.long, device=row_ids.device)
        return ops.row_slots(meta.block_table, req, row_ids, self.tokens_per_row, self.block_size,
                             self.rows_per_block, masked, keep)

    def masked_slots(self, meta: PagedCacheMetadata, req: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """`row_slots` of row ids [...] (-1 = none), -1 kept where the id is -1 (for in-place paged reads)."""
        return self.row_slots(meta, req, row_ids, masked=True)

    def range_slots(self, meta: PagedCacheMetadata, req: torch.Tensor, start: torch.Tensor, count: int,
                    stop: torch.Tensor | None = None) -> torch.Tensor:
        """Masked slots of rows start[t] .. start[t] + count - 1 of request req[t]; rows below 0 or at or above
        stop[t] -> -1. req, start, stop: [T] -> [T, count] (`ops.range_slots`)."""
        return ops.range_slots(meta.block_table, req, start, count, stop, self.tokens_per_row, self.block_size,
                               self.rows_per_block)

    def write(self, meta: PagedCacheMetadata, req: int | torch.Tensor, row_ids: torch.Tensor, values: torch.Tensor,
              keep: torch.Tensor | None = None) -> None:
        """Store rows `row_ids` [N] of request(s) `req`; values: [N, width]; rows where `keep` [N] is
        False go to the null block (fixed shapes for the decode path)."""
        if row_ids.numel():
            self.store_rows(self.row_slots(meta, req, row_ids, keep=keep), values)

    def store_rows(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [N, width] at flat slots [N] of `rows` (0 = the null block, for writes to drop)."""
        self.rows[slots] = values.to(self.dtype)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows at flat slots [...] -> [..., width]."""
        return self.rows[slots]

    def read(self, meta: PagedCacheMetadata, req: int | torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """Load rows `row_ids` [...] of request(s) `req` -> [..., width]."""
        return self.gather(self.row_slots(meta, req, row_ids))


class RecordCache(PagedCache):
    """A window or compressed KV cache of ``fp8_ds_mla`` records (`quant.kv_record_encode`): rows of 512 values
    stored as 584 B, read back dequantised to `dtype` (the model dtype), bitwise `quant.kv_record_roundtrip`.

    Block layout (vLLM's FlashMLA ``fp8_ds_mla`` block): R x 576 data bytes from the block start, then R x 8 scale
    bytes; R = page_bytes // 584, the rest of the page unused. Flat slot s is record s % R of block s // R, so
    `row_slots` / `range_slots` address records as they address rows. vLLM sees a uint8 spec of 584 B per state
    padded to the common page (`page_size_padded`), so its KV sizing counts the records.
    """

    whole_pages = False

    def __init__(self, prefix: str, width: int, dtype: torch.dtype, page_bytes: int,
                 tokens_per_row: int = 1, window: int | None = None):
        if width != quant.KV_RECORD_WIDTH:
            raise ValueError(f"{prefix}: fp8_ds_mla records hold {quant.KV_RECORD_WIDTH}-wide rows, not {width}")
        super().__init__(prefix, quant.KV_RECORD_BYTES, torch.uint8, page_bytes, tokens_per_row, window)
        # rows_per_block (R) and block_size (R * tokens_per_row) count records; values come back as `dtype`
        self.width, self.dtype, self.page_bytes = width, dtype, page_bytes

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        spec = super().get_kv_cache_spec(vllm_config)
        return dataclasses.replace(spec, dtype=torch.uint8, head_size=self.width, cache_dtype_str="fp8_ds_mla",
                                   state_content_bytes=quant.KV_RECORD_BYTES, page_size_padded=self.page_bytes)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_blocks, 1, R, 584] uint8 with a block stride of page_bytes -> pages [num_blocks, page_bytes]."""
        if kv_cache.stride(0) != self.page_bytes:
            raise ValueError(f"{self.prefix}: block stride {kv_cache.stride(0)} B, expected a {self.page_bytes}-B page")
        self.kv_cache = kv_cache.as_strided((kv_cache.shape[0], self.page_bytes), (self.page_bytes, 1))

    @property
    def rows(self) -> torch.Tensor:
        raise TypeError(f"{self.prefix} holds fp8_ds_mla records: read them with gather / ops.sparse_attention_records")

    def store_rows(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        ops.kv_record_store(self.kv_cache, slots, values, self.rows_per_block)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return ops.kv_record_gather(self.kv_cache, slots, self.rows_per_block, self.dtype)
