"""Which fused-MoE method computes the routed experts (`DEEPINFER_EXPERT_STORAGE`), and the plugin's own.

The routed experts are vLLM's fused-MoE layer (`FusedMoEFactory`, see `moe/layer.py`); the quant config
`deepinfer_fp8` asks `expert_method` for the layer's method:

| storage | CUDA | elsewhere (CPU) |
|---|---|---|
| `packed` (`auto` on CUDA) | vLLM's `Mxfp4MoEMethod` (MXFP4 codes + E8M0 scales as stored; the DeepSeek-V4 backend oracle picks the kernel: Marlin W4A16 on SM90) | `TorchMoEMethod(packed=True)`: the stored bytes, dequantised per call by `ops.routed_experts_packed` (tests) |
| `bf16` (`auto` off CUDA) | vLLM's `UnquantizedFusedMoEMethod` (weights dequantised at load to the model dtype) | `TorchMoEMethod`: dequantised at load, `ops.routed_experts` |

Why our own method off CUDA: vLLM's CPU unquantized experts (`cpu_fused_moe`) apply plain SiLU-and-mul,
without the SwiGLU clamp (`swiglu_limit`) this model needs, and its CPU MXFP4 experts need AMX. Our method
keeps the plugin's exact torch grouped GEMM (clamped SwiGLU, fp32 sum in ascending expert id) inside
vLLM's modular kernel, so expert placement (`expert_map`), the DP/EP prepare/finalize (all2all or
allgather/reduce-scatter) and EPLB weight migration are vLLM's.
"""

from __future__ import annotations

import functools
import os

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform

from vllm_deepinfer import ops
from vllm_deepinfer.checkpoint.formats import MX_BLOCK

E8M0_ONE = 127  # scale byte of 1.0: packed params start finite (vLLM's dummy load leaves integer params alone)


def expert_storage(expert_dtype: str, value: str | None = None) -> str:
    """'packed' or 'bf16' for `DEEPINFER_EXPERT_STORAGE` (`value`, default: the environment) and the
    checkpoint's expert dtype: `auto` is packed on CUDA, bf16 elsewhere; only MXFP4 ("fp4") experts pack."""
    storage = ops.parse_storage(ops.EXPERT_STORAGE_ENV, os.environ.get(ops.EXPERT_STORAGE_ENV) if value is None
                                else value)
    if storage == "auto":
        storage = "packed" if current_platform.is_cuda() else "bf16"
    return storage if expert_dtype == "fp4" else "bf16"


def expert_method(moe: FusedMoEConfig, expert_dtype: str) -> FusedMoEMethodBase:
    """The fused-MoE method of a routed-experts layer (table in the module docstring)."""
    packed = expert_storage(expert_dtype) == "packed"
    if not current_platform.is_cuda() or ops.batch_invariant():
        # batch-invariant mode: vLLM's fused-MoE kernels pick tiles / split-K by the token count; the
        # plugin's experts have fixed tiles (`kernels_nvidia.moe` for packed MXFP4, `matmul_invariant` for bf16)
        return TorchMoEMethod(moe, packed)
    if packed:
        from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
        return Mxfp4MoEMethod(moe)
    return UnquantizedFusedMoEMethod(moe)


class TorchExperts(mk.FusedMoEExpertsModular):
    """vLLM modular experts running `ops.routed_experts` (or `ops.routed_experts_packed` with `scales`).

    Receives the tokens this rank computes (after vLLM's dispatch), their top-k ids (global physical ids)
    and weights; `expert_map` [global] gives each id's local slot or -1 (another rank's expert: weight 0).
    Writes the weighted sum over the local experts, [M, D] (vLLM's combine adds up the ranks)."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(moe_config, quant_config)
        self.scales = scales
        self.limit = moe_config.swiglu_limit

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return activation_key is None

    @staticmethod
    def _supports_activation(activation) -> bool:
        return True

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduceNoOP:
        return TopKWeightAndReduceNoOP()

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        ids, weights = topk_ids.long(), topk_weights.float()
        if expert_map is not None:
            ids = expert_map[ids].long()
            weights = torch.where(ids >= 0, weights, 0.0)
            ids = ids.clamp(min=0)
        if self.scales is None:
            y = ops.routed_experts(hidden_states, ids, weights, w1, w2, self.limit)
        else:
            y = ops.routed_experts_packed(hidden_states, ids, weights, w1, self.scales[0], w2, self.scales[1],
                                          self.limit)
        output.copy_(y)


class TorchMoEMethod(FusedMoEMethodBase):
    """Fused-MoE method of the plugin's torch experts. Params (local experts E, I per TP rank):
    `w13_weight` [E, 2I, D] (w1 rows then w3 rows), `w2_weight` [E, D, I] in the model dtype, or with
    `packed` the MXFP4 codes uint8 [E, 2I, D/2] / [E, D, I/2] plus E8M0 bytes `w13_weight_scale`
    [E, 2I, D/32] / `w2_weight_scale` [E, D, I/32] (Mxfp4MoEMethod's layout)."""

    def __init__(self, moe: FusedMoEConfig, packed: bool):
        super().__init__(moe)
        self.packed = packed

    @property
    def supports_eplb(self) -> bool:
        return True

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        inter = intermediate_size_per_partition
        if not self.packed:
            shapes = {"w13_weight": (2 * inter, hidden_size), "w2_weight": (hidden_size, inter)}
            make = functools.partial(torch.empty, dtype=params_dtype)
        else:
            shapes = {"w13_weight": (2 * inter, hidden_size // 2), "w2_weight": (hidden_size, inter // 2),
                      "w13_weight_scale": (2 * inter, hidden_size // MX_BLOCK),
                      "w2_weight_scale": (hidden_size, inter // MX_BLOCK)}
        for name, shape in shapes.items():
            if self.packed:
                make = functools.partial(torch.full, fill_value=E8M0_ONE if name.endswith("scale") else 0,
                                         dtype=torch.uint8)
            param = torch.nn.Parameter(make((num_experts, *shape)), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
            if name.endswith("scale"):
                param.quant_method = "block"  # RoutedExperts.weight_loader shards it like its weight

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig:
        return FusedMoEQuantConfig.make(gemm1_clamp_limit=layer.swiglu_limit)

    def process_weights_after_loading(self, layer) -> None:
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        prepare_finalize = maybe_make_prepare_finalize(self.moe, self.moe_quant_config,
                                                       routing_tables=layer._expert_routing_tables(),
                                                       allow_new_interface=True)
        scales = (layer.w13_weight_scale, layer.w2_weight_scale) if self.packed else None
        self.moe_kernel = mk.FusedMoEKernel(prepare_finalize, TorchExperts(self.moe, self.moe_quant_config, scales))

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return self.moe_kernel.apply(hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                                     topk_weights=topk_weights, topk_ids=topk_ids, activation=layer.activation,
                                     apply_router_weight_on_input=layer.apply_router_weight_on_input,
                                     global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
                                     shared_experts=shared_experts, shared_experts_input=shared_experts_input)
