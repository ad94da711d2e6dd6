"""DeepSeek-V4-Flash MTP drafter (`mtp.0`, layer id L = num_hidden_layers; model-spec §3.11).

vLLM's `method="mtp"` rewrites a `deepseek_v4` draft config to `architectures=["DeepSeekV4MTPModel"]`
(`vllm/config/speculative.py`), which the plugin registers to this class; the V1 runner drives it
through `EagleProposer` (`spec_decode/proposer.py` adds the draft-length policy). Per token at
position p, with the next token id_{p+1} and the target's pre-collapse streams X(p) [h, D]
(`DeepseekV4ForCausalLM.get_mtp_target_hidden_states`):

    e    = RMSNorm_enorm(embed(id_{p+1}))          (embedding row 0 at position 0, as vLLM)
    X0_j = RMSNorm_hnorm(X(p)_j) h_proj^T + e e_proj^T          j = 0..h-1
    X1   = Block_L(X0)                              (one V4 decoder layer: SWA with its own window cache, scored MoE)
    forward -> X1 flattened [T, h*D]                (fed back as X(p+1) for the next draft step)
    logits  = head(RMSNorm_norm(hc_head collapse of X1))    (compute_logits)

The block is the target's `DecoderLayer` (same attention, caches, MoE and ops); its window cache is
created after every target layer, so vLLM's positional rule finds the drafter's KV group.
`emb.tok_emb` and `head` are the drafter's own tensors; vLLM's proposer swaps in the target's
embedding / head when they are bitwise equal (`has_own_embed_tokens` / `has_own_lm_head`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from vllm_deepinfer import ops
from vllm_deepinfer.attention.caches import cache_page_bytes
from vllm_deepinfer.checkpoint.inventory import expected_tensors
from vllm_deepinfer.config import V4, ArchConfig
from vllm_deepinfer.log import get_logger
from vllm_deepinfer.models.deepseek import DecoderLayer, HyperHead
from vllm_deepinfer.models.layers import Linear, RMSNorm, enable_activation_quant, pack_fp8_linears
from vllm_deepinfer.models.loader import load_draft, target_name
from vllm_deepinfer.models.rope import RotaryTable
from vllm_deepinfer.models.step import StepBatch
from vllm_deepinfer.ops import quant
from vllm_deepinfer.spec_decode.proposer import policy_for

logger = get_logger(__name__)

#: Checkpoint names under `mtp.{i}.` that belong to the decoder block (the rest are MTP-only tensors).
_BLOCK_PARTS = ("attn.", "ffn.", "attn_norm.", "ffn_norm.", "hc_attn_", "hc_ffn_")


def draft_arch(hf_config) -> ArchConfig:
    """ArchConfig of the target from the draft's hf_config (vLLM renamed its model_type to deepseek_mtp)."""
    cfg = copy.copy(hf_config)
    cfg.model_type = "deepseek_v4"
    arch = ArchConfig.from_hf(cfg)
    if arch.num_draft_layers != 1:
        raise ValueError(f"DeepSeek-V4 MTP: expected one MTP block (num_nextn_predict_layers), got {arch.num_draft_layers}")
    return arch


def draft_param_name(name: str, arch: ArchConfig) -> str:
    """Checkpoint tensor `mtp.0.X` -> parameter of DeepseekV4MTP (block tensors -> model.layers.L.X)."""
    rest = name.split(".", 2)[2]
    if rest == "emb.tok_emb.weight":
        return "model.embed_tokens.weight"
    if rest.startswith(_BLOCK_PARTS):
        rest = f"layers.{arch.num_layers}.{rest}"
    return target_name(rest)


class MTPModel(nn.Module):
    """The MTP block with its input projections and output collapse (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, arch: ArchConfig, prefix: str = "model"):
        super().__init__()
        self.arch = arch
        d = arch.hidden_size
        dtype = vllm_config.model_config.dtype
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, d, prefix=f"{prefix}.embed_tokens")
        self.enorm, self.hnorm = RMSNorm(d, arch.rms_norm_eps), RMSNorm(d, arch.rms_norm_eps)
        self.e_proj = Linear(d, d, prefix=f"{prefix}.e_proj")
        self.h_proj = Linear(d, d, prefix=f"{prefix}.h_proj")
        self.ropes = nn.ModuleDict({"main": RotaryTable(arch, False), "compress": RotaryTable(arch, True)})
        layer = arch.num_layers
        page_bytes = cache_page_bytes(vllm_config, arch.head_dim, dtype)
        self.layers = nn.ModuleDict({str(layer): DecoderLayer(vllm_config, arch, layer, self.ropes,
                                                              f"{prefix}.layers.{layer}", page_bytes, None, None)})
        self.hc_head = HyperHead(arch)
        self.norm = RMSNorm(d, arch.rms_norm_eps)

    @property
    def block(self) -> DecoderLayer:
        return self.layers[str(self.arch.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; previous: [T, h*D] pre-collapse streams -> the block's streams [T, h*D]."""
        t, h, d = input_ids.shape[0], self.arch.hc_mult, self.arch.hidden_size
        batch = StepBatch.from_forward_context(input_ids, positions)
        e = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.h_proj(self.hnorm(previous[:t].view(t * h, d))).view(t, h, d)
        x = x + self.e_proj(self.enorm(e)).unsqueeze(1)
        streams, _ = self.block(x, None, batch)
        return streams.flatten(1)

    def collapse(self, states: torch.Tensor) -> torch.Tensor:
        """states [T, h*D] -> RMSNorm_norm(hc_head collapse) [T, D]."""
        streams = states.view(-1, self.arch.hc_mult, self.arch.hidden_size)
        return self.norm(ops.hc_collapse(streams, self.hc_head(streams)))


class DeepseekV4MTP(nn.Module):
    """vLLM draft model class of `method="mtp"` on DeepSeek-V4 checkpoints (registered as DeepSeekV4MTPModel)."""

    has_own_embed_tokens = True
    has_own_lm_head = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        spec = vllm_config.speculative_config
        self.arch = draft_arch(spec.draft_model_config.hf_config)
        if self.arch.family != V4:
            raise ValueError("DeepSeekV4MTPModel drafts for DeepSeek-V4 checkpoints only")
        self.model = MTPModel(vllm_config, self.arch)
        if ops.packed_storage(ops.FP8_LINEARS_ENV, torch.device(vllm_config.device_config.device).type):
            fp8 = {draft_param_name(n, self.arch) for n, (dtype, _) in expected_tensors(self.arch).items()
                   if n.startswith("mtp.0.") and dtype == "F8_E4M3"}
            pack_fp8_linears(self, fp8, self.arch.weight_block_size)
        if quant.enabled("act"):  # parity numerics (the target's constructor read the mode)
            enable_activation_quant(self.model)
        self.lm_head = ParallelLMHead(self.arch.vocab_size, self.arch.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(self.arch.vocab_size)
        # Draft-length policy of confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN), driven by
        # patches/draft_lengths.py around vLLM's proposer.
        self.draft_policy = policy_for(vllm_config, "MTP drafter")
        logger.info("vllm-deepinfer MTP drafter: block id %d, %d speculative tokens, %s draft length, %s",
                    self.arch.num_layers, spec.num_speculative_tokens,
                    "confidence-scheduled" if self.draft_policy.varlen else "fixed",
                    self.model.block.ffn.placement())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                spec_step_idx: int = 0) -> torch.Tensor:
        """hidden_states: [T, h*D] the target's (first step) or this block's (later steps) pre-collapse
        streams at the previous position -> [T, h*D]."""
        if input_ids is None:
            raise ValueError("the DeepInfer MTP drafter needs token ids")
        return self.model(input_ids, positions, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        """hidden_states [T, h*D] -> draft logits [T, V]."""
        return self.logits_processor(self.lm_head, self.model.collapse(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_draft(self, self.arch, weights, lambda name: draft_param_name(name, self.arch))
