"""DeepInfer's speculation settings as vLLM's speculative config (`DEEPINFER_USE_NEXTN_DECODE`,
`DEEPINFER_ENABLE_MTP_VARLEN`; `serving/settings.py::speculative_config_from_env`: DSpark on V4.1 checkpoints,
MTP on V4), and `DEEPINFER_ENABLE_MTP_VARLEN=1` as vLLM's `enable_adaptive_verification` where DSpark runs under
vLLM's V2 runner (`VLLM_DEEPINFER_DSPARK_V2=1`, `patches/drafters_v1.py`).

Reason: vLLM reads `--speculative-config` / `LLM(speculative_config=...)` into `EngineArgs` before any
plugin runs (general plugins load inside `EngineArgs.__post_init__`, after the command line is parsed), so
a plugin cannot add the option to the command line. `EngineArgs.create_engine_config` is where the
arguments become the engine's config, for `vllm serve` and offline `LLM()` alike: the wrapper fills
`speculative_config` from the settings when the user gave none (a given one wins, with a warning when the
settings ask for something).

Reason (varlen on V2): there our draft-length policy (a V1 hook) does not exist; vLLM's own adaptive
verification is the same policy (tokens per step cost over draft slots ranked by confidence survival) and is
read from `SpeculativeConfig.enable_adaptive_verification` by `VllmConfig.__post_init__` (which validates it:
full CUDA graphs, no LoRA / PP), the V2 runner and its DSpark speculator. `EngineArgs.create_speculative_config`
builds that config before the `VllmConfig`: the wrapper sets the flag there for DeepInfer's DSpark with the opt-in,
outside batch-invariant mode, where V2 can run (Triton) with full CUDA graphs (not `enforce_eager`, no cudagraph
mode without full graphs) and the user's config does not set it. Elsewhere varlen stays our V1 policy (the flag
would then mean the same policy, `spec_decode.proposer.varlen_requested`, but vLLM refuses it without full
graphs).
"""

from __future__ import annotations

import functools

from vllm_deepinfer.log import get_logger
from vllm_deepinfer.patches.drafters_v1 import DSPARK_V2_ENV, dspark_opt_in

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
            logger.warning("vllm-deepinfer: a speculative config was given (%s); DEEPINFER_USE_NEXTN_DECODE does "
                           "not change it (DEEPINFER_ENABLE_MTP_VARLEN still turns varlen on)", self.speculative_config)
        return original(self, *args, **kwargs)

    create_engine_config._deepinfer = True
    EngineArgs.create_engine_config = create_engine_config

    create_spec = EngineArgs.create_speculative_config

    @functools.wraps(create_spec)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = create_spec(self, target_model_config, target_parallel_config)
        if spec is not None and "enable_adaptive_verification" not in self.speculative_config \
                and varlen_as_adaptive(spec, target_model_config, self):
            spec.enable_adaptive_verification = True
            logger.info("vllm-deepinfer: DEEPINFER_ENABLE_MTP_VARLEN=1 with %s=1: vLLM's adaptive verification",
                        DSPARK_V2_ENV)
        return spec

    create_speculative_config._deepinfer = True
    EngineArgs.create_speculative_config = create_speculative_config


def varlen_as_adaptive(spec, model_config, engine_args) -> bool:
    """Whether DEEPINFER_ENABLE_MTP_VARLEN=1 becomes vLLM's `enable_adaptive_verification` for speculative config
    `spec` on `model_config` (module docstring): the V2 DSpark opt-in, no batch-invariant mode, Triton, full CUDA
    graphs possible under `engine_args`."""
    from vllm.triton_utils import HAS_TRITON

    from vllm_deepinfer import ops
    from vllm_deepinfer.spec_decode.proposer import varlen_enabled

    mode = engine_args.compilation_config.cudagraph_mode
    full_graphs = not engine_args.enforce_eager and (mode is None or mode.has_full_cudagraphs())
    return (varlen_enabled() and dspark_opt_in(spec, model_config) and not ops.invariant_requested(engine_args)
            and HAS_TRITON and full_graphs)
