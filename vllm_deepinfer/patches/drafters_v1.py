"""DSpark (`--speculative-config '{"method": "dspark", ...}'`) for DeepInfer's V4.1 on vLLM's V1 model runner.

Reason: vLLM 0.32 implements DSpark only in the V2 runner, which needs Triton (not on the CPU build), and
refuses it on V1 with "Model Runner V1 does not support: dspark speculative decoding"
(`VllmConfig._get_v1_model_runner_unsupported_features`, `vllm/config/vllm.py`); `method="mtp"` is refused for
V4.1 targets in `SpeculativeConfig.__post_init__`. The V1 runner picks its proposer in
`GPUModelRunner.__init__` (`use_eagle()` includes dspark: an `EagleProposer`). Two wraps, both active only when
the draft architecture is DeepInfer's drafter (`DSparkV41DraftModel` registered to
`vllm_deepinfer.spec_decode.dspark:DSparkDrafter` and a DeepInfer target):

* the V1 refusal list drops that one entry, and the V2 list gains "DeepInfer's DSpark drafter" (the V2
  `DSparkSpeculator` expects vLLM's own draft model surface), so vLLM picks V1 on GPU too (or refuses V2 by name
  when `VLLM_USE_V2_MODEL_RUNNER=1`);
* after `GPUModelRunner.__init__` (inherited by `CPUModelRunner`) the runner's drafter is our
  `spec_decode.dspark_proposer.DSparkProposer`, an `EagleProposer` subclass, so the runner's isinstance checks and
  its eagle code path (input preparation, draft KV group, `propose`) apply unchanged.
"""

from __future__ import annotations

import functools

V1_REFUSAL = "dspark speculative decoding"
V2_GAP = "DeepInfer's DSpark drafter"
DRAFT_ARCH = "DSparkV41DraftModel"


def deepinfer_dspark(vllm_config) -> bool:
    """Whether `vllm_config` runs DSpark with DeepInfer's target and drafter."""
    from vllm_deepinfer.registry import DRAFT_MODELS, is_deepinfer_model

    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dspark" or spec.draft_model_config is None:
        return False
    archs = spec.draft_model_config.hf_config.architectures or []
    return DRAFT_ARCH in archs and DRAFT_ARCH in DRAFT_MODELS and is_deepinfer_model(vllm_config.model_config)


def apply() -> None:
    from vllm.config.vllm import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    unsupported = VllmConfig._get_v1_model_runner_unsupported_features
    if getattr(unsupported, "_deepinfer", False):
        return
    v2 = VllmConfig._get_v2_model_runner_unsupported_features

    @functools.wraps(v2)
    def v2_unsupported(self) -> list[str]:
        return v2(self) + ([V2_GAP] if deepinfer_dspark(self) else [])

    @functools.wraps(unsupported)
    def v1_unsupported(self) -> list[str]:
        out = unsupported(self)
        return [f for f in out if f != V1_REFUSAL] if deepinfer_dspark(self) else out

    init = GPUModelRunner.__init__

    @functools.wraps(init)
    def runner_init(self, vllm_config, *args, **kwargs):
        init(self, vllm_config, *args, **kwargs)
        if deepinfer_dspark(vllm_config):
            from vllm_deepinfer.spec_decode.dspark_proposer import DSparkProposer

            self.drafter = DSparkProposer(self.vllm_config, self.device, self)

    v1_unsupported._deepinfer = v2_unsupported._deepinfer = runner_init._deepinfer = True
    VllmConfig._get_v1_model_runner_unsupported_features = v1_unsupported
    VllmConfig._get_v2_model_runner_unsupported_features = v2_unsupported
    GPUModelRunner.__init__ = runner_init
