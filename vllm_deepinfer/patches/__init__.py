"""Every patch of vLLM internals lives here, each in its own module with its reason.

`apply_all()` is called by the general plugin in every vLLM process; each patch checks the exact
vLLM version it was written for and fails loudly on any other.
"""

from __future__ import annotations

import importlib

import vllm

SUPPORTED_VLLM = "0.32.0"


def check_vllm_version() -> None:
    if vllm.__version__ != SUPPORTED_VLLM:
        raise RuntimeError(f"vllm-deepinfer patches vLLM {SUPPORTED_VLLM} internals; found vLLM {vllm.__version__}")


def apply_all() -> None:
    from vllm_deepinfer.patches import cpu_platform

    check_vllm_version()
    cpu_platform.apply()
    importlib.import_module("vllm_deepinfer.patches.cpu_dist_version").apply()
    importlib.import_module("vllm_deepinfer.patches.cpu_gatherv").apply()
    importlib.import_module("vllm_deepinfer.patches.so_args_request").apply()
    importlib.import_module("vllm_deepinfer.patches.empty_messages").apply()
    importlib.import_module("vllm_deepinfer.patches.xgrammar_token_cache").apply()
    importlib.import_module("vllm_deepinfer.patches.decode_cudagraphs").apply()
    importlib.import_module("vllm_deepinfer.patches.seeded_sampler").apply()
    importlib.import_module("vllm_deepinfer.patches.speculative_settings").apply()
    importlib.import_module("vllm_deepinfer.patches.drafters_v1").apply()
    importlib.import_module("vllm_deepinfer.patches.replay_window_manager").apply()
    importlib.import_module("vllm_deepinfer.patches.unused_slot_mappings").apply()
    importlib.import_module("vllm_deepinfer.patches.spec_length_metrics").apply()
