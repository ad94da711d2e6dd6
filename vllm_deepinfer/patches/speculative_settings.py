"""DeepInfer's speculation settings as vLLM's speculative config (`DEEPINFER_USE_NEXTN_DECODE`,
`DEEPINFER_ENABLE_MTP_VARLEN`; `serving/settings.py::speculative_config_from_env`: DSpark on V4.1 checkpoints,
MTP on V4).

Reason: vLLM reads `--speculative-config` / `LLM(speculative_config=...)` into `EngineArgs` before any
plugin runs (general plugins load inside `EngineArgs.__post_init__`, after the command line is parsed), so
a plugin cannot add the option to the command line. `EngineArgs.create_engine_config` is where the
arguments become the engine's config, for `vllm serve` and offline `LLM()` alike: the wrapper fills
`speculative_config` from the settings when the user gave none (a given one wins, with a warning when the
settings ask for something).
"""

from __future__ import annotations

import functools

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_deepinfer.serving.settings import speculative_config_from_env

    original = EngineArgs.create_engine_config
    if getattr(original, "_deepinfer", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        spec = speculative_config_from_env(model=self.model)
        if spec is not None and self.speculative_config is None:
            self.speculative_config = spec
            logger.info("vllm-deepinfer: speculative decoding from the DeepInfer settings: %s", spec)
        elif spec is not None:
            logger.warning("vllm-deepinfer: a speculative config was given (%s); DEEPINFER_USE_NEXTN_DECODE / "
                           "DEEPINFER_ENABLE_MTP_VARLEN do not change it", self.speculative_config)
        return original(self, *args, **kwargs)

    create_engine_config._deepinfer = True
    EngineArgs.create_engine_config = create_engine_config
