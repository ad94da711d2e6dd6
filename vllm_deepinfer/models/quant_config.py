"""`deepinfer_fp8`: the quantization config of DeepSeek-V4(.1)-Flash checkpoints under the plugin.

The checkpoints declare `quant_method: fp8` (FP8 e4m3 with UE8M0 block scales, MXFP4 experts).
vLLM routes them to `deepseek_v4_fp8`, whose layers the DeepInfer model does not use, and which
rejects float32 and refuses V4.1 off CUDA/ROCm. This config claims both checkpoint families while
the plugin is active; the DeepInfer model reads the quantised tensors itself (see models/loader.py),
except through `DeepInferLinearMethod`, the weight holder of the model's linears (models/layers.py),
which are vLLM's parallel linears (`ReplicatedLinear`, `ColumnParallelLinear`, `RowParallelLinear`):
vLLM's layers shard the parameters (`weight_loader`) and reduce the outputs; this method creates the
weights in the model dtype (or, after `pack_fp8`, E4M3 codes + E8M0 bytes) and multiplies through
`ops` (the torch path's numerics: no CPU weight repacking, optional parity activation quantisation).
The routed experts (vLLM's fused-MoE layer) get their method from `moe.method.expert_method` (MXFP4 kept
packed on CUDA, `DEEPINFER_EXPERT_STORAGE`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from vllm_deepinfer.moe.method import expert_method
from vllm_deepinfer.registry import MODEL_TYPES

NAME = "deepinfer_fp8"


@register_quantization_config(NAME)
class DeepInferFP8Config(QuantizationConfig):
    def __init__(self, weight_block_size: list[int], expert_dtype: str):
        super().__init__()
        self.weight_block_size = weight_block_size
        self.expert_dtype = expert_dtype

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DeepInferFP8Config":
        return cls(config.get("weight_block_size", [128, 128]), config.get("expert_dtype", "fp4"))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        model_type = getattr(hf_config, "model_type", None)
        if model_type == "deepseek_mtp" and hasattr(hf_config, "compress_ratios"):
            model_type = "deepseek_v4"  # vLLM's draft-config rename of a V4/V4.1 target (speculative decoding)
        if model_type in MODEL_TYPES and hf_quant_cfg.get("quant_method") == "fp8" and user_quant in (None, "fp8", NAME):
            return NAME
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            return expert_method(layer.moe_config, self.expert_dtype)
        return DeepInferLinearMethod() if isinstance(layer, LinearBase) else None


class DeepInferLinearMethod(LinearMethodBase):
    """Weights of a DeepInfer linear: `weight` [N_local, K_local] in the model dtype, sharded by the
    layer's own vLLM weight loader (`output_dim` 0, `input_dim` 1). `apply` is the layer's `forward_local`
    (models/layers.py), so packed FP8 storage and parity activation quantisation stay with the layer."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        weight = torch.nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                                dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.finish_loading()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.forward_local(x)


#: The config the model's linears are built with (only its `get_quant_method` is used).
LINEAR_CONFIG = DeepInferFP8Config([128, 128], "fp4")
