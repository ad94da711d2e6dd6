"""No per-token slot mappings for the KV-cache groups of DeepInfer models on the V1 runner.

Reason: vLLM 0.32's V1 runner computes, every step, a token -> cache-slot mapping for every KV-cache group
(`MultiGroupBlockTable.compute_slot_mapping`: one Triton launch per group, wrapped by vLLM's JIT monitor),
for attention backends that write the KV cache from it. Our paged-cache backend never reads it: the model
addresses rows itself from (request, position) and the group's block table (`attention/backend.py`). A
DeepInfer model has one group per cache kind and layer set (the tiny V4.1 with its DSpark drafter: 22),
so the V1 runner (which speculation runs on, `patches/drafters_v1.py`) spends 22 launches per step on
mappings nobody reads. Measured (H100, 2026-12-06, tiny V4.1, DSpark noise drafter, varlen, batch 1,
cProfile of 128 steps): `compute_slot_mapping` 254 ms of the 665 ms in `execute_model`.

vLLM already skips the computation for groups whose `BlockTable.slot_mapping_mode` is `NONE` (Mamba-like
state caches). This patch sets that mode, after the runner builds its input batch
(`GPUModelRunner.may_reinitialize_input_batch`), on the groups whose every layer runs our backend. The
slot-mapping buffers stay (vLLM still hands them, unfilled, to the forward context, where nothing of ours
reads them); block tables, their widths and everything else are unchanged. Groups of other backends keep
vLLM's mapping, and so does every group when a KV connector is configured (connectors may read the
mappings to move KV).
"""

from __future__ import annotations

import functools


def deepinfer_groups(vllm_config, kv_cache_config) -> list[int]:
    """Ids of the KV-cache groups whose every layer uses DeepInfer's paged-cache backend."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from vllm_deepinfer.attention.backend import PagedCacheBackend

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    return [gid for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            if group.layer_names and all(name in layers and issubclass(layers[name].get_attn_backend(),
                                                                        PagedCacheBackend)
                                         for name in group.layer_names)]


def apply() -> None:
    from vllm.v1.worker import gpu_model_runner as gmr
    from vllm.v1.worker.block_table import SlotMappingMode

    runner_cls = gmr.GPUModelRunner
    reinit = runner_cls.may_reinitialize_input_batch
    if getattr(reinit, "_deepinfer", False):
        return

    @functools.wraps(reinit)
    def reinit_without_our_mappings(self, kv_cache_config, *args, **kwargs):
        reinit(self, kv_cache_config, *args, **kwargs)
        if self.vllm_config.kv_transfer_config is not None:
            return
        tables = self.input_batch.block_table.block_tables
        if len(tables) != len(kv_cache_config.kv_cache_groups):  # an encoder-only group shifts the ids: leave it
            return
        for gid in deepinfer_groups(self.vllm_config, kv_cache_config):
            tables[gid].slot_mapping_mode = SlotMappingMode.NONE

    reinit_without_our_mappings._deepinfer = True
    runner_cls.may_reinitialize_input_batch = reinit_without_our_mappings
