"""DeepInfer's drafters on vLLM's V1 model runner: DSpark always, MTP when it needs the V1 hooks.

Reason (DSpark, `--speculative-config '{"method": "dspark", ...}'` on DeepInfer's V4.1): vLLM 0.32 implements
DSpark only in the V2 runner, which needs Triton (not on the CPU build), and refuses it on V1 with "Model
Runner V1 does not support: dspark speculative decoding" (`VllmConfig._get_v1_model_runner_unsupported_features`,
`vllm/config/vllm.py`); `method="mtp"` is refused for V4.1 targets in `SpeculativeConfig.__post_init__`. The V1
runner picks its proposer in `GPUModelRunner.__init__` (`use_eagle()` includes dspark: an `EagleProposer`).

Reason (MTP on DeepInfer's V4): the draft-length policy (varlen, early stop) and the batch-invariant mode's
coupled drafts hook V1's `SpecDecodeBaseProposer` (`patches/draft_lengths.py`); the V2 runner, vLLM's default
on CUDA, drives the MTP block through its own speculator and would silently verify fixed, uncoupled drafts.
So when varlen (`DEEPINFER_ENABLE_MTP_VARLEN`, `enable_adaptive_verification`) or batch-invariant mode is on,
MTP runs on V1 too; fixed-length MTP keeps vLLM's runner choice.

Three wraps, each active only for DeepInfer's target and drafter:

* the V1 refusal list drops the dspark entry and "adaptive draft verification" (`enable_adaptive_verification`
  maps onto our draft-length policy, `spec_decode.proposer.policy_for`);
* the V2 list gains "DeepInfer's DSpark drafter" or "DeepInfer's MTP drafter with ...", so vLLM picks V1 on GPU
  too (or refuses V2 by name when `VLLM_USE_V2_MODEL_RUNNER=1`). Opt-in `VLLM_DEEPINFER_DSPARK_V2=1` leaves
  DSpark to vLLM's runner choice (V2 on CUDA; V1 on CPU, which has no Triton): vLLM's own `DSparkSpeculator`
  then drives our drafter through the surface it calls (`spec_decode/dspark.py`) and the target's aux hidden
  states (`DeepseekV41ForCausalLM.set_aux_hidden_state_layers`). Varlen there is vLLM's adaptive verification
  (`enable_adaptive_verification`; `patches/speculative_settings.py` maps `DEEPINFER_ENABLE_MTP_VARLEN=1` onto
  it where V2 runs with full CUDA graphs); where it did not map, varlen keeps our V1 policy. Batch-invariant
  drafts exist only on V1. In those two cases the variable is ignored, with a warning. Not yet run on a GPU
  (NOTES.md);
* after `GPUModelRunner.__init__` (inherited by `CPUModelRunner`) the DSpark runner's drafter is our
  `spec_decode.dspark_proposer.DSparkProposer`, an `EagleProposer` subclass, so the runner's isinstance checks and
  its eagle code path (input preparation, draft KV group, `propose`) apply unchanged.

One read of V1 internals: `group_block_table` (the block tables of the drafter's other KV-cache groups).
"""

from __future__ import annotations

import functools
import os

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)

V1_REFUSAL = "dspark speculative decoding"
V1_ADAPTIVE = "adaptive draft verification"  # our draft-length policy implements it on V1
V2_GAP = "DeepInfer's DSpark drafter"
V2_GAP_MTP = "DeepInfer's MTP drafter with varlen or batch-invariant drafts"
DSPARK_ARCH = "DSparkV41DraftModel"
MTP_ARCH = "DeepSeekV4MTPModel"


def _deepinfer_drafter(spec, model_config, method: str, arch: str) -> bool:
    """Whether speculative config `spec` speculates with `method` through DeepInfer's drafter `arch` on the
    DeepInfer target of `model_config`."""
    from vllm_deepinfer.registry import DRAFT_MODELS, is_deepinfer_model

    if spec is None or spec.method != method or spec.draft_model_config is None:
        return False
    archs = spec.draft_model_config.hf_config.architectures or []
    return arch in archs and arch in DRAFT_MODELS and is_deepinfer_model(model_config)


def deepinfer_dspark(vllm_config) -> bool:
    """Whether `vllm_config` runs DSpark with DeepInfer's target and drafter."""
    return _deepinfer_drafter(vllm_config.speculative_config, vllm_config.model_config, "dspark", DSPARK_ARCH)


DSPARK_V2_ENV = "VLLM_DEEPINFER_DSPARK_V2"


def dspark_opt_in(spec, model_config) -> bool:
    """`VLLM_DEEPINFER_DSPARK_V2=1` and speculative config `spec` runs DeepInfer's DSpark on `model_config`."""
    return os.environ.get(DSPARK_V2_ENV, "0") == "1" and _deepinfer_drafter(spec, model_config, "dspark", DSPARK_ARCH)


@functools.cache
def _warn_v2_ignored() -> None:
    logger.warning("%s ignored: batch-invariant drafts, and DEEPINFER_ENABLE_MTP_VARLEN where it did not become "
                   "vLLM's adaptive verification (no full CUDA graphs), run on vLLM's V1 runner", DSPARK_V2_ENV)


def dspark_on_v2(vllm_config) -> bool:
    """Whether DeepInfer's DSpark may run under vLLM's V2 DSpark speculator: `dspark_opt_in`, outside
    batch-invariant mode, and varlen asked for by `DEEPINFER_ENABLE_MTP_VARLEN` only where it became
    `enable_adaptive_verification` (V2's own varlen; `patches/speculative_settings.py`): coupled drafts and our
    varlen policy are V1 hooks."""
    from vllm_deepinfer import ops
    from vllm_deepinfer.spec_decode.proposer import varlen_enabled

    spec = vllm_config.speculative_config
    if not dspark_opt_in(spec, vllm_config.model_config):
        return False
    if ops.invariant_requested(vllm_config) or (varlen_enabled() and not spec.enable_adaptive_verification):
        _warn_v2_ignored()
        return False
    return True


def deepinfer_mtp_on_v1(vllm_config) -> bool:
    """Whether `vllm_config` runs DeepInfer's MTP drafter with a feature only its V1 hooks provide."""
    from vllm_deepinfer import ops
    from vllm_deepinfer.spec_decode.proposer import varlen_requested

    if not _deepinfer_drafter(vllm_config.speculative_config, vllm_config.model_config, "mtp", MTP_ARCH):
        return False
    return varlen_requested(vllm_config.speculative_config) or ops.invariant_requested(vllm_config)


def group_block_table(runner, gid: int, num_reqs: int):
    """Block table [num_reqs, blocks] (device) of KV-cache group `gid` for the V1 runner's current batch.

    Reason: V1's `EagleProposer` prepares the metadata of one draft KV-cache group; vLLM splits groups to equal
    layer counts, so the three DSpark stages' window caches may sit in several groups, whose block tables only
    the runner's input batch holds (`GPUModelRunner.input_batch.block_table`, a V1 internal)."""
    return runner.input_batch.block_table[gid].get_device_tensor(num_reqs)


def apply() -> None:
    from vllm.config.vllm import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    unsupported = VllmConfig._get_v1_model_runner_unsupported_features
    if getattr(unsupported, "_deepinfer", False):
        return
    v2 = VllmConfig._get_v2_model_runner_unsupported_features

    @functools.wraps(v2)
    def v2_unsupported(self) -> list[str]:
        if deepinfer_dspark(self):
            gaps = [] if dspark_on_v2(self) else [V2_GAP]
        else:
            gaps = [V2_GAP_MTP] if deepinfer_mtp_on_v1(self) else []
        return v2(self) + gaps

    @functools.wraps(unsupported)
    def v1_unsupported(self) -> list[str]:
        out = unsupported(self)
        ours = {V1_REFUSAL, V1_ADAPTIVE} if deepinfer_dspark(self) else {V1_ADAPTIVE} if deepinfer_mtp_on_v1(self) \
            else set()
        return [f for f in out if f not in ours]

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
