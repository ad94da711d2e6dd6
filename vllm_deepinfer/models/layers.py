"""Parameter holders of the torch path: linears (on vLLM's replicated / column / row parallel layers), RMSNorm.

Checkpoint weights are dequantised once at load time (FP8 block / MXFP4 -> model dtype), except the
FP8 block linears when packed storage is selected (`DEEPINFER_FP8_LINEARS`, `auto` = packed on CUDA;
`pack_fp8_linears`): those keep the checkpoint's E4M3 codes and E8M0 scale bytes. On CUDA with bf16/fp16
activations they are repacked after loading for vLLM's Marlin W8A16 GEMM (`ops.marlin.MarlinFP8`, the
kernel of vLLM's in-tree V4.1 on SM90), except the thin matrices where our Triton GEMM is faster
(`ops.marlin.faster_than_triton`); those and every other platform multiply through `ops.linear_fp8_block`.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs

from vllm_deepinfer import ops
from vllm_deepinfer.models.quant_config import LINEAR_CONFIG
from vllm_deepinfer.ops import marlin, quant

#: Linears whose activations vLLM's in-tree V4 path quantises to FP8 (DeepGEMM W8A8, 1x128 UE8M0),
#: by module-name suffix. The grouped `wo_a` does not go through `Linear.forward` (its call site applies
#: `quant.act_roundtrip` itself); `wo_b` and the shared expert's `w1/w3/w2` are called as Linears by their
#: call sites when `act_block` is set (the fused reference ops take raw weights and would skip the quantiser).
V4_FP8_ACT_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "indexer.wq_b",
                      "shared_experts.w1", "shared_experts.w2", "shared_experts.w3", "e_proj", "h_proj")


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def head_sharded(param: nn.Parameter) -> nn.Parameter:
    """Mark a per-head parameter [H_local, ...] (e.g. `attn_sink`) as split over the TP ranks by heads."""
    set_weight_attrs(param, {"weight_loader": sharded_weight_loader(0)})
    return param


class _DeepInferLinear:
    """y = x W^T (no bias in this model) on one of vLLM's linear layers; W: [N_local, K_local] is this
    rank's shard (vLLM's `weight_loader` narrows the checkpoint tensor), the product runs in
    `forward_local` through `ops`, and vLLM's `forward` adds the collective (RowParallel: all-reduce).

    Storage: `weight` in the model dtype, or after `pack_fp8(B)` the E4M3 codes `weight` [N, K] and the
    E8M0 scale bytes `scale` (uint8) [ceil(N/B), ceil(K/B)] of model-spec §4.2, sharded the same way
    (shard boundaries must fall on scale blocks)."""

    weight: nn.Parameter
    #: G of the block-diagonal product (the grouped `wo_a`: its attention sets o_groups / tp).
    groups: int = 1

    def _init_storage(self) -> None:
        self.scale: nn.Parameter | None = None
        self.block: tuple[int, int] | None = None
        self._packed_dtype: torch.dtype | None = None
        self.marlin: marlin.MarlinFP8 | None = None
        # Parity numerics: FP8 activation quantisation block (None = off, the default).
        self.act_block: int | None = None
        # `fuse_outputs`: the linears multiplied with this one (a tuple: not registered as submodules),
        # whether this one is multiplied by another's GEMM, and the output split of the stacked GEMM.
        self.fused_with: tuple[_DeepInferLinear, ...] = ()
        self.fused_away = False
        self.fused_sizes: list[int] | None = None

    def pack_fp8(self, block: int) -> None:
        """Switch to FP8 block storage (filled by the loader). The scales start at byte 127 (1.0): vLLM's
        dummy weights leave non-float parameters untouched, and byte 0xFF would be NaN."""
        n, k = self.weight.shape
        if (n != self.output_size and n % block) or (k != self.input_size and k % block):  # split dim off the blocks
            raise ValueError(f"{self.prefix or type(self).__name__}: the FP8 shard [{n}, {k}] of tensor parallel "
                             f"size {self.tp_size} does not fall on {block}x{block} scale blocks; "
                             f"use DEEPINFER_FP8_LINEARS=bf16 or another tensor_parallel_size")
        attrs = {a: getattr(self.weight, a) for a in ("input_dim", "output_dim", "weight_loader")
                 if hasattr(self.weight, a)}
        dev, self._packed_dtype = self.weight.device, self.weight.dtype
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False)
        self.scale = nn.Parameter(torch.full((-(-n // block), -(-k // block)), 127, dtype=torch.uint8, device=dev),
                                  requires_grad=False)
        set_weight_attrs(self.weight, attrs)
        set_weight_attrs(self.scale, attrs)
        self.block = (block, block)

    def fuse_outputs(self, *others: "_DeepInferLinear") -> None:
        """Declare that `others` read this linear's input: after loading, where all of them are packed
        FP8 alike, they multiply as one GEMM of the stacked matrix [N + sum N_o, K] (`forward_group`).
        Thin matrices leave most of the GPU idle (wkv 512 x 5120 on Marlin: 19.7 us against 12.7 us for
        wq_a|wkv stacked on the H200, benchmarks/results/gpu-1202/bench_linears.log), as vLLM's in-tree
        `fused_wqa_wkv` and `gate_up_proj` avoid."""
        self.fused_with = others
        for o in others:
            o.fused_away = True

    def _marlin_serves(self) -> bool:
        """Whether this packed linear (or the stack it leads) moves to Marlin's layout (`finish_loading`)."""
        if self.scale is None or self.groups != 1 or ops.batch_invariant():
            return False
        k, dev = self.weight.shape[1], self.weight.device
        return (marlin.supported(dev, self._packed_dtype, k, self.block)
                and marlin.faster_than_triton(self.weight.shape[0], k, dev))

    def _to_marlin(self) -> None:
        self.marlin = marlin.MarlinFP8.from_packed(self.weight.data, self.scale.data, self.block, self._packed_dtype)
        self.weight = self.scale = None

    def finish_loading(self) -> None:
        """After the loader filled a packed weight: stack a `fuse_outputs` group whose members are packed
        alike with every split on a scale block (at its first linear's call: every weight is loaded by
        then), and move each matrix to Marlin's layout where Marlin serves it and beats our Triton GEMM
        (`_marlin_serves`: CUDA, bf16/fp16 activations, K on 32-element groups, not thin), freeing the
        E4M3 codes and block bytes. The grouped `wo_a` stays on `ops.linear_fp8_block` (one launch for all
        groups: 24.8 vs 104 us for the 8 Marlin calls at V4.1 widths, T = 1, on the H200), and so does every
        linear in batch-invariant mode (Marlin picks its kernel configuration by M)."""
        if self.fused_away or self.scale is None:
            return
        members = (self,) + self.fused_with
        k, (bn, _) = self.weight.shape[1], self.block
        if self.fused_with and self.groups == 1 \
                and all(m.scale is not None and m.groups == 1 and m.weight.shape[1] == k and m.block == self.block
                        and m.act_block == self.act_block for m in self.fused_with) \
                and all(m.weight.shape[0] % bn == 0 for m in members[:-1]):
            self.fused_sizes = [m.weight.shape[0] for m in members]
            w = torch.cat([m.weight.data for m in members])
            s = torch.cat([m.scale.data for m in members])
            for m in self.fused_with:
                m.weight = m.scale = None
            self.weight = nn.Parameter(w, requires_grad=False)
            self.scale = nn.Parameter(s, requires_grad=False)
        for m in members:
            if m._marlin_serves():
                m._to_marlin()

    @property
    def act_dtype(self) -> torch.dtype:
        """Dtype of the inputs and outputs (the model dtype)."""
        return self.weight.dtype if self._packed_dtype is None else self._packed_dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G*K] -> x W^T [T, N] on this rank's shard, without activation quantisation or collective;
        G = `groups` > 1: the block-diagonal product of `ops.linear` (x group g times rows g*N/G.. of W)."""
        if self.fused_sizes is not None or (self.weight is None and self.marlin is None):
            raise RuntimeError(f"{self.prefix}: multiplied as part of a stacked GEMM (fuse_outputs): call the "
                               "group's forward_group")
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T with whatever this linear holds (the stacked matrix for a stacked group's first linear)."""
        if self.marlin is not None:
            return self.marlin(x)
        if self.scale is not None:
            return ops.linear_fp8_block(x, self.weight, self.scale, self.block, self.groups)
        return ops.linear(x, self.weight, self.groups)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """x in the model dtype, through the parity activation quantiser when it is on."""
        x = x.to(self.act_dtype)
        return x if self.act_block is None else quant.act_roundtrip(x, self.act_block)

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product (`DeepInferLinearMethod.apply`), with parity activation quantisation."""
        return self.matmul(self._input(x))

    def matmul_group(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`matmul` of this linear and of its `fuse_outputs` linears: x [T, K] -> ([T, N], [T, N_o]...),
        column slices of one GEMM's output when the group was stacked at load."""
        if self.fused_sizes is not None:
            return self._product(x).split(self.fused_sizes, dim=-1)
        return (self.matmul(x),) + tuple(o.matmul(x) for o in self.fused_with)

    def forward_group(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`forward_local` of this linear and of its `fuse_outputs` linears (replicated linears only)."""
        if self.fused_sizes is not None:
            return self.matmul_group(self._input(x))
        return (self.forward_local(x),) + tuple(o.forward_local(x) for o in self.fused_with)


class Linear(_DeepInferLinear, ReplicatedLinear):
    """Replicated on every TP rank: Linear(in_features, out_features, dtype)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None, prefix: str = ""):
        super().__init__(in_features, out_features, bias=False, params_dtype=dtype, quant_config=LINEAR_CONFIG,
                         prefix=prefix, return_bias=False, disable_tp=True)
        self._init_storage()


class ColumnLinear(_DeepInferLinear, ColumnParallelLinear):
    """Output features split over the TP ranks (each rank holds rows rank*N/tp.. of W); no gather."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None, prefix: str = ""):
        super().__init__(in_features, out_features, bias=False, params_dtype=dtype, quant_config=LINEAR_CONFIG,
                         prefix=prefix, return_bias=False)
        self._init_storage()


class RowLinear(_DeepInferLinear, RowParallelLinear):
    """Input features split over the TP ranks (the input is already this rank's slice); outputs all-reduced."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None, prefix: str = ""):
        super().__init__(in_features, out_features, bias=False, params_dtype=dtype, quant_config=LINEAR_CONFIG,
                         prefix=prefix, return_bias=False)
        self._init_storage()


def pack_fp8_linears(model: nn.Module, fp8_weights: set[str], block: int) -> list[str]:
    """Packed FP8 storage for every Linear of `model` whose `<name>.weight` is in `fp8_weights` (the
    checkpoint's block-FP8 tensors, named relative to `model`). Returns the names packed."""
    done = []
    for name, module in model.named_modules():
        if isinstance(module, _DeepInferLinear) and f"{name}.weight" in fp8_weights:
            module.pack_fp8(block)
            done.append(name)
    return done


def enable_activation_quant(model: nn.Module, names: tuple[str, ...] = V4_FP8_ACT_LINEARS,
                            block: int = 128) -> list[str]:
    """Parity numerics (V4 only): quantise the inputs of the FP8 block linears like DeepGEMM W8A8.
    Returns the qualified names of the linears switched on."""
    done = []
    for name, module in model.named_modules():
        if isinstance(module, _DeepInferLinear) and name.endswith(names):
            module.act_block = block
            done.append(name)
    return done


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class HyperConnection(nn.Module):
    """mHC parameters of one sublayer (`hc_{attn,ffn}_{fn,base,scale}`, all fp32)."""

    def __init__(self, hc_mult: int, hidden: int, mix_width: int, rms_eps: float, hc_eps: float, iters: int):
        super().__init__()
        self.fn = _param(mix_width, hc_mult * hidden, dtype=torch.float32)
        self.base = _param(mix_width, dtype=torch.float32)
        self.scale = _param(3, dtype=torch.float32)
        self.rms_eps, self.hc_eps, self.iters = rms_eps, hc_eps, iters
        self.tf32 = quant.enabled("tf32")  # parity: vLLM's mHC pre-norm GEMM runs in TF32

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, h, D] -> pre [T, h], post [T, h], comb [T, h, h]."""
        fn = quant.tf32_truncate(self.fn) if self.tf32 else self.fn
        return ops.hc_coefficients(streams, fn, self.base, self.scale, self.rms_eps, self.hc_eps, self.iters)
