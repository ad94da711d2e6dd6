"""Runner choice for DeepInfer's drafters (`patches/drafters_v1.py`), on vLLM's own engine config: the V1 runner
accepts DSpark and `enable_adaptive_verification` for our drafters, and the V2 runner is refused by name where
our V1 hooks are needed (DSpark always; MTP with varlen or batch-invariant drafts)."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_checkpoint


def _config(ckpt, method: str, **spec):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=256, gpu_memory_utilization=0.2,
                      speculative_config={"method": method, "num_speculative_tokens": 2, **spec})
    return args.create_engine_config()


@pytest.mark.parametrize("arch,method", [("v4-flash", "mtp"), ("v4.1-flash", "dspark")])
def test_adaptive_verification_is_ours_on_v1(ckpt_root, arch, method):
    """`enable_adaptive_verification` set on a built config (vLLM refuses it at construction on CPU, which has
    no full CUDA graphs): the V1 list no longer refuses it for our drafters, and V2 is refused by name."""
    from vllm_deepinfer.patches.drafters_v1 import V2_GAP, V2_GAP_MTP

    cfg = _config(tiny_checkpoint(ckpt_root, arch, 0, drafter="reproduce"), method)
    cfg.speculative_config.enable_adaptive_verification = True
    assert cfg._get_v1_model_runner_unsupported_features() == []
    assert (V2_GAP if method == "dspark" else V2_GAP_MTP) in cfg._get_v2_model_runner_unsupported_features()


def test_fixed_mtp_keeps_vllms_runner_choice(ckpt_root, monkeypatch):
    from vllm_deepinfer.patches.drafters_v1 import V2_GAP_MTP

    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN", raising=False)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    ckpt = tiny_checkpoint(ckpt_root, "v4-flash", 0, drafter="reproduce")
    assert V2_GAP_MTP not in _config(ckpt, "mtp")._get_v2_model_runner_unsupported_features()
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    assert V2_GAP_MTP in _config(ckpt, "mtp")._get_v2_model_runner_unsupported_features()


def test_dspark_v2_opt_in(ckpt_root, monkeypatch):
    """`VLLM_DEEPINFER_DSPARK_V2=1` leaves fixed-length DSpark to vLLM's runner choice (V2 on CUDA), whose DSpark
    speculator then takes the target's aux hidden states at the drafter's target layers (vLLM's own lookup on our
    config, `SupportsEagle3` on our class); DEEPINFER_ENABLE_MTP_VARLEN where it did not become vLLM's adaptive
    verification (here: no Triton) keeps V1 (our policy's hooks)."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    from vllm_deepinfer.config import ArchConfig
    from vllm_deepinfer.models.deepseek import DeepseekV41ForCausalLM
    from vllm_deepinfer.patches.drafters_v1 import DSPARK_V2_ENV, V2_GAP

    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN", raising=False)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter="reproduce")
    assert V2_GAP in _config(ckpt, "dspark")._get_v2_model_runner_unsupported_features()
    monkeypatch.setenv(DSPARK_V2_ENV, "1")
    cfg = _config(ckpt, "dspark")
    assert V2_GAP not in cfg._get_v2_model_runner_unsupported_features()
    layers = ArchConfig.from_hf(cfg.model_config.hf_config).dspark_target_layer_ids
    assert tuple(get_eagle3_aux_layers_from_config(cfg.speculative_config)) == layers
    assert supports_eagle3(DeepseekV41ForCausalLM)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    assert V2_GAP in _config(ckpt, "dspark")._get_v2_model_runner_unsupported_features()


def test_dspark_varlen_v2_is_vllms_adaptive_verification(ckpt_root, monkeypatch):
    """With the opt-in, varlen runs on V2 as vLLM's adaptive verification: a config whose
    `enable_adaptive_verification` is set (what `patches/speculative_settings.py` sets from
    DEEPINFER_ENABLE_MTP_VARLEN=1 where V2 runs with full CUDA graphs) no longer lists the V2 gap, with or without
    the variable; batch-invariant mode keeps V1. On this CPU build (no Triton) the variable is not mapped."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_deepinfer.patches.drafters_v1 import DSPARK_V2_ENV, V2_GAP
    from vllm_deepinfer.patches.speculative_settings import varlen_as_adaptive

    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    monkeypatch.setenv(DSPARK_V2_ENV, "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter="reproduce")
    cfg = _config(ckpt, "dspark")
    assert not cfg.speculative_config.enable_adaptive_verification
    assert not varlen_as_adaptive(cfg.speculative_config, cfg.model_config, EngineArgs(model=str(ckpt)))
    cfg.speculative_config.enable_adaptive_verification = True
    assert V2_GAP not in cfg._get_v2_model_runner_unsupported_features()
    assert cfg._get_v1_model_runner_unsupported_features() == []
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    assert V2_GAP not in cfg._get_v2_model_runner_unsupported_features()
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert V2_GAP in cfg._get_v2_model_runner_unsupported_features()


def test_builder_replays_varlen_graphs_of_the_widest_verification(ckpt_root):
    """vLLM's V2 adaptive verification starts only where every target attention group replays varlen decode
    graphs of 1..1 + k tokens per request and accepts host query lengths that understate the device ones: vLLM's
    own checks on a group of our backend and builder (k = 2; the bound is vLLM's widest decode query, 1 + k on
    V2, here on V1 1 + 2k: its parallel drafting appends k mask slots)."""
    import torch
    from vllm.v1.attention.backend import max_decode_query_len
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm.v1.worker.gpu.attn_utils import (
        get_query_lens_mismatch_unsupported_backend,
        get_varlen_cudagraph_unsupported_backend,
    )
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_deepinfer.attention.backend import PagedCacheBackend, PagedCacheMetadataBuilder

    cfg = _config(tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter="reproduce"), "dspark")
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=torch.float32)
    builder = PagedCacheMetadataBuilder(spec, ["model.layers.0.attn.window_cache"], cfg, torch.device("cpu"))
    bound = builder.get_varlen_cudagraph_max_query_len(cfg, spec)
    assert bound == max_decode_query_len(cfg) >= 3
    groups = [[AttentionGroup(PagedCacheBackend, builder.layer_names, spec, 0, metadata_builders=[builder])]]
    assert get_varlen_cudagraph_unsupported_backend(groups, cfg, 3) is None
    assert get_varlen_cudagraph_unsupported_backend(groups, cfg, bound + 1) == ("PagedCacheBackend", bound)
    assert get_query_lens_mismatch_unsupported_backend(groups) is None
