"""Patch: keep chunked prefill, prefix caching and the block size for DeepInfer models on CPU.

Reason: vLLM 0.32's `CpuPlatform.check_and_update_config` treats every MLA model without AMX as
"reference MLA": it forces `block_size = 16` and turns chunked prefill and prefix caching off
(vllm/platforms/cpu.py:244-293, :517-531), and for `deepseek_v4` forces block size 256. Those
limits belong to vLLM's own CPU MLA kernels. DeepInfer's models never use them: their caches are
model-driven paged caches that support chunked prefill and recompute on any block size, so the
user's (or vLLM's default) scheduling settings are restored after the platform hook.
"""

from __future__ import annotations

import functools

from vllm_deepinfer.registry import is_deepinfer_model

_PATCHED = "_deepinfer_patched"
DEFAULT_BLOCK_SIZE = 64


def apply() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config) -> None:
        if not is_deepinfer_model(vllm_config.model_config):
            return original(cls, vllm_config)
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        saved = (sched.enable_chunked_prefill, sched.max_num_batched_tokens, cache.enable_prefix_caching)
        block = cache.block_size if cache.user_specified_block_size else DEFAULT_BLOCK_SIZE
        original(cls, vllm_config)
        sched.enable_chunked_prefill, sched.max_num_batched_tokens, cache.enable_prefix_caching = saved
        cache.block_size = block

    setattr(check_and_update_config, _PATCHED, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
