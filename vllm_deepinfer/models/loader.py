"""Loading of real-format DeepSeek-V4(.1)-Flash checkpoints into the torch model.

The checkpoint is validated as a whole against the expected inventory before any parameter is
written (missing tensor, wrong dtype or shape, NaN codes: the error names the tensor), so a bad
checkpoint never leaves a half-initialised model. FP8 block and MXFP4 tensors are dequantised
here, except into FP8-packed linears (`Linear.pack_fp8`), which take the codes and scale bytes as
stored, and packed routed experts, which keep the MXFP4 bytes. Routed experts load through vLLM's
fused-MoE weight loader (each rank keeps its experts under EP and its slice under TP); under tensor
parallelism each rank writes its shard of every other split tensor too (the parameters' vLLM weight
loaders narrow the whole tensor, FP8 scale blocks included).
MTP/DSpark (`mtp.*`) tensors belong to the drafter (`load_draft`, the same writer) and the vision
tower to the VL wrapper, so the text model skips them with one log line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from vllm.distributed.eplb.eplb_state import EplbState

from vllm_deepinfer.checkpoint.formats import (
    check_no_nan_codes,
    dequant_fp8_block,
    dequant_mxfp4,
)
from vllm_deepinfer.checkpoint.inventory import TORCH_TO_DTYPE, InventoryError, validate_inventory
from vllm_deepinfer.config import ArchConfig
from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)

DRAFT_PREFIX = "mtp."
VISION_PREFIXES = ("vision.", "aligner.", "image_")
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_HC = re.compile(r"^(.*?)hc_(attn|ffn|head)_(fn|base|scale)$")


def hc_param_name(name: str) -> str:
    """`<prefix>hc_{attn,ffn,head}_{fn,base,scale}` -> the HyperConnection / HyperHead parameter path."""
    if m := _HC.match(name):
        return f"{m.group(1)}hc_{m.group(2)}.{m.group(3)}"
    return name


def target_name(name: str) -> str:
    """Module path of a (non-expert) checkpoint tensor in DeepseekForCausalLM."""
    if name == "head.weight":
        return "lm_head.weight"
    return "model." + hc_param_name(name)


def _decode(name: str, tensors: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """Full-precision value of checkpoint tensor `name` (dequantised when stored with a scale)."""
    t = tensors[name]
    scale = tensors.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
    if t.dtype == torch.float8_e4m3fn and scale is not None:
        return dequant_fp8_block(t, scale, block)
    if t.dtype == torch.int8 and scale is not None:
        return dequant_mxfp4(t, scale)
    return t


def load_checkpoint(model: nn.Module, arch: ArchConfig, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Validate and load checkpoint `weights`; returns the names of the parameters written."""
    tensors: dict[str, torch.Tensor] = {}
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    skipped = {"draft": 0, "vision": 0}
    for name, t in weights:
        found[name] = (TORCH_TO_DTYPE.get(t.dtype, str(t.dtype)), tuple(t.shape))
        if name.startswith(DRAFT_PREFIX):
            skipped["draft"] += 1
        elif name.startswith(VISION_PREFIXES):
            skipped["vision"] += 1
        else:
            tensors[name] = t
    _validate(arch, found, tensors)
    if skipped["vision"]:
        logger.info("DeepInfer: text-only model, skipped %d vision-tower tensors", skipped["vision"])
    if skipped["draft"]:
        logger.info("DeepInfer: %d draft (mtp.*) tensors are left to the speculative drafter", skipped["draft"])
    return write_tensors(model, tensors, arch.weight_block_size, target_name)



def load_draft(model: nn.Module, arch: ArchConfig, weights: Iterable[tuple[str, torch.Tensor]],
               param_name: Callable[[str], str]) -> set[str]:
    """Validate the whole checkpoint and load its `mtp.0.*` tensors into the V4 MTP drafter `model`
    (`param_name`: checkpoint name -> parameter name, e.g. `spec_decode.mtp.draft_param_name`)."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in weights:
        found[name] = (TORCH_TO_DTYPE.get(t.dtype, str(t.dtype)), tuple(t.shape))
        if name.startswith(f"{DRAFT_PREFIX}0."):
            tensors[name] = t
    _validate(arch, found, tensors)
    return write_tensors(model, tensors, arch.weight_block_size, param_name)


def write_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], block: int,
                  rename: Callable[[str], str]) -> set[str]:
    """Write checkpoint `tensors` (validated) into `model`, whose parameter of checkpoint tensor `n` is
    `rename(n)` (routed experts: `rename(<prefix>.ffn.experts.routed_experts)` is the fused-MoE layer);
    every parameter of `model` must be written. Returns the parameter names written."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    loaded: set[str] = set()
    for name in tensors:
        if ".engram.embed." in name:  # the table stays FP8 (decoded per looked-up row)
            dst = rename(name)
            if model.get_submodule(dst.rpartition(".")[0]).loads_checkpoint:  # node-shared: its writer only
                buffers[dst].copy_(tensors[name])
            continue
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in tensors:
            continue  # consumed with its weight
        if m := _EXPERT.match(name):
            owner = rename(f"{m.group(1)}.routed_experts")
            loaded.update(_load_expert(model, owner, int(m.group(2)), m.group(3), name, tensors, block))
            continue
        dst = rename(name)
        if dst in params and params[dst].dtype == torch.float8_e4m3fn:  # packed FP8 linear: codes + E8M0 bytes
            scale_name, scale_dst = name[: -len("weight")] + "scale", dst[: -len("weight")] + "scale"
            _load(params[dst], tensors[name], name, dst)
            _load(params[scale_dst], tensors[scale_name].view(torch.uint8), scale_name, scale_dst)
            loaded.update((dst, scale_dst))
            continue
        value = _decode(name, tensors, block)
        if dst in buffers:
            buffers[dst].copy_(value)
            continue
        if dst not in params:
            raise InventoryError(f"checkpoint tensor '{name}' has no parameter '{dst}' in the model")
        _load(params[dst], value.to(params[dst].dtype), name, dst)
        loaded.add(dst)
    missing = set(params) - loaded
    if missing:
        raise InventoryError(f"parameters not initialised by the checkpoint: {sorted(missing)[:10]}")
    return loaded


def physical_slots(num_logical: int, num_physical: int, expert: int) -> list[int]:
    """Global physical slots that hold logical expert `expert` at load: itself and, with EPLB redundant
    experts (num_physical > num_logical), its replicas in vLLM's initial map
    (`EplbState.build_initial_global_physical_to_logical_map`, which EPLB's first mapping assumes)."""
    initial = EplbState.build_initial_global_physical_to_logical_map(num_logical, num_physical - num_logical)
    return [slot for slot, e in enumerate(initial) if e == expert]


def _load_expert(model: nn.Module, owner: str, expert: int, which: str, name: str,
                 tensors: dict[str, torch.Tensor], block: int) -> list[str]:
    """Checkpoint tensor `name` (w1/w2/w3 of logical expert `expert` of the fused-MoE layer `owner`) into
    each of its physical slots local to this rank (EP keeps local slots, redundant replicas included)
    through the fused-MoE layer's weight loader, which also takes this rank's TP slice. Packed params
    (uint8: vLLM's MXFP4 method or the plugin's packed torch method) take the codes and E8M0 bytes as
    stored, others the dequantised value. Returns the parameter names written (none off this rank)."""
    experts = model.get_submodule(owner)
    slots = [s for s in physical_slots(experts.moe_config.num_logical_experts, experts.global_num_experts, expert)
             if experts._map_global_expert_id_to_local_expert_id(s) != -1]
    if not slots:
        return []
    stem = "w2" if which == "w2" else "w13"
    param = getattr(experts, f"{stem}_weight")
    if param.dtype != torch.uint8:
        value = _decode(name, tensors, block).to(param.dtype)
        for slot in slots:
            param.weight_loader(param, value, f"{stem}_weight", which, slot)
        return [f"{owner}.{stem}_weight"]
    scale = getattr(experts, f"{stem}_weight_scale")
    codes, scale_bytes = tensors[name].view(torch.uint8), tensors[name[: -len("weight")] + "scale"].view(torch.uint8)
    for slot in slots:
        param.weight_loader(param, codes, f"{stem}_weight", which, slot)
        scale.weight_loader(scale, scale_bytes, f"{stem}_weight_scale", which, slot)
    return [f"{owner}.{stem}_weight", f"{owner}.{stem}_weight_scale"]


def _load(param: nn.Parameter, value: torch.Tensor, name: str, dst: str) -> None:
    """Write a whole checkpoint tensor into `param`: through its vLLM `weight_loader` when it has one
    (tensor-parallel layers copy this rank's shard), else as is."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, value)
        return
    if tuple(param.shape) != tuple(value.shape):
        raise InventoryError(f"checkpoint tensor '{name}' has shape {list(value.shape)}, "
                             f"parameter '{dst}' expects {list(param.shape)}")
    param.data.copy_(value)


def _validate(arch: ArchConfig, found: dict[str, tuple[str, tuple[int, ...]]],
              tensors: dict[str, torch.Tensor]) -> None:
    """Inventory, dtype and shape checks over the whole checkpoint, NaN codes over the text model."""
    has_vision = any(n.startswith(VISION_PREFIXES) for n in found)
    validate_inventory(found, arch, include_vision=has_vision or None)
    for name, t in tensors.items():
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
            check_no_nan_codes(t, name)


__all__ = ["InventoryError", "load_checkpoint", "load_draft", "target_name", "write_tensors"]
