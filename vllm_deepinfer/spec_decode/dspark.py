"""DSpark drafter of DeepSeek-V4.1-Flash (model-spec §3.12): three stages over the target's context features.

Context, for every token t the target processes (`models/capture.py` records the stream means):

    a_L(t)    = mean_j X_j(t) entering target layer L in dspark_target_layer_ids
    main_x(t) = RMSNorm_{main_norm}([a_L1; a_L2; a_L3] · main_projᵀ)
    k_i(t)    = RoPE_t(RMSNorm_{kv_norm_i}(main_x(t) · wkv_iᵀ))      -> stage i's window cache at t

Draft block of one request (P + 1 = the anchor's position = the number of positions with context):

    ids      = [anchor, noise, ..., noise] at positions P+1 .. P+N
    X        = stages 0..2: V4.1 blocks (delayed mHC from the broadcast embedding, m = 0 attention with the
               main RoPE table, the draft MoE); every block query attends to its stage's context window,
               positions max(0, P+1-W) .. P (shared by the whole block), to all N block positions, and the sink
    h_k      = sum_j pre_j X_j (the last FFN's pre)                  pre-norm hidden of block position k
    U_k      = RMSNorm_{norm}(h_k) · headᵀ                           the target's head
    psi_k    = markov_embed[prev_k],  prev_0 = anchor,  prev_{k+1} = d_k
    logits_k = U_k + psi_k · markov_headᵀ;   d_k drawn from logits_k   (the token at P+k+2)
    c_k      = sigmoid([h_k; psi_k] · confidenceᵀ)                   confidence of d_k

The stages are the model's own `DecoderLayer` blocks (`DSparkStage`) with `DSparkAttention`: the
parameters and window cache of an m = 0 `Attention`, with the context write and the block forward.
The drafter owns no embedding or head: it calls the target's (`embed_input_ids`, `compute_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from vllm_deepinfer import ops
from vllm_deepinfer.attention.backend import PagedCacheMetadata
from vllm_deepinfer.attention.caches import cache_page_bytes
from vllm_deepinfer.checkpoint.formats import check_no_nan_codes
from vllm_deepinfer.checkpoint.inventory import InventoryError, expected_tensors
from vllm_deepinfer.config import V41, ArchConfig, ConfigError
from vllm_deepinfer.log import get_logger
from vllm_deepinfer.models.attention import Attention
from vllm_deepinfer.models.deepseek import DecoderLayer
from vllm_deepinfer.models.layers import Linear, RMSNorm, pack_fp8_linears
from vllm_deepinfer.models.loader import DRAFT_PREFIX, hc_param_name, write_tensors
from vllm_deepinfer.models.rope import RotaryTable
from vllm_deepinfer.ops import quant
from vllm_deepinfer.patches.drafters_v1 import dspark_opt_in
from vllm_deepinfer.serving.seeded_sampling import seeded_rows
from vllm_deepinfer.spec_decode.proposer import cold_drafter_enabled, policy_for
from vllm_deepinfer.spec_decode.schedule import ColdDrafter

logger = get_logger(__name__)

#: Tensors of the drafter itself (not of a stage), by their name after `mtp.{i}.`.
_DRAFTER_TENSORS = ("main_proj.", "main_norm.", "norm.", "markov_head.", "confidence_head.")
_STAGE = re.compile(r"^mtp\.(\d+)\.(.*)$")


def draft_name(name: str) -> str:
    """Module path in `DSparkDrafter` of checkpoint tensor `mtp.{i}.<rest>` (experts: of their fused-MoE layer)."""
    m = _STAGE.match(name)
    if m is None:
        raise InventoryError(f"'{name}' is not a DSpark (mtp.*) tensor")
    stage, rest = m.groups()
    if rest.startswith(_DRAFTER_TENSORS):
        return rest
    return f"stages.{stage}.{hc_param_name(rest)}"


@dataclasses.dataclass
class DraftBatch:
    """Layout of one draft step over B requests.

    req: [B] block-table rows of the requests; anchor_pos: [B] int64 position of each anchor (P + 1, the
    number of positions whose context KV is written); n: block length N; attn_metadata: cache prefix ->
    metadata (block table) of the stages' window caches (None: vLLM's profile run, no cache bound).
    """

    req: torch.Tensor
    anchor_pos: torch.Tensor
    n: int
    attn_metadata: dict[str, PagedCacheMetadata] | None

    @property
    def positions(self) -> torch.Tensor:
        """Positions of the block tokens, request-major: [B * N]."""
        return (self.anchor_pos.unsqueeze(1) + torch.arange(self.n, device=self.anchor_pos.device)).flatten()


@dataclasses.dataclass
class Draft:
    """tokens: [B, N] int64 drafted ids (token k is the guess for position P+k+2); logits: [B, N, V] fp32,
    the Markov-corrected logits token k was drawn from; confidence: [B, N] fp32 c_k in (0, 1)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor

    def probs(self, temperature: torch.Tensor | None = None) -> torch.Tensor:
        """Draft distributions [B, N, V]: softmax(logits / T) (T: [B]; None or 0 = one-hot of the argmax)."""
        if temperature is None:
            return nn.functional.one_hot(self.tokens, self.logits.shape[-1]).float()
        t = temperature.float().view(-1, 1, 1)
        soft = torch.softmax(self.logits / t.clamp(min=1e-5), dim=-1)
        return torch.where(t > 0, soft, nn.functional.one_hot(self.logits.argmax(-1), self.logits.shape[-1]).float())


def sample(logits: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor | None,
           positions: torch.Tensor, top_k: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] fp32 -> ids [B]: argmax where the temperature is None or 0, else the seeded Gumbel-max
    draw of the target's sampler in batch-invariant mode (`serving.seeded_sampling.seeded_rows`: temperature,
    top-k / top-p, noise keyed by (seed, position of the drawn token)), so that a draft whose distribution
    matches the target's draws the target's token. temperature, seeds, positions, top_k, top_p: [B]."""
    if temperature is None:
        return logits.argmax(dim=-1)
    if seeds is None:
        raise ValueError("seeded draft sampling needs a seed per request")
    return seeded_rows(logits, temperature.float(), top_k, top_p, seeds, positions).argmax(dim=-1)


class DSparkAttention(Attention):
    """Attention of a DSpark stage (m = 0, main RoPE table): context KV from the target's features and the
    block forward, non-causal inside the block."""

    queries_and_keys_share_input = False  # keys from the target's features, queries from the block

    def _keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> window KV rows [T, d] (RoPE at the rows' positions)."""
        kv = ops.apply_rope_(self.kv_norm(self.wkv(x)), cos, sin)  # in place: fresh tensors (here and below)
        if self.parity_kv:  # fp8_ds_mla window record
            kv = quant.kv_record_roundtrip(kv, rope_dim=2 * cos.shape[-1])
        return kv

    def write_context(self, main_x: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                      meta: PagedCacheMetadata, keep: torch.Tensor | None = None) -> None:
        """main_x: [T, D]; req, positions: [T] -> this stage's window KV of those tokens, stored (rows where
        `keep` [T] is False go to the null block)."""
        self.store_context(main_x, positions, self.window_cache.row_slots(meta, req, positions, keep=keep))

    def store_context(self, main_x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """main_x: [T, D]; positions: [T]; slots: [T] flat rows of the window cache (0 = the null block, for rows
        to drop) -> stored."""
        cos, sin = self.rope.cos_sin(positions)
        self.window_cache.store_rows(slots, self._keys(main_x, cos, sin))

    def forward(self, x: torch.Tensor, block: DraftBatch) -> torch.Tensor:
        """x: [B * N, D] (normalised, request-major) -> [B * N, D].

        Keys of every query of a request: the window rows at positions anchor - W .. anchor - 1 (those >= 0),
        read in place from the cache, then the N block rows computed here (not stored). Without metadata
        (vLLM's profile run) the block attends to itself and the sink only."""
        t, n = x.shape[0], block.n
        cos, sin = self.rope.cos_sin(block.positions)
        q = ops.apply_rope_(self.wq_b(self.q_norm(self.wq_a(x))).view(t, self.n_heads, self.head_dim), cos, sin)
        kv = self._keys(x, cos, sin)
        if block.attn_metadata is None:
            slots = torch.full((t // n, self.window), -1, dtype=torch.long, device=x.device)
        else:
            slots = self.window_cache.range_slots(block.attn_metadata[self.window_cache.prefix], block.req,
                                                  block.anchor_pos - self.window, self.window)        # [B, W]
        own = torch.arange(t, device=x.device).view(-1, n)                                           # [B, N]
        out = ops.sparse_attention_paged(q, self.window_cache.rows, slots.repeat_interleave(n, 0), kv,
                                         own.repeat_interleave(n, 0), self.attn_sink, self.scale)
        out = ops.apply_rope_(out, cos, sin, inverse=True)
        return self.wo_b(self.wo_a.matmul(out.flatten(1)))


class DSparkStage(DecoderLayer):
    """Stage `mtp.i` (layer id L + i): a V4.1 block with `DSparkAttention` and the draft MoE."""

    def __init__(self, vllm_config: VllmConfig, arch: ArchConfig, stage: int, ropes: nn.ModuleDict, prefix: str,
                 page_bytes: int):
        super().__init__(vllm_config, arch, arch.num_layers + stage, ropes, prefix, page_bytes, None, None,
                         attention_cls=DSparkAttention)

    def forward(self, streams: torch.Tensor, carry: torch.Tensor | None, ids: torch.Tensor,
                block: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """streams: [B * N, h, D]; carry: the previous sublayer's pre [B * N, h] (None before stage 0);
        ids: [B * N] block token ids -> (streams, carry)."""
        streams, carry = self._sublayer(streams, carry, self.hc_attn, lambda u: self.attn(self.attn_norm(u), block))
        return self._sublayer(streams, carry, self.hc_ffn, lambda u: self.ffn(self.ffn_norm(u), ids))


class MarkovHead(nn.Module):
    """Low-rank transition bias: `embed` [V, r] embeds the previous token, `head` [V, r] maps it to logits."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, _weight=torch.empty(vocab, rank), _freeze=True)
        self.head = Linear(rank, vocab)


class ConfidenceHead(nn.Module):
    """c = sigmoid([h; psi] · projᵀ), proj: [1, D + r] (fp32 math, as vLLM)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = Linear(width, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
        """hidden: [T, D]; psi: [T, r] -> [T] fp32."""
        return torch.sigmoid(self.proj(torch.cat([hidden, psi], dim=-1).float()).squeeze(-1))


class SharedWithTarget:
    """`DSparkDrafter.model`: what vLLM's V2 DSpark loader and speculator read there (`confidence_head`) and set
    (`embed_tokens`, the target's input embedding). A plain holder, not a module: the drafter's parameter names
    stay the checkpoint's."""

    def __init__(self, confidence_head: nn.Module):
        self.confidence_head = confidence_head
        self.embed_tokens: nn.Module | None = None


class DSparkDrafter(nn.Module):
    """The three DSpark stages of a V4.1 target plus the Markov and confidence heads (module docstring).

    A vLLM model class (registered as `DSparkV41DraftModel`, the draft architecture vLLM gives V4.1's
    `dspark` method): built inside the engine's vLLM config, its stages' window caches are vLLM KV-cache
    layers named `{prefix}.stages.{i}.attn.window_cache` and their MoE layers are vLLM's. The config is the
    draft model config's (vLLM's copy of the target config), else the model config's. On the V1 runner
    `bind_target` hands it the loaded `DeepseekV41ForCausalLM`, whose embedding and head it calls; under vLLM's
    V2 DSpark speculator (`VLLM_DEEPINFER_DSPARK_V2=1`) vLLM's loader shares them (`model.embed_tokens`,
    `lm_head`) and the speculator calls the draft steps below in `draft`'s order.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        spec = vllm_config.speculative_config
        hf_config = (spec.draft_model_config if spec is not None else vllm_config.model_config).hf_config
        arch = ArchConfig.from_hf(hf_config)
        prefix = prefix or "dspark"
        if arch.family != V41 or not arch.num_draft_layers or not arch.dspark_target_layer_ids:
            raise ConfigError("DSpark needs a V4.1 checkpoint with num_nextn_predict_layers stages and "
                              "dspark_target_layer_ids")
        self.arch = arch
        d, eps = arch.hidden_size, arch.rms_norm_eps
        self.target_layers = arch.dspark_target_layer_ids
        self.noise = arch.dspark_noise_token_id
        self.main_proj = Linear(len(self.target_layers) * d, d, prefix=f"{prefix}.main_proj")
        self.main_norm = RMSNorm(d, eps)
        page_bytes = cache_page_bytes(vllm_config, arch.head_dim, vllm_config.model_config.dtype)
        ropes = nn.ModuleDict({"main": RotaryTable(arch, False)})
        self.stages = nn.ModuleList(DSparkStage(vllm_config, arch, i, ropes, f"{prefix}.stages.{i}", page_bytes)
                                    for i in range(arch.num_draft_layers))
        self.norm = RMSNorm(d, eps)
        self.markov_head = MarkovHead(arch.vocab_size, arch.dspark_markov_rank)
        self.confidence_head = ConfidenceHead(d + arch.dspark_markov_rank)
        # the target's embedding and head (shared, not owned): set by bind_target on V1; on V2 vLLM's loader
        # sets `model.embed_tokens` and `lm_head`, bound on first use (`_shared`)
        self._embed = self._logits = None
        self.model = SharedWithTarget(self.confidence_head)
        self.logits_processor = LogitsProcessor(arch.vocab_size)  # over the shared head, on V2
        self.block_len = spec.num_speculative_tokens if spec is not None else 0
        # confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN): the proposer feeds it c_k,
        # patches/draft_lengths.py trims the drafts the runner hands to the scheduler (the V1 runner's hooks;
        # unused where vLLM's V2 speculator drives this module)
        self.draft_policy = policy_for(vllm_config, "DSpark drafter") if spec is not None else None
        if self.draft_policy is not None and self.draft_policy.varlen and cold_drafter_enabled(vllm_config):
            self.draft_policy.cold = ColdDrafter()
        if spec is not None and torch.device(vllm_config.device_config.device).type == "cuda" \
                and dspark_opt_in(spec, vllm_config.model_config):
            from vllm_deepinfer.patches import cold_drafter_v2  # (imports this module's graphs: not at the top)

            cold_drafter_v2.apply()  # the same rule under vLLM's V2 speculator and its adaptive verification
        if ops.packed_storage(ops.FP8_LINEARS_ENV, torch.device(vllm_config.device_config.device).type):
            fp8 = {draft_name(n) for n, (dtype, _) in expected_tensors(arch).items()
                   if dtype == "F8_E4M3" and n.startswith(DRAFT_PREFIX)}
            pack_fp8_linears(self, fp8, arch.weight_block_size)
        logger.info("vllm-deepinfer DSpark drafter: %d stages over target layers %s, block of %d, %s per stage",
                    arch.num_draft_layers, list(self.target_layers), self.block_len,
                    self.stages[0].ffn.placement())

    def bind_target(self, target: nn.Module) -> None:
        """Use `target`'s embedding and head (`embed_input_ids`, `compute_logits`)."""
        self._embed, self._logits = target.embed_input_ids, target.compute_logits

    def _shared(self) -> None:
        """Bind the target's embedding and head that vLLM's V2 loader (`load_dspark_model`) set on this module."""
        if self._embed is not None:
            return
        head = self._modules.get("lm_head")
        if self.model.embed_tokens is None or head is None:
            raise RuntimeError("DSpark drafter: no target embedding and head (bind_target, or vLLM's V2 loader)")
        self._embed, self._logits = self.model.embed_tokens, functools.partial(self.logits_processor, head)

    # -- the steps of a draft: `draft` composes them on the V1 runner; vLLM's V2 `DSparkSpeculator`
    #    (`v1/worker/gpu/spec_decode/dspark/speculator.py`) calls them in the same order --

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [T, n_targets * D] stream means entering the target layers (config order, concatenated)
        -> main_x [T, D]."""
        return self.main_norm(self.main_proj(aux))

    def block_hidden(self, ids: torch.Tensor, block: DraftBatch) -> torch.Tensor:
        """ids: [B * N] block token ids (anchor, then noise) -> pre-norm hidden h_k [B * N, D]."""
        self._shared()
        streams = self._embed(ids).unsqueeze(1).expand(-1, self.arch.hc_mult, -1).contiguous()
        carry = None
        for stage in self.stages:
            streams, carry = stage(streams, carry, ids, block)
        return ops.hc_collapse(streams, carry)

    def moe_collectives(self, rows: int) -> None:
        """Every stage's MoE on `rows` zero rows, in `block_hidden`'s order: a data-parallel rank without a draft
        joins the expert-parallel collectives of the ranks drafting (`DSparkProposer.dummy_run`)."""
        w = self.norm.weight  # model dtype and device
        x = torch.zeros(rows, self.arch.hidden_size, dtype=w.dtype, device=w.device)
        ids = torch.zeros(rows, dtype=torch.long, device=w.device)
        for stage in self.stages:
            stage.ffn(x, ids)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, D] pre-norm -> U [T, V] fp32 (the target's head)."""
        self._shared()
        return self._logits(self.norm(hidden)).float()

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: [B] previous token ids -> psi [B, r]."""
        return self.markov_head.embed(prev.long())

    def markov_bias(self, psi: torch.Tensor) -> torch.Tensor:
        """psi: [B, r] -> logit bias [B, V] fp32."""
        return self.markov_head.head(psi).float()

    def compute_confidence(self, hidden: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
        """hidden: [T, D] pre-norm; psi: [T, r] -> c [T] in (0, 1)."""
        return self.confidence_head(hidden, psi)

    def write_context(self, aux: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                      attn_metadata: dict[str, PagedCacheMetadata], keep: torch.Tensor | None = None) -> None:
        """Context KV of T target tokens into every stage's window cache. aux: [T, n_targets, D];
        req, positions: [T] (block-table row and position of each token); keep: [T] rows to store (None: all)."""
        main_x = self.combine_hidden_states(aux.flatten(1))
        for stage in self.stages:
            attn = stage.attn
            attn.write_context(main_x, req, positions, attn_metadata[attn.window_cache.prefix], keep)

    def draft(self, anchor: torch.Tensor, block: DraftBatch, temperature: torch.Tensor | None = None,
              seeds: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
              top_p: torch.Tensor | None = None) -> Draft:
        """Draft N = block.n tokens after each anchor [B] (the token the target just sampled, at
        block.anchor_pos). temperature, seeds, top_k, top_p: [B] (temperature None = greedy; rows with T = 0 are
        greedy); the draw of block row k is keyed by its token's position, anchor_pos + k + 1."""
        b, n = anchor.shape[0], block.n
        ids = torch.full((b, n), self.noise, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        hidden = self.block_hidden(ids.flatten(), block)                          # [B * N, D], pre-norm
        base = self.compute_draft_logits(hidden).view(b, n, -1)                   # U [B, N, V]
        positions = block.positions.view(b, n)
        prev, tokens, logits, psis = anchor.long(), [], [], []
        for k in range(n):
            psi = self.markov_embed(prev)                                         # [B, r]
            logits_k = base[:, k] + self.markov_bias(psi)
            prev = sample(logits_k, temperature, seeds, positions[:, k] + 1, top_k, top_p)
            tokens.append(prev)
            logits.append(logits_k)
            psis.append(psi)
        confidence = self.compute_confidence(hidden, torch.stack(psis, dim=1).flatten(0, 1)).view(b, n)
        return Draft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1), confidence)

    # -- the rest of vLLM's V2 DSpark surface (`VLLM_DEEPINFER_DSPARK_V2=1`, `patches/drafters_v1.py`) --

    draft_id_to_target_id = None  # the draft vocabulary is the target's

    def map_draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def get_draft_kv_cache_layer_names(self) -> list[str]:
        """The stages' window caches, in stage order (vLLM hands one context slot list per name)."""
        return [stage.attn.window_cache.prefix for stage in self.stages]

    def precompute_and_store_context_kv(self, main_x: torch.Tensor, positions: torch.Tensor,
                                        slots: list[torch.Tensor] | None = None) -> None:
        """main_x: [T, D] (`combine_hidden_states`); positions: [T]; slots: per stage (the order of
        `get_draft_kv_cache_layer_names`) [T] flat window-cache rows, -1 = none (vLLM's slot mapping of the
        stage's KV-cache group). None (vLLM's profile run): nothing stored."""
        if slots is None:
            return
        for stage, stage_slots in zip(self.stages, slots, strict=True):
            stage.attn.store_context(main_x, positions, stage_slots.clamp(min=0))  # vLLM's -1 -> the null block

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """V2 draft step: input_ids, positions [B * N] (per request the anchor at P + 1, then N - 1 noise tokens;
        the forward context holds the window caches' metadata by layer name) -> pre-norm hidden [B * N, D]."""
        n = self.block_len
        b = input_ids.shape[0] // n
        block = DraftBatch(torch.arange(b, device=input_ids.device), positions.view(b, n)[:, 0].long(), n,
                           get_forward_context().attn_metadata)
        return self.block_hidden(input_ids.long(), block)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The `mtp.*` tensors of a V4.1 checkpoint (others are skipped); the set must be exactly the
        inventory's (model-spec §5.3). Returns the parameter names written."""
        tensors = {name: t for name, t in weights if name.startswith(DRAFT_PREFIX)}
        want = {n for n in expected_tensors(self.arch) if n.startswith(DRAFT_PREFIX)}
        if set(tensors) != want:
            raise InventoryError(f"DSpark tensors: missing {sorted(want - set(tensors))[:10]}, "
                                 f"unexpected {sorted(set(tensors) - want)[:10]}")
        for name, t in tensors.items():
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
                check_no_nan_codes(t, name)
        return write_tensors(self, tensors, self.arch.weight_block_size, draft_name)
