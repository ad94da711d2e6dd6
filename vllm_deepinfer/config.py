"""Architecture description of DeepSeek-V4-Flash and V4.1-Flash, read from a checkpoint config.

`ArchConfig.from_hf` accepts the raw `config.json` dict (V4.1 nests `text_config`) or a
transformers/vLLM config object (vLLM flattens `text_config` onto the top level). Everything the
model, the checkpoint generator and the loader need about the layer plan (model-spec §2) is derived
here once, and the config is validated (model-spec §1.6) with errors that name the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

V4 = "v4"
V41 = "v41"

_V4_RATIOS = (0, 4, 128)
_V41_RATIOS = (0, 1, 2)


class ConfigError(ValueError):
    """A checkpoint config that the model cannot run; the message names the field."""


def _lookup(cfg: Any, key: str, default: Any = KeyError) -> Any:
    """Read `key` from a dict or config object, looking inside `text_config` too."""
    sources = [cfg]
    text = cfg.get("text_config") if isinstance(cfg, dict) else getattr(cfg, "text_config", None)
    if text is not None and text is not cfg:
        sources.insert(0, text)
    for src in sources:
        if isinstance(src, dict):
            if key in src and src[key] is not None:
                return src[key]
        elif getattr(src, key, None) is not None:
            return getattr(src, key)
    if default is KeyError:
        raise ConfigError(f"config field '{key}' is required but missing")
    return default


_VISION_KEYS = (  # (ArchConfig field, key inside vision_config, flattened attribute, default)
    ("vision_n_layers", "num_hidden_layers", "vision_n_layers", 0),
    ("vision_dim", "hidden_size", "vision_dim", 1024),
    ("vision_n_heads", "num_attention_heads", "vision_n_heads", 16),
    ("vision_inter_dim", "intermediate_size", "vision_inter_dim", 2816),
    ("vision_patch_size", "patch_size", "vision_patch_size", 14),
    ("vision_downsample_ratio", "downsample_ratio", "vision_downsample_ratio", 3),
)


def _vision_fields(cfg: Any) -> dict:
    """Vision-tower sizes from a nested `vision_config` (raw HF dict) or flattened `vision_*` keys (vLLM)."""
    vis = cfg.get("vision_config") if isinstance(cfg, dict) else getattr(cfg, "vision_config", None)
    if vis is not None and not isinstance(vis, dict):
        vis = vis.to_dict() if hasattr(vis, "to_dict") else dict(vars(vis))
    out = {}
    for field, nested_key, flat_key, default in _VISION_KEYS:
        value = None
        if vis:
            value = vis.get(nested_key)
        if value is None:
            value = cfg.get(flat_key) if isinstance(cfg, dict) else getattr(cfg, flat_key, None)
        out[field] = int(value) if value is not None else default
    return out


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Role of one layer (backbone or draft) in the hybrid attention plan.

    `ratio` is the compress ratio m; `kv_source` the layer whose compressed KV this layer attends
    to (itself for owners, None for SWA-only); `index_source` the layer whose top-k indices this
    layer reuses (itself when it scores); `index_key_layer` the layer that owns the index-K cache it
    scores (V4.1 sharing); `compressor_gated` is False only for V4.1 ratio-1 compressors.
    """

    layer_id: int
    ratio: int
    is_draft: bool = False
    kv_source: int | None = None
    index_source: int | None = None
    index_key_layer: int | None = None
    owns_compressor: bool = False
    compressor_gated: bool = True
    compressor_overlap: bool = False
    owns_indexer: bool = False
    owns_index_keys: bool = False
    candidate_source: bool = False
    candidate_consumer: bool = False
    engram_table: int | None = None
    hash_routed: bool = False

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def uses_all_rows(self) -> bool:
        """V4 HCA: attends to every compressed row, no indexer."""
        return self.ratio > 0 and self.index_source is None


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_draft_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window: int
    compress_ratios: tuple[int, ...]
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    rope_original_max_pos: int
    rope_beta_fast: float
    rope_beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    weight_block_size: int
    expert_dtype: str
    # V4.1 only
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 0
    engram_compressed_vocab_size: int = 0
    image_token_id: int = -1
    dspark_block_size: int = 0
    dspark_noise_token_id: int = -1
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    # vision tower (V4.1 `vision_config`, or vLLM's flattened `vision_*` attributes); 0 layers = text-only
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_downsample_ratio: int = 3

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, cfg: Any) -> "ArchConfig":
        model_type = _lookup(cfg, "model_type")
        if model_type in ("deepseek_v41", "deepseek_v41_text"):
            family = V41
        elif model_type == "deepseek_v4":
            family = V4
        else:
            raise ConfigError(f"config field 'model_type' is {model_type!r}; expected deepseek_v4 or deepseek_v41")
        rope = _lookup(cfg, "rope_scaling", None) or _lookup(cfg, "rope_parameters", None) or {}
        if not isinstance(rope, dict):
            rope = dict(rope)
        quant = _lookup(cfg, "quantization_config", None) or {}
        if not isinstance(quant, dict):
            quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
        block = quant.get("weight_block_size", [128, 128] if family == V4 else [32, 32])
        if block[0] != block[1]:
            raise ConfigError(f"config field 'quantization_config.weight_block_size' must be square, got {block}")
        expert_dtype = quant.get("expert_dtype") or _lookup(cfg, "expert_dtype", "fp4")
        n_layers = int(_lookup(cfg, "num_hidden_layers"))
        n_draft = int(_lookup(cfg, "num_nextn_predict_layers", 0))
        common = dict(
            family=family,
            vocab_size=int(_lookup(cfg, "vocab_size")),
            hidden_size=int(_lookup(cfg, "hidden_size")),
            num_layers=n_layers,
            num_draft_layers=n_draft,
            num_heads=int(_lookup(cfg, "num_attention_heads")),
            head_dim=int(_lookup(cfg, "head_dim")),
            rope_dim=int(_lookup(cfg, "qk_rope_head_dim")),
            q_lora_rank=int(_lookup(cfg, "q_lora_rank")),
            o_lora_rank=int(_lookup(cfg, "o_lora_rank")),
            o_groups=int(_lookup(cfg, "o_groups")),
            window=int(_lookup(cfg, "sliding_window")),
            compress_ratios=tuple(int(x) for x in _lookup(cfg, "compress_ratios")),
            rope_theta=float(_lookup(cfg, "rope_theta", 10000.0)),
            compress_rope_theta=float(_lookup(cfg, "compress_rope_theta")),
            rope_factor=float(rope.get("factor", 1.0)),
            rope_original_max_pos=int(rope.get("original_max_position_embeddings", 65536)),
            rope_beta_fast=float(rope.get("beta_fast", 32)),
            rope_beta_slow=float(rope.get("beta_slow", 1)),
            index_n_heads=int(_lookup(cfg, "index_n_heads")),
            index_head_dim=int(_lookup(cfg, "index_head_dim")),
            index_topk=int(_lookup(cfg, "index_topk")),
            hc_mult=int(_lookup(cfg, "hc_mult")),
            hc_sinkhorn_iters=int(_lookup(cfg, "hc_sinkhorn_iters")),
            hc_eps=float(_lookup(cfg, "hc_eps")),
            n_routed_experts=int(_lookup(cfg, "n_routed_experts")),
            n_shared_experts=int(_lookup(cfg, "n_shared_experts", 0) or 0),
            num_experts_per_tok=int(_lookup(cfg, "num_experts_per_tok")),
            moe_intermediate_size=int(_lookup(cfg, "moe_intermediate_size")),
            num_hash_layers=int(_lookup(cfg, "num_hash_layers", 0)) if family == V4 else 0,
            routed_scaling_factor=float(_lookup(cfg, "routed_scaling_factor", 1.0)),
            swiglu_limit=float(_lookup(cfg, "swiglu_limit")),
            rms_norm_eps=float(_lookup(cfg, "rms_norm_eps")),
            weight_block_size=int(block[0]),
            expert_dtype=str(expert_dtype),
        )
        for key, expected in (("scoring_func", "sqrtsoftplus"), ("hidden_act", "silu")):
            value = _lookup(cfg, key, expected)
            if value != expected:
                raise ConfigError(f"config field '{key}' is {value!r}; only {expected!r} is supported")
        if family == V41:
            engram_ids = tuple(int(x) for x in (_lookup(cfg, "engram_layer_ids", ()) or ()))
            common.update(
                kv_source_layer_ids=tuple(int(x) for x in _lookup(cfg, "kv_source_layer_ids", ())),
                index_source_layer_ids=tuple(int(x) for x in _lookup(cfg, "index_source_layer_ids", ())),
                candidate_source_layer_id=int(_lookup(cfg, "candidate_source_layer_id", -1)),
                candidate_topk_blocks=int(_lookup(cfg, "candidate_topk_blocks", 0)),
                candidate_block_size=int(_lookup(cfg, "candidate_block_size", 0)),
                engram_layer_ids=engram_ids,
                image_token_id=int(_lookup(cfg, "image_token_id", -1)),
                dspark_block_size=int(_lookup(cfg, "dspark_block_size", 0)),
                dspark_noise_token_id=int(_lookup(cfg, "dspark_noise_token_id", -1)),
                dspark_target_layer_ids=tuple(int(x) for x in _lookup(cfg, "dspark_target_layer_ids", ())),
                dspark_markov_rank=int(_lookup(cfg, "dspark_markov_rank", 0)),
                dspark_n_routed_experts=int(_lookup(cfg, "dspark_n_routed_experts", 0)),
                dspark_num_experts_per_tok=int(_lookup(cfg, "dspark_num_experts_per_tok", 0)),
            )
            if engram_ids:
                common.update(
                    engram_num_embeddings=tuple(int(x) for x in _lookup(cfg, "engram_num_embeddings")),
                    engram_max_ngram_size=int(_lookup(cfg, "engram_max_ngram_size")),
                    engram_vocab_size=int(_lookup(cfg, "engram_vocab_size")),
                    engram_n_heads=int(_lookup(cfg, "engram_n_heads")),
                    engram_head_dim=int(_lookup(cfg, "engram_head_dim")),
                    engram_pad_token_id=int(_lookup(cfg, "engram_pad_token_id")),
                    engram_compressed_vocab_size=int(_lookup(cfg, "engram_compressed_vocab_size")),
                )
        common.update(_vision_fields(cfg))
        arch = cls(**common)
        arch.validate()
        return arch

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Model-spec §1.6 checks; raise ConfigError naming the offending field."""
        n_total = self.num_layers + self.num_draft_layers
        if len(self.compress_ratios) < n_total:
            raise ConfigError(
                f"config field 'compress_ratios' has {len(self.compress_ratios)} entries; "
                f"need num_hidden_layers + num_nextn_predict_layers = {n_total}")
        allowed = _V4_RATIOS if self.family == V4 else _V41_RATIOS
        for i, m in enumerate(self.compress_ratios[:n_total]):
            if m not in allowed:
                raise ConfigError(f"config field 'compress_ratios[{i}]' = {m} is not a supported compress ratio "
                                  f"for {self.family} (allowed: {allowed})")
            if i >= self.num_layers and m != 0:
                raise ConfigError(f"config field 'compress_ratios[{i}]' = {m}: draft layers must be 0")
        if self.head_dim != 512 or self.rope_dim != 64:
            raise ConfigError(f"config fields 'head_dim'/'qk_rope_head_dim' must be 512/64, got {self.head_dim}/{self.rope_dim}")
        if self.index_head_dim != 128:
            raise ConfigError(f"config field 'index_head_dim' must be 128, got {self.index_head_dim}")
        if self.num_heads % self.o_groups:
            raise ConfigError(f"config field 'o_groups' ({self.o_groups}) must divide num_attention_heads ({self.num_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("config field 'num_experts_per_tok' exceeds 'n_routed_experts'")
        if self.expert_dtype not in ("fp4", "fp8"):
            raise ConfigError(f"config field 'expert_dtype' is {self.expert_dtype!r}; expected fp4 or fp8")
        if self.hidden_size % self.weight_block_size or self.q_lora_rank % self.weight_block_size:
            raise ConfigError("config fields 'hidden_size'/'q_lora_rank' must be multiples of weight_block_size "
                              f"({self.weight_block_size})")
        if self.family == V41:
            self._validate_v41()

    def check_tensor_parallel(self, tp: int) -> None:
        """Can tensor parallel size `tp` split this model (query heads and wo_a groups per rank)?"""
        if self.num_heads % tp or self.o_groups % tp:
            raise ConfigError(f"tensor_parallel_size {tp} must divide num_attention_heads ({self.num_heads}) and "
                              f"o_groups ({self.o_groups}): each rank owns whole query heads and wo_a groups")

    def _validate_v41(self) -> None:
        kv, idx = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
            if list(ids) != sorted(set(ids)):
                raise ConfigError(f"config field '{name}' must be strictly increasing, got {list(ids)}")
        for s in kv:
            if s not in idx:
                raise ConfigError(f"config field 'kv_source_layer_ids': layer {s} is not an index source")
        for l in range(self.num_layers):
            m = self.compress_ratios[l]
            if m == 0:
                continue
            srcs = [s for s in kv if s <= l]
            if not srcs:
                raise ConfigError(f"config field 'kv_source_layer_ids': compressed layer {l} has no KV source at or before it")
            if self.compress_ratios[srcs[-1]] != m:
                raise ConfigError(f"config field 'compress_ratios[{l}]' = {m} differs from its KV source layer "
                                  f"{srcs[-1]} ({self.compress_ratios[srcs[-1]]})")
        c = self.candidate_source_layer_id
        if c >= 0 and c not in idx:
            raise ConfigError(f"config field 'candidate_source_layer_id' = {c} is not an index source")
        if c >= 0 and (self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0):
            raise ConfigError("config fields 'candidate_topk_blocks'/'candidate_block_size' must be positive "
                              "when 'candidate_source_layer_id' is set")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                raise ConfigError("config field 'engram_num_embeddings' must have one entry per 'engram_layer_ids'")
            if self.engram_max_ngram_size < 2:
                raise ConfigError("config field 'engram_max_ngram_size' must be >= 2")
            if self.engram_head_dim % 32:
                raise ConfigError("config field 'engram_head_dim' must be a multiple of 32")
            if 0 in self.engram_layer_ids:
                raise ConfigError("config field 'engram_layer_ids' must not contain layer 0")

    # ------------------------------------------------------------------ derived
    @property
    def hc_mix_width(self) -> int:
        """M = (2 + h) h: pre, post and the h x h combination matrix."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def num_total_layers(self) -> int:
        return self.num_layers + self.num_draft_layers

    def moe_experts(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, experts per token) of backbone or draft layer `layer_id`: V4.1 DSpark stages
        use `dspark_n_routed_experts` / `dspark_num_experts_per_tok` (0 = the backbone's), model-spec §3.8."""
        if self.family == V41 and layer_id >= self.num_layers:
            return (self.dspark_n_routed_experts or self.n_routed_experts,
                    self.dspark_num_experts_per_tok or self.num_experts_per_tok)
        return self.n_routed_experts, self.num_experts_per_tok

    def layer_plan(self, layer_id: int) -> LayerPlan:
        """Role of backbone layer `layer_id` (0..L-1) or draft layer (L..L+n-1)."""
        is_draft = layer_id >= self.num_layers
        m = 0 if is_draft else self.compress_ratios[layer_id]
        hash_routed = self.family == V4 and not is_draft and layer_id < self.num_hash_layers
        engram = (self.engram_layer_ids.index(layer_id)
                  if (not is_draft and layer_id in self.engram_layer_ids) else None)
        if m == 0:
            return LayerPlan(layer_id, 0, is_draft=is_draft, hash_routed=hash_routed, engram_table=engram)
        if self.family == V4:
            csa = m == 4
            return LayerPlan(
                layer_id, m, kv_source=layer_id, owns_compressor=True, compressor_overlap=csa,
                index_source=layer_id if csa else None, index_key_layer=layer_id if csa else None,
                owns_indexer=csa, owns_index_keys=csa, hash_routed=hash_routed)
        kv_src = max(s for s in self.kv_source_layer_ids if s <= layer_id)
        idx_src = max(s for s in self.index_source_layer_ids if s <= layer_id)
        c = self.candidate_source_layer_id
        return LayerPlan(
            layer_id, m, kv_source=kv_src, index_source=idx_src,
            index_key_layer=max(s for s in self.kv_source_layer_ids if s <= idx_src),
            owns_compressor=kv_src == layer_id, compressor_gated=m == 2,
            owns_indexer=idx_src == layer_id, owns_index_keys=idx_src == layer_id and kv_src == layer_id,
            candidate_source=layer_id == c, candidate_consumer=(c >= 0 and idx_src == layer_id and layer_id > c),
            engram_table=engram)

    def yarn_inv_freq(self) -> list[float]:
        """Per-pair frequencies of the compress RoPE table (YaRN, no magnitude scaling), model-spec §3.3."""
        r, base = self.rope_dim, self.compress_rope_theta
        freqs = [base ** (-2 * i / r) for i in range(r // 2)]
        if self.rope_factor <= 1.0:
            return freqs

        def corr(beta: float) -> float:
            return r * math.log(self.rope_original_max_pos / (2 * math.pi * beta)) / (2 * math.log(base))

        lo = max(0, math.floor(corr(self.rope_beta_fast)))
        hi = min(r - 1, math.ceil(corr(self.rope_beta_slow)))
        if hi == lo:
            hi += 0.001
        out = []
        for i, f in enumerate(freqs):
            ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
            out.append(f / self.rope_factor * ramp + f * (1 - ramp))
        return out

    def main_inv_freq(self) -> list[float]:
        r = self.rope_dim
        return [self.rope_theta ** (-2 * i / r) for i in range(r // 2)]
