"""Attention backend of the hybrid cache: metadata builder and per-step metadata.

Every cache of the model (window KV, compressed KV, index keys, compressor state, token history)
is a paged cache owned by vLLM's KV cache manager. Each cache kind forms its own KV cache group
with its own block size; the builder hands every layer its group's block table plus the batch
layout, and the model addresses rows itself from (request, position), so one mechanism serves
prefill, chunked prefill, decode and recompute after preemption.

Steps whose requests have at most 1 + k query tokens each (decode: 1; the verification of up to k
drafts per request) take the model's fixed-shape per-token path, which reads only device tensors that
vLLM keeps in persistent buffers (block table, query start offsets, sequence lengths), so vLLM can
capture the uniform ones as full CUDA graphs (`UNIFORM_BATCH`; the V2 runner's varlen decode graphs
fit too). Padded requests of a captured batch have no query token, sequence length 0 and block-table
rows of the null block 0.

vLLM's V2 adaptive verification trims each verification request's drafts on the device: the device
`query_start_loc` holds the real lengths, the host copy an even split of the step's draft budget over the
leading verification requests (exact from the first request without drafts on, and in total). The
per-token path reads only the device offsets, so the builder reports the varlen decode graphs it can
replay (`get_varlen_cudagraph_max_query_len`) and the backend accepts the mismatch; in a mixed step the
runner names the leading requests whose host lengths may be split (`step_hints`, `num_trimmed`) and
`models/step.py` runs them on the per-token path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
    max_decode_query_len,
)


@dataclasses.dataclass
class PagedCacheMetadata:
    """Batch layout and one cache group's block table for one step.

    block_table: [R, max_blocks] block ids of the group; query_start_loc: [R + 1] (CPU);
    seq_lens: [R] tokens of each request after this step (device); seq_lens_cpu: its host copy where
    vLLM provides one (exact for the prefill rows, which are the only rows read from it); block_size: tokens per block;
    per_token: no request of the step has more query tokens than the widest verification (1 + k drafts;
    1 without speculation): the step takes the model's per-token path, which finds each token's request
    in `query_start_loc_device` (trailing requests with no token are graph padding);
    max_model_len: bound of every position (fixes the decode path's shapes);
    query_start_loc_device: [R + 1], the device copy of query_start_loc (the per-token path's only layout input);
    prompt_lens: prompt length of each request (host ints; -1 = run every layer on every token, e.g. for
    prompt logprobs), None where the runner gave none (bounded replay then runs every request in full);
    num_trimmed: the leading requests (verifications, which vLLM orders first) whose host query lengths may be
    adaptive verification's even split of the draft budget rather than the real ones (0: the host layout is
    exact); `query_start_loc[num_trimmed]` and every host offset after it are exact.
    """

    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    num_reqs: int
    num_tokens: int
    per_token: bool
    max_model_len: int
    query_start_loc_device: torch.Tensor
    seq_lens_cpu: torch.Tensor | None = None
    prompt_lens: tuple[int, ...] | None = None
    num_trimmed: int = 0


_step_hints: tuple[list[int], int] | None = None


@contextlib.contextmanager
def step_hints(prompt_lens: list[int], num_trimmed: int = 0) -> Iterator[None]:
    """Hand what the runner knows beyond vLLM's metadata to the metadata builders while it builds the step's
    metadata (`patches/replay_prompt_lens.py` for the V1 runner, `models/replay.py::ReplayModelState` for the
    V2 runner): the prompt lengths of the step's requests (in batch order, -1 = run in full) and the number of
    leading requests whose host query lengths adaptive verification may have split (`PagedCacheMetadata`)."""
    global _step_hints
    _step_hints = prompt_lens, num_trimmed
    try:
        yield
    finally:
        _step_hints = None


class PagedCacheMetadataBuilder(AttentionMetadataBuilder[PagedCacheMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: ClassVar[int | None] = 1  # one-token requests first: the model's fixed-shape prefix

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.widest_per_token = max_decode_query_len(vllm_config)  # 1 + k with k speculative tokens, else 1

    @classmethod
    def get_varlen_cudagraph_max_query_len(cls, vllm_config, kv_cache_spec) -> int | None:
        """vLLM's widest decode query (`max_decode_query_len`: 1 + k on V2): a full graph of a per-token step
        replays any decode batch of 1 to that many query tokens per request, since the per-token path finds each
        token's request in the device `query_start_loc` (V2's adaptive verification requires a bound >= 1 + k)."""
        return max_decode_query_len(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedCacheMetadata:
        m = common_attn_metadata
        r = m.num_reqs
        lens, num_trimmed = _step_hints or (None, 0)
        return PagedCacheMetadata(
            block_table=m.block_table_tensor[:r],
            query_start_loc=m.query_start_loc_cpu[: r + 1].clone(),
            seq_lens=m.seq_lens[:r],
            block_size=self.block_size,
            num_reqs=r,
            num_tokens=m.num_actual_tokens,
            per_token=m.max_query_len <= self.widest_per_token,
            max_model_len=self.max_model_len,
            query_start_loc_device=m.query_start_loc[: r + 1],
            seq_lens_cpu=None if m.seq_lens_cpu_upper_bound is None else m.seq_lens_cpu_upper_bound[:r],
            prompt_lens=None if lens is None else tuple(lens[:r]) + (-1,) * (r - len(lens)),
            num_trimmed=min(num_trimmed, r),
        )


class PagedCacheBackend(AttentionBackend):
    """Model-driven backend of every DeepInfer cache layer (selected by the layer, not by vLLM)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("DeepInfer layers run their own attention forward")

    @staticmethod
    def get_builder_cls() -> type[PagedCacheMetadataBuilder]:
        return PagedCacheMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """True: adaptive verification's even host split of the drafts is harmless here (module docstring)."""
        return True
