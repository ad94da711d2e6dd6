"""Block manager of the bounded-replay window KV (`attention.caches.ReplayWindowSpec`) in vLLM's KV cache manager.

Reason: vLLM 0.32 admits a prefix hit with the hit's full length and gives a sliding-window group null blocks
below hit - W + 1 (`SlidingWindowManager.get_num_skipped_tokens`, `vllm/v1/core/single_type_kv_cache_manager.py`),
which covers in-tree's rewind of W tokens. Our replay rewinds a hit by `replay_tokens` (the keep length) > W, so
the window rows the recomputed tail writes between hit - replay_tokens and hit - W went to the null block and
later reads got garbage (fp32 tiny V4.1, 512-token hit: 2.7e-4 logprob drift; fixed: 1.4e-6). The manager below
skips only below hit - replay_tokens - W + 1 at admission; while vLLM frees blocks as the request advances
(`remove_skipped_blocks`, which asks `get_num_skipped_tokens` itself) it keeps the plain window, so no memory
stays held after the first step. It is registered for `ReplayWindowSpec` through vLLM's `KVCacheSpecRegistry`,
whose built-in specs are registered first (the registry fills itself only while empty: `_ensure_registered`).

Applied by `apply_all`: every process that builds a KV cache manager (the engine core) loads the plugin.
"""

from __future__ import annotations


def apply() -> None:
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_deepinfer.attention.caches import ReplayWindowSpec

    class ReplayWindowManager(SlidingWindowManager):
        """`SlidingWindowManager` whose admission keeps `replay_tokens` more rows below a prefix hit."""

        def __init__(self, kv_cache_spec: ReplayWindowSpec, **kwargs) -> None:
            super().__init__(kv_cache_spec, **kwargs)
            self.replay_tokens = kv_cache_spec.replay_tokens
            self._freeing = False

        def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
            lead = 0 if self._freeing else self.replay_tokens
            return max(0, super().get_num_skipped_tokens(num_computed_tokens) - lead)

        def remove_skipped_blocks(self, *args, **kwargs) -> None:
            self._freeing = True
            try:
                super().remove_skipped_blocks(*args, **kwargs)
            finally:
                self._freeing = False

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(ReplayWindowSpec, ReplayWindowManager, uniform_type_base_spec=SlidingWindowMLASpec)
