"""Exact checkpoint tensor inventory of DeepSeek-V4-Flash (model-spec §5.2) and V4.1-Flash (§5.3).

Public API::

    expected_tensors(arch, include_vision=None) -> dict[name, (dtype_str, shape_tuple)]
    validate_inventory(found, arch, include_vision=None) -> None   # raises InventoryError naming the tensor
    InventoryError

dtype strings are the safetensors header names: ``BF16``, ``F32``, ``F8_E4M3``, ``F8_E8M0``, ``I8``, ``I64``
(see ``DTYPE_TO_TORCH``). Names are DeepSeek-native (``layers.{l}.attn.wq_a.weight``, ``mtp.{i}.…``).
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..config import V4, V41, ArchConfig

__all__ = ["expected_tensors", "validate_inventory", "InventoryError", "DTYPE_TO_TORCH", "TORCH_TO_DTYPE"]

BF16, F32, FP8, E8M0, I8, I64 = "BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64"

DTYPE_TO_TORCH = {
    BF16: torch.bfloat16, F32: torch.float32, FP8: torch.float8_e4m3fn,
    E8M0: torch.float8_e8m0fnu, I8: torch.int8, I64: torch.int64,
}
TORCH_TO_DTYPE = {v: k for k, v in DTYPE_TO_TORCH.items()}

Spec = tuple[str, tuple[int, ...]]


class InventoryError(ValueError):
    """A checkpoint whose tensor set, dtypes or shapes differ from the inventory; names the tensor."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self, arch: ArchConfig):
        self.arch = arch
        self.b = arch.weight_block_size
        self.out: dict[str, Spec] = {}

    def add(self, name: str, dtype: str, *shape: int) -> None:
        assert name not in self.out, name
        self.out[name] = (dtype, tuple(int(s) for s in shape))

    def fp8(self, name: str, n: int, k: int) -> None:
        """Block-FP8 linear: `.weight` E4M3 [N, K] + `.scale` E8M0 [ceil(N/B), ceil(K/B)]."""
        self.add(f"{name}.weight", FP8, n, k)
        self.add(f"{name}.scale", E8M0, _cdiv(n, self.b), _cdiv(k, self.b))

    def expert(self, name: str, n: int, k: int) -> None:
        """Routed expert matrix: MXFP4 (I8 [N, K/2] + E8M0 [N, K/32]) or, for expert_dtype fp8
        (Flash-Base), block-FP8 with float32 scales."""
        if self.arch.expert_dtype == "fp4":
            self.add(f"{name}.weight", I8, n, k // 2)
            self.add(f"{name}.scale", E8M0, n, k // 32)
        else:
            self.add(f"{name}.weight", FP8, n, k)
            self.add(f"{name}.scale", F32, _cdiv(n, self.b), _cdiv(k, self.b))


def _block(bld: _Builder, p: str, layer_id: int) -> None:
    """Tensors shared by every backbone layer / MTP block / DSpark stage, plus role-dependent extras."""
    a = bld.arch
    plan = a.layer_plan(layer_id)
    D, h, M = a.hidden_size, a.hc_mult, a.hc_mix_width
    H, d, Q = a.num_heads, a.head_dim, a.q_lora_rank
    G, Ro = a.o_groups, a.o_lora_rank
    I, S = a.moe_intermediate_size, max(a.n_shared_experts, 1)
    is_v41_draft = a.family == V41 and plan.is_draft
    E = a.dspark_n_routed_experts if (is_v41_draft and a.dspark_n_routed_experts) else a.n_routed_experts
    K = a.dspark_num_experts_per_tok if (is_v41_draft and a.dspark_num_experts_per_tok) else a.num_experts_per_tok

    bld.add(f"{p}attn_norm.weight", BF16, D)
    bld.add(f"{p}ffn_norm.weight", BF16, D)
    for sub in ("attn", "ffn"):
        bld.add(f"{p}hc_{sub}_fn", F32, M, h * D)
        bld.add(f"{p}hc_{sub}_base", F32, M)
        bld.add(f"{p}hc_{sub}_scale", F32, 3)
    bld.fp8(f"{p}attn.wq_a", Q, D)
    bld.add(f"{p}attn.q_norm.weight", BF16, Q)
    bld.fp8(f"{p}attn.wq_b", H * d, Q)
    bld.fp8(f"{p}attn.wkv", d, D)
    bld.add(f"{p}attn.kv_norm.weight", BF16, d)
    bld.fp8(f"{p}attn.wo_a", G * Ro, H * d // G)
    bld.fp8(f"{p}attn.wo_b", D, G * Ro)
    bld.add(f"{p}attn.attn_sink", F32, H)

    # ---- attention extras
    HI, dI = a.index_n_heads, a.index_head_dim
    if a.family == V4 and plan.ratio > 0:
        m = plan.ratio
        c = 2 if plan.compressor_overlap else 1
        bld.add(f"{p}attn.compressor.ape", F32, m, c * d)
        bld.add(f"{p}attn.compressor.wkv.weight", BF16, c * d, D)
        bld.add(f"{p}attn.compressor.wgate.weight", BF16, c * d, D)
        bld.add(f"{p}attn.compressor.norm.weight", BF16, d)
        if plan.owns_indexer:
            bld.fp8(f"{p}attn.indexer.wq_b", HI * dI, Q)
            bld.add(f"{p}attn.indexer.weights_proj.weight", BF16, HI, D)
            bld.add(f"{p}attn.indexer.compressor.ape", F32, m, 2 * dI)
            bld.add(f"{p}attn.indexer.compressor.wkv.weight", BF16, 2 * dI, D)
            bld.add(f"{p}attn.indexer.compressor.wgate.weight", BF16, 2 * dI, D)
            bld.add(f"{p}attn.indexer.compressor.norm.weight", BF16, dI)
    elif a.family == V41 and plan.ratio > 0:
        if plan.owns_compressor:
            bld.add(f"{p}attn.compressor.wkv.weight", BF16, d, D)
            if plan.compressor_gated:
                bld.add(f"{p}attn.compressor.wgate.weight", BF16, d, D)
            bld.add(f"{p}attn.compressor.norm.weight", BF16, d)
        if plan.owns_indexer:
            bld.fp8(f"{p}attn.indexer.wq_b", HI * dI, Q)
            bld.add(f"{p}attn.indexer.weights_proj.weight", BF16, HI, D)
            if plan.owns_index_keys:
                bld.add(f"{p}attn.indexer.wk.weight", BF16, dI, d)
                bld.add(f"{p}attn.indexer.k_norm.weight", BF16, dI)

    # ---- Engram (V4.1)
    if plan.engram_table is not None:
        j = plan.engram_table
        n_rows, dE = a.engram_num_embeddings[j], a.engram_head_dim
        bld.add(f"{p}engram.embed.weight", FP8, n_rows, dE)
        bld.add(f"{p}engram.embed.scale", E8M0, n_rows, dE // 32)
        bld.fp8(f"{p}engram.wkv", (h + 1) * D, (a.engram_max_ngram_size - 1) * a.engram_n_heads * dE)
        bld.add(f"{p}engram.q_weight", BF16, h, D)
        bld.add(f"{p}engram.k_weight", BF16, h, D)

    # ---- MoE
    bld.add(f"{p}ffn.gate.weight", BF16, E, D)
    if plan.hash_routed:
        bld.add(f"{p}ffn.gate.tid2eid", I64, a.vocab_size, K)
    else:
        bld.add(f"{p}ffn.gate.bias", F32, E)
    if a.family == V41:
        bld.add(f"{p}ffn.gate.bias_vl", F32, E)
    for e in range(E):
        bld.expert(f"{p}ffn.experts.{e}.w1", I, D)
        bld.expert(f"{p}ffn.experts.{e}.w2", D, I)
        bld.expert(f"{p}ffn.experts.{e}.w3", I, D)
    bld.fp8(f"{p}ffn.shared_experts.w1", I * S, D)
    bld.fp8(f"{p}ffn.shared_experts.w2", D, I * S)
    bld.fp8(f"{p}ffn.shared_experts.w3", I * S, D)


def _vision(bld: _Builder) -> None:
    a = bld.arch
    v, iv = getattr(a, "vision_dim", 1024), getattr(a, "vision_inter_dim", 2816)
    ps, r, D = getattr(a, "vision_patch_size", 14), getattr(a, "vision_downsample_ratio", 3), a.hidden_size
    bld.add("vision.patch_embed.proj.weight", BF16, v, 3 * ps * ps)
    bld.add("vision.patch_embed.proj.bias", BF16, v)
    for b in range(getattr(a, "vision_n_layers", 0)):
        p = f"vision.blocks.{b}."
        bld.add(p + "norm1.weight", BF16, v)
        bld.add(p + "norm2.weight", BF16, v)
        bld.add(p + "attn.wqkv.weight", BF16, 3 * v, v)
        bld.add(p + "attn.wqkv.bias", BF16, 3 * v)
        bld.add(p + "attn.wo.weight", BF16, v, v)
        bld.add(p + "attn.wo.bias", BF16, v)
        bld.add(p + "mlp.w1.weight", BF16, 2 * iv, v)
        bld.add(p + "mlp.w2.weight", BF16, v, iv)
    bld.add("vision.norm.weight", BF16, v)
    bld.add("aligner.w1.weight", BF16, D, v * r * r)
    bld.add("aligner.w1.bias", BF16, D)
    bld.add("aligner.w2.weight", BF16, D, D)
    bld.add("aligner.w2.bias", BF16, D)
    bld.add("image_start", BF16, D)
    bld.add("image_end", BF16, D)
    bld.add("image_newline", BF16, D)


def expected_tensors(arch: ArchConfig, include_vision: bool | None = None) -> dict[str, Spec]:
    """Every tensor of a checkpoint for `arch`: ``{name: (safetensors dtype, shape)}`` in file order.

    V4: globals (6) + backbone layers + the MTP block(s) ``mtp.{i}``. V4.1: globals (3) + backbone +
    DSpark stages ``mtp.{i}`` + (if ``include_vision``) the vision tower, aligner and image vectors.
    ``include_vision=None`` means "if the config has a vision tower" (``arch.vision_n_layers > 0``);
    ``True`` requires one. V4 never has vision tensors in scope.
    """
    bld = _Builder(arch)
    D, V, h = arch.hidden_size, arch.vocab_size, arch.hc_mult
    bld.add("embed.weight", BF16, V, D)
    bld.add("head.weight", BF16, V, D)
    bld.add("norm.weight", BF16, D)
    if arch.family == V4:
        bld.add("hc_head_fn", F32, h, h * D)
        bld.add("hc_head_base", F32, h)
        bld.add("hc_head_scale", F32, 1)
    for l in range(arch.num_layers):
        _block(bld, f"layers.{l}.", l)
    n_draft = arch.num_draft_layers
    for i in range(n_draft):
        p = f"mtp.{i}."
        _block(bld, p, arch.num_layers + i)
        if arch.family == V4:
            bld.fp8(p + "e_proj", D, D)
            bld.fp8(p + "h_proj", D, D)
            bld.add(p + "enorm.weight", BF16, D)
            bld.add(p + "hnorm.weight", BF16, D)
            bld.add(p + "norm.weight", BF16, D)
            bld.add(p + "hc_head_fn", F32, h, h * D)
            bld.add(p + "hc_head_base", F32, h)
            bld.add(p + "hc_head_scale", F32, 1)
            bld.add(p + "emb.tok_emb.weight", BF16, V, D)
            bld.add(p + "head.weight", BF16, V, D)
        else:
            if i == 0:
                bld.fp8(p + "main_proj", D, len(arch.dspark_target_layer_ids) * D)
                bld.add(p + "main_norm.weight", BF16, D)
            if i == n_draft - 1:
                rM = arch.dspark_markov_rank
                bld.add(p + "norm.weight", BF16, D)
                bld.add(p + "markov_head.embed.weight", BF16, V, rM)
                bld.add(p + "markov_head.head.weight", BF16, V, rM)
                bld.add(p + "confidence_head.proj.weight", BF16, 1, D + rM)
    if include_vision is None:
        include_vision = arch.family == V41 and getattr(arch, "vision_n_layers", 0) > 0
    if include_vision:
        if arch.family != V41:
            raise InventoryError("vision tensors are only defined for DeepSeek-V4.1 checkpoints")
        if getattr(arch, "vision_n_layers", 0) <= 0:
            raise InventoryError("include_vision=True but the config has no vision tower (vision_config.num_hidden_layers = 0)")
        _vision(bld)
    return bld.out


def validate_inventory(found: Mapping[str, tuple[str, tuple[int, ...]]], arch: ArchConfig,
                       include_vision: bool | None = None, allow_extra_prefixes: tuple[str, ...] = ()) -> None:
    """Compare ``{name: (dtype_str, shape)}`` read from a checkpoint with `expected_tensors`.

    Raises InventoryError listing (up to 10 of) the missing, unexpected, wrong-dtype and wrong-shape tensors,
    each with its name. Names starting with one of ``allow_extra_prefixes`` are not reported as unexpected.
    """
    exp = expected_tensors(arch, include_vision)
    problems: list[str] = []
    for name, (dt, shape) in exp.items():
        if name not in found:
            problems.append(f"missing tensor '{name}' ({dt} {list(shape)})")
            continue
        fdt, fshape = found[name]
        if fdt != dt:
            problems.append(f"tensor '{name}' has dtype {fdt}, expected {dt}")
        if tuple(fshape) != shape:
            problems.append(f"tensor '{name}' has shape {list(fshape)}, expected {list(shape)}")
    for name in found:
        if name not in exp and not name.startswith(allow_extra_prefixes):
            problems.append(f"unexpected tensor '{name}'")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise InventoryError("checkpoint does not match the expected inventory: " + "; ".join(problems[:10]) + more)
