"""Mixture of experts of DeepSeek-V4 / V4.1 (model-spec §3.8) on vLLM's fused-MoE layer.

Router (`DeepseekRouter`, ours, plugged into the layer as its router): sqrt(softplus(logits)) in fp32;
selection on score + `gate.bias` (V4.1 image-span tokens [image_token_id, +5) use `gate.bias_vl`), or
the fixed `tid2eid` row of the token id on V4 hash layers; weights are the unbiased scores renormalised
to `routed_scaling_factor`; top-k ties break to the lower expert id. vLLM's own DeepSeek-V4 routers
differ (CPU: the AVX-512 `biased_topk_cpu` kernel, no `bias_vl`; CUDA: `dsv4_topk`; see
tests/test_moe_router.py), so ours is passed as `router=`; vLLM's base router adds the EPLB
logical-to-physical mapping and load recording, for hash layers too.

Routed experts: `FusedMoEFactory` (vLLM's layer, as in-tree): expert placement under EP, dispatch/combine,
EPLB and the expert method (`moe/method.py`: vLLM's MXFP4 kernels on CUDA, the plugin's torch experts on
CPU) are vLLM's. Shared expert: the plugin's clamped SwiGLU, added after the routed sum (replicated).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed.device_communicators.pynccl_wrapper import ncclDataTypeEnum
from vllm.distributed.eplb.eplb_state import EplbLayerState
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
from vllm.model_executor.models.interfaces import MixtureOfExperts

from vllm_deepinfer import ops
from vllm_deepinfer.models.layers import Linear, _param
from vllm_deepinfer.ops import quant

IMAGE_TOKEN_SPAN = 5  # ids [image_token_id, +5) route with bias_vl (vLLM's range, spec §7 Q17)


def image_ids(image_token_id: int) -> tuple[int, int] | None:
    """The id range [lo, hi) of V4.1's image tokens (bias_vl routing, no Engram n-grams or value), or None
    without one (image_token_id < 0)."""
    return (image_token_id, image_token_id + IMAGE_TOKEN_SPAN) if image_token_id >= 0 else None


class Gate(nn.Module):
    def __init__(self, hidden: int, n_experts: int, vocab: int, topk: int, hash_routed: bool, with_bias_vl: bool):
        super().__init__()
        self.weight = _param(n_experts, hidden)
        self.bias = self.bias_vl = None
        self.register_buffer("tid2eid", torch.zeros(vocab, topk, dtype=torch.long) if hash_routed else None,
                             persistent=False)
        if not hash_routed:
            self.bias = _param(n_experts, dtype=torch.float32)
            if with_bias_vl:
                self.bias_vl = _param(n_experts, dtype=torch.float32)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(hidden, inter), Linear(inter, hidden), Linear(hidden, inter)
        self.w1.fuse_outputs(self.w3)  # gate and up read the same input: one GEMM where Marlin serves both


class DeepseekRouter(BaseRouter):
    """The router of the module docstring as a vLLM `FusedMoERouter` (reads `gate`'s tensors at call time)."""

    def __init__(self, gate: Gate, topk: int, route_scale: float, image_token_id: int,
                 eplb_state: EplbLayerState | None):
        super().__init__(top_k=topk, global_num_experts=gate.weight.shape[0], eplb_state=eplb_state)
        self.gate, self.route_scale, self.image = gate, route_scale, image_ids(image_token_id)

    @property
    def routing_method_type(self) -> RoutingMethodType:
        return RoutingMethodType.DeepseekV4

    def route(self, logits: torch.Tensor, token_ids: torch.Tensor,
              ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] fp32; token_ids: [T] -> (logical expert ids [T, K] `ids_dtype`, weights [T, K] fp32)."""
        gate, forced, vl = self.gate, None, None
        if gate.tid2eid is not None:
            forced = gate.tid2eid[token_ids.long()]
        elif gate.bias_vl is not None:  # image tokens take bias_vl (chosen per token by the router kernel)
            vl = (gate.bias_vl, token_ids, *self.image)
        return ops.sqrtsoftplus_route(logits, gate.bias, self.top_k, self.route_scale, forced, vl, ids_dtype)

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if input_ids is None:
            raise ValueError("DeepSeek V4 routing needs the token ids (hash routing, bias_vl)")
        ids, weights = self.route(router_logits, input_ids, indices_type or torch.int32)
        return weights, ids


class MoE(nn.Module):
    """gate + routed experts (vLLM's fused-MoE layer, `experts`) + shared expert."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, hidden: int, inter: int, n_experts: int, topk: int,
                 n_shared: int, vocab: int, hash_routed: bool, route_scale: float, swiglu_limit: float,
                 image_token_id: int = -1):
        super().__init__()
        self.limit = swiglu_limit
        self.gate = Gate(hidden, n_experts, vocab, topk, hash_routed, with_bias_vl=image_token_id >= 0)
        parallel = vllm_config.parallel_config
        self.router = DeepseekRouter(self.gate, topk, route_scale, image_token_id,
                                     EplbLayerState() if parallel.enable_eplb else None)
        self.experts = FusedMoEFactory(
            num_experts=n_experts, top_k=topk, hidden_size=hidden, intermediate_size=inter,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.experts", router=self.router,
            ckpt_names=("w1", "w2", "w3"), scoring_func="sqrtsoftplus", routed_scaling_factor=route_scale,
            swiglu_limit=swiglu_limit, hash_indices_table=self.gate.tid2eid,
            router_logits_dtype=torch.float32, enable_eplb=parallel.enable_eplb,
            num_redundant_experts=parallel.eplb_config.num_redundant_experts if parallel.enable_eplb else 0)
        if self.experts.is_monolithic:
            raise ValueError(f"{prefix}: vLLM selected a monolithic MoE kernel "
                             f"({type(self.experts.routed_experts.quant_method).__name__}), which routes inside "
                             "the kernel and would bypass the DeepSeek router; choose a modular backend "
                             "(--moe-backend marlin) or DEEPINFER_EXPERT_STORAGE=bf16")
        self.shared_experts = SharedExpert(hidden, inter * n_shared) if n_shared else None

    def placement(self) -> str:
        """Where the routed experts live, e.g. "4/8 routed experts on this rank" (expert parallel) or "8 routed
        experts"."""
        routed = self.experts.routed_experts
        local, total = routed.local_num_experts, routed.global_num_experts
        return f"{local}/{total} routed experts on this rank" if local != total else f"{total} routed experts"

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D] (normalised FFN input); token_ids: [T] -> [T, D]."""
        logits = ops.linear_fp32_out(x, self.gate.weight)
        y = self.experts(hidden_states=x, router_logits=logits, input_ids=token_ids)
        if self.shared_experts is not None:
            s = self.shared_experts
            act = None
            if s.w1.act_block is not None:  # parity: W8A8, both GEMM inputs quantised per 1x128
                act = functools.partial(quant.act_roundtrip, block=s.w1.act_block)
            y = y + ops.swiglu_clamped(x, s.w1.matmul_group, None, s.w2.matmul, self.limit, act=act)
        return y


def eplb_transfer_view(weight: torch.Tensor) -> torch.Tensor:
    """An expert tensor as EPLB moves it: itself when NCCL carries its dtype, else the same bytes as uint8.

    weight: [local experts, n] (vLLM's `get_expert_weights` view) -> [local experts, n * itemsize] for
    e.g. the MXFP4 methods' `float8_e8m0fnu` scales, which NCCL (and vLLM's pynccl dtype table) rejects.
    The view shares the parameter's storage, so EPLB's in-place migration writes the real weights."""
    if ncclDataTypeEnum.supports_torch_dtype(weight.dtype):
        return weight
    return weight.view(torch.uint8)


class DeepseekMixtureOfExperts(MixtureOfExperts):
    """vLLM's `MixtureOfExperts` protocol (EPLB: load statistics, redundant experts, rebalancing with weight
    migration) over the fused-MoE layers of `moes`."""

    def collect_moe_layers(self, moes: list[MoE]) -> None:
        self.moe_layers = [m.experts for m in moes]
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = 1
        self.expert_weights = []
        first = self.moe_layers[0].routed_experts
        self.num_logical_experts = self.num_routed_experts = moes[0].gate.weight.shape[0]
        self.num_physical_experts = first.global_num_experts
        self.num_local_physical_experts = first.local_num_experts
        self.num_redundant_experts = self.num_physical_experts - self.num_logical_experts
        self.num_shared_experts = 1 if moes[0].shared_experts is not None else 0

    def set_eplb_state(self, expert_load_view: torch.Tensor, logical_to_physical_map: torch.Tensor,
                       logical_replica_count: torch.Tensor) -> None:
        """The protocol's registration, then every expert tensor handed to EPLB as an NCCL-movable view."""
        super().set_eplb_state(expert_load_view, logical_to_physical_map, logical_replica_count)
        self.expert_weights = [[eplb_transfer_view(w) for w in layer] for layer in self.expert_weights]

    def update_physical_experts_metadata(self, num_physical_experts: int, num_local_physical_experts: int) -> None:
        if num_local_physical_experts != self.num_local_physical_experts:
            raise ValueError(f"EPLB: {num_local_physical_experts} local experts per rank, the model has "
                             f"{self.num_local_physical_experts}")
        self.num_physical_experts = num_physical_experts
        self.num_redundant_experts = num_physical_experts - self.num_logical_experts
        for layer in self.moe_layers:
            layer.update_expert_map()
