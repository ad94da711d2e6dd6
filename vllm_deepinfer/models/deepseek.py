"""DeepSeek-V4-Flash and V4.1-Flash: one hardware-agnostic model (model-spec §3).

Residual state: h = hc_mult streams per token, [T, h, D]. Each layer has an attention and an FFN
sublayer, each wrapped in a manifold-constrained hyper-connection (mHC):

    pre, post, comb = HC(X)              (coefficients from the current streams)
    u  = sum_j w_j X_j                   (V4: w = pre of this sublayer; V4.1: pre of the previous one)
    y  = F(RMSNorm(u))
    X' = post * y + comb^T X

V4 collapses the final streams with `hc_head`, V4.1 with the last FFN's pre. V4.1 layers listed
in `engram_layer_ids` first add their Engram value to the streams.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, get_world_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

from vllm_deepinfer import ops
from vllm_deepinfer.attention.caches import PagedCache, cache_page_bytes, kv_records
from vllm_deepinfer.checkpoint.inventory import expected_tensors
from vllm_deepinfer.config import V4, V41, ArchConfig
from vllm_deepinfer.log import get_logger
from vllm_deepinfer.models.attention import Attention
from vllm_deepinfer.models.capture import StreamCapture
from vllm_deepinfer.models.engram import (
    Engram,
    EngramHasher,
    EngramPrefetch,
    engram_placement,
    node_arena,
    log_engram_placement,
    write_token_history,
)
from vllm_deepinfer.models.layers import (
    HyperConnection,
    RMSNorm,
    _param,
    enable_activation_quant,
    pack_fp8_linears,
)
from vllm_deepinfer.models.loader import load_checkpoint
from vllm_deepinfer.models.rope import RotaryTable
from vllm_deepinfer.models.shared_host import NodeArena
from vllm_deepinfer.models import replay
from vllm_deepinfer.models.step import Retained, StepBatch
from vllm_deepinfer.moe.layer import DeepseekMixtureOfExperts, MoE
from vllm_deepinfer.ops import quant

logger = get_logger(__name__)


class HyperHead(nn.Module):
    """V4 final collapse weights (`hc_head_{fn,base,scale}`): sigmoid(mu * scale + base) + eps."""

    def __init__(self, arch: ArchConfig):
        super().__init__()
        h = arch.hc_mult
        self.fn = _param(h, h * arch.hidden_size, dtype=torch.float32)
        self.base = _param(h, dtype=torch.float32)
        self.scale = _param(1, dtype=torch.float32)
        self.rms_eps, self.hc_eps = arch.rms_norm_eps, arch.hc_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return ops.hc_head_weights(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps)


class DecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, arch: ArchConfig, layer_id: int, ropes: nn.ModuleDict, prefix: str,
                 page_bytes: int, hasher: EngramHasher | None, history: PagedCache | None, engram_host: bool = False,
                 max_tokens: int = 0, attention_cls: type[Attention] = Attention,
                 engram_arena: NodeArena | None = None, kv_records: bool = False):
        super().__init__()
        plan = arch.layer_plan(layer_id)
        n_experts, topk = arch.moe_experts(layer_id)
        self.delayed = arch.family == V41
        hc = (arch.hc_mult, arch.hidden_size, arch.hc_mix_width, arch.rms_norm_eps, arch.hc_eps,
              arch.hc_sinkhorn_iters)
        self.hc_attn, self.hc_ffn = HyperConnection(*hc), HyperConnection(*hc)
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.ffn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        rope = ropes["compress" if plan.compressed else "main"]
        self.attn = attention_cls(arch, plan, rope, f"{prefix}.attn", page_bytes, kv_records)
        self.ffn = MoE(vllm_config, f"{prefix}.ffn", arch.hidden_size, arch.moe_intermediate_size,
                       n_experts, topk, arch.n_shared_experts, arch.vocab_size,
                       plan.hash_routed, arch.routed_scaling_factor, arch.swiglu_limit,
                       arch.image_token_id if arch.family == V41 else -1)
        self.engram = (Engram(arch, plan.engram_table, hasher, history, engram_host, max_tokens, engram_arena)
                       if plan.engram_table is not None else None)

    def forward(self, streams: torch.Tensor, carry: torch.Tensor | None, batch: StepBatch,
                retained: Retained | None = None):
        """streams: [T, h, D]; carry: V4.1 pre of the previous sublayer [T, h] (None before layer 0).

        `retained` (bounded replay, the cut layer and those past it): the attention writes every token's
        state, and only the retained rows leave the layer ([T', h, D], [T', h]).
        """
        if self.engram is not None:
            streams = self.engram(streams, batch)
        rows = None if retained is None else retained.rows
        streams, carry = self._sublayer(streams, carry, self.hc_attn,
                                        lambda u: self.attn(self.attn_norm(u), batch, retained), rows)
        if rows is not None and not rows.numel():  # every token of the step stops at the cut
            return streams, carry
        batch = batch if retained is None else retained.batch
        return self._sublayer(streams, carry, self.hc_ffn, lambda u: self.ffn(self.ffn_norm(u), batch.token_ids))

    def _sublayer(self, streams, carry, hc, fn, rows: torch.Tensor | None = None):
        """rows: the rows fn returns (bounded replay), None = all."""
        pre, post, comb = hc(streams)
        weights = carry if self.delayed else pre
        u = streams[:, 0] if weights is None else ops.hc_collapse(streams, weights)
        y = fn(u)
        if rows is not None:
            streams, pre, post, comb = streams[rows], pre[rows], post[rows], comb[rows]
        return ops.hc_expand(streams, y, post, comb), pre


class DeepseekModel(nn.Module):
    def __init__(self, vllm_config: VllmConfig, arch: ArchConfig, prefix: str = "model"):
        super().__init__()
        self.arch = arch
        dtype = vllm_config.model_config.dtype
        page_bytes = cache_page_bytes(vllm_config, arch.head_dim, dtype)
        self.embed = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embed")
        self.ropes = nn.ModuleDict({"main": RotaryTable(arch, False), "compress": RotaryTable(arch, True)})
        self.history = self.hasher = None
        if arch.family == V41 and arch.engram_layer_ids:
            self.hasher = EngramHasher(arch, vllm_config.model_config.tokenizer)
            # A history row is padded to the window-KV row size, so its blocks hold as many tokens as a
            # window block: the scheduler's block size (LCM of all groups), which is also where prefix-cache
            # hits land, stays small. The window is max_ngram tokens, so this costs a block per request.
            self.history = PagedCache(f"{prefix}.layers.{arch.engram_layer_ids[0]}.engram.history_cache",
                                      arch.head_dim * dtype.itemsize // torch.int32.itemsize, torch.int32,
                                      page_bytes, window=arch.engram_max_ngram_size)
        host, shared = engram_placement(vllm_config) if self.hasher is not None else (False, False)
        # the world group is the one the tables' node arena was created on: load_weights ends with its barrier
        self.engram_arena_group = get_world_group().cpu_group if shared else None
        arena = node_arena(arch, torch.device(vllm_config.device_config.device).type == "cuda") if shared else None
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        records = kv_records(vllm_config)  # the drafters' window KV (spec_decode/) stays exact rows
        if records:
            logger.info("vllm-deepinfer: window and compressed KV stored as fp8_ds_mla records (--kv-cache-dtype "
                        "fp8_ds_mla; the values of parity kv)")
        self.layers = nn.ModuleList(
            DecoderLayer(vllm_config, arch, l, self.ropes, f"{prefix}.layers.{l}", page_bytes, self.hasher,
                         self.history, host, max_tokens, engram_arena=arena, kv_records=records)
            for l in range(arch.num_layers))
        self._wire_shared_caches()
        engrams = [layer.engram for layer in self.layers if layer.engram is not None]
        self.engram_prefetch = EngramPrefetch(engrams)
        if engrams:
            log_engram_placement(engrams)
        # Batch-invariant mode too: there every token is computed by the per-token path, so dropping a request's
        # early prompt tokens past the cut leaves every kept token's output bitwise unchanged (`StepBatch`).
        self.replay = replay.resolve(arch, vllm_config.cache_config.swa_bounded_replay)
        if self.replay is not None:
            self._wire_replay(vllm_config.cache_config.enable_prefix_caching)
        self.data_parallel = vllm_config.parallel_config.data_parallel_size > 1
        # Bounded replay counters (host ints): prompt tokens of prefill steps, how many of them left the
        # cut layer, and the prompt rows the layers from the cut on ran in all.
        self.replay_counts = {"prefill_tokens": 0, "past_cut_tokens": 0, "replay_rows": 0}
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hc_head = HyperHead(arch) if arch.family == V4 else None
        # V4 MTP speculation: each step's pre-collapse streams [max_num_batched_tokens, h*D] for the drafter
        # (`DeepseekV4ForCausalLM.enable_mtp_states`); None without it.
        self.mtp_states: torch.Tensor | None = None
        # DSpark speculation: stream means entering some layers (context features); None = off.
        self.capture: StreamCapture | None = None

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The embedding under the name vLLM's draft proposer looks up (`_maybe_share_embeddings`)."""
        return self.embed

    def _wire_shared_caches(self) -> None:
        """V4.1 KV and index-key sharing: consumers read their sources' caches."""
        for layer in self.layers:
            attn, plan = layer.attn, layer.attn.plan
            if plan.kv_source is not None and not plan.owns_compressor:
                attn.kv_source = self.layers[plan.kv_source].attn.compressed_cache
            if attn.indexer is not None and not plan.owns_index_keys:
                attn.indexer.key_source = self.layers[plan.index_key_layer].attn.indexer.key_cache

    def _wire_replay(self, prefix_caching: bool) -> None:
        """Bounded replay: layers past the cut declare their window KV as replay groups; with prefix caching
        the other sliding-window caches keep `keep` more tokens."""
        keep, cut = self.replay.keep, self.replay.cut
        for l, layer in enumerate(self.layers):
            if l > cut:
                layer.attn.window_cache.replay_tokens = keep
        if prefix_caching:
            for cache in self.modules():
                if isinstance(cache, PagedCache) and cache.window is not None and not cache.replay_tokens:
                    cache.retain_tokens = keep

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> final normalised hidden states [T, D] (bounded replay: rows of
        dropped prompt tokens are 0; vLLM samples only at a request's last prompt token, always kept)."""
        cut = self.replay.cut if self.replay is not None else -1
        keeps = self.replay.layer_keeps(self.capture is not None) if cut >= 0 else ()
        batch = StepBatch.from_forward_context(input_ids, positions, cut >= 0)
        dp_rows = replay.agree_across_dp(batch.replay_rows(keeps)) if cut >= 0 and self.data_parallel else None
        if self.history is not None:
            write_token_history(self.history, batch)
            self.engram_prefetch.start(batch)  # host tables: row gathers overlap the layers before Engram
        e = self.embed(input_ids)
        streams = e.unsqueeze(1).expand(-1, self.arch.hc_mult, -1).contiguous()
        carry = rows = None
        for l, layer in enumerate(self.layers):
            if self.capture is not None:
                self.capture.record(l, streams, rows)
            if not 0 <= cut <= l:  # replay off, or a layer before the cut: every token
                streams, carry = layer(streams, carry, batch)
                continue
            keep = keeps[l - cut]
            retained = batch.retained(keep)
            with replay.dp_rows(dp_rows, l - cut):
                streams, carry = layer(streams, carry, batch, retained)
            if batch.replay_spans:
                self._count_replay(l == cut, batch, retained)
            if retained is not None:
                rows = retained.rows if rows is None else rows[retained.rows]
                batch = retained.batch
                if not rows.numel():  # an early prefill chunk: only the state writes were needed
                    self._idle_moe(l, dp_rows, e[:0], input_ids[:0])
                    return e.new_zeros(e.shape)
            batch = batch.with_replay_keep(keep)
        if self.mtp_states is not None:
            self.mtp_states[: streams.shape[0]].copy_(streams.flatten(1))
        weights = self.hc_head(streams) if self.hc_head is not None else carry
        hidden = self.norm(ops.hc_collapse(streams, weights))
        if rows is not None:
            hidden = hidden.new_zeros(input_ids.shape[0], hidden.shape[-1]).index_copy_(0, rows, hidden)
        return hidden

    def _idle_moe(self, first: int, dp_rows: torch.Tensor | None, x: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Data parallel, a rank left with no rows by layer `first` (which then skips its FFN): its FFNs from
        `first` on still join the MoE collectives of the ranks that have rows (x: [0, D], token_ids: [0])."""
        if dp_rows is None:
            return
        cut = self.replay.cut
        for l in range(first, len(self.layers)):
            if dp_rows[l - cut].any():
                with replay.dp_rows(dp_rows, l - cut):
                    self.layers[l].ffn(x, token_ids)

    def _count_replay(self, at_cut: bool, batch: StepBatch, retained: Retained | None) -> None:
        total = batch.replay_tokens()
        kept = total if retained is None else retained.batch.replay_tokens()
        self.replay_counts["replay_rows"] += kept
        if at_cut:
            self.replay_counts["prefill_tokens"] += total
            self.replay_counts["past_cut_tokens"] += kept
            logger.debug("bounded replay: %d of %d prefill tokens run layers past %d", kept, total, self.replay.cut)


class DeepseekForCausalLM(nn.Module, DeepseekMixtureOfExperts):
    """vLLM model class; `family` pins which checkpoint family the registered name accepts. Implements
    vLLM's `MixtureOfExperts` (expert parallel, EPLB) over the layers' fused-MoE experts."""

    family: str = ""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.arch = ArchConfig.from_hf(vllm_config.model_config.hf_config)
        if self.arch.family != self.family:
            raise ValueError(f"{type(self).__name__} runs {self.family} checkpoints, got a {self.arch.family} config")
        logger.info("vllm-deepinfer plugin model %s (%s, %d layers, ops: %s)", type(self).__name__,
                    self.arch.family, self.arch.num_layers, ops.backend_for(torch.empty(0, device=vllm_config.device_config.device)))
        self.arch.check_tensor_parallel(get_tensor_model_parallel_world_size())
        numerics = quant.configure()
        if ops.configure_invariant(vllm_config):
            logger.info("vllm-deepinfer: batch-invariant mode (DEEPINFER_BATCH_INVARIANT)")
        self.model = DeepseekModel(vllm_config, self.arch, prefix="model")
        self.collect_moe_layers([layer.ffn for layer in self.model.layers])
        if self.model.replay is not None:
            from vllm_deepinfer.patches import replay_prompt_lens

            replay_prompt_lens.apply()
        if ops.packed_storage(ops.FP8_LINEARS_ENV, torch.device(vllm_config.device_config.device).type):
            fp8 = {n for n, (dtype, _) in expected_tensors(self.arch).items() if dtype == "F8_E4M3"}
            packed = pack_fp8_linears(self.model, fp8, self.arch.weight_block_size)
            logger.info("vllm-deepinfer: %d FP8 block linears keep their E4M3 codes (Marlin W8A16 on CUDA, "
                        "else ops.linear_fp8_block)", len(packed))
        if self.arch.family == V4 and quant.enabled("act"):
            enable_activation_quant(self.model)
        logger.info("vllm-deepinfer numerics: %s", "parity " + ",".join(sorted(numerics)) if numerics else "exact")
        self.lm_head = ParallelLMHead(self.arch.vocab_size, self.arch.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(self.arch.vocab_size)
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens

    def get_model_state_cls(self):
        """V2 model runner: a ModelState that hands the builders the prompt lengths (bounded replay) and the
        leading requests adaptive verification may have trimmed (`models/step.py`)."""
        return replay.replay_model_state_cls()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def enable_stream_capture(self, layers: tuple[int, ...], max_tokens: int) -> StreamCapture:
        """Record the stream means entering `layers` on every forward (DSpark's context features)."""
        self.model.capture = StreamCapture(layers, max_tokens, self.arch.hidden_size,
                                           self.model.embed.weight.dtype, self.model.embed.weight.device)
        return self.model.capture

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("DeepInfer DeepSeek models need token ids (hash routing and Engram read them)")
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if ops.batch_invariant():  # vLLM's head GEMM rounds by the number of rows
            logits = self.logits_processor._gather_logits(ops.linear(hidden_states, self.lm_head.weight))
            return None if logits is None else logits[..., : self.arch.vocab_size]
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_checkpoint(self, self.arch, weights)
        if self.model.engram_arena_group is not None:  # node-shared Engram tables: the writer has filled them
            dist.barrier(group=self.model.engram_arena_group)
        return loaded


class DeepseekV4ForCausalLM(DeepseekForCausalLM):
    family = V4

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        spec = vllm_config.speculative_config
        if spec is not None and spec.method == "mtp":
            arch = self.arch
            self.model.mtp_states = torch.zeros(vllm_config.scheduler_config.max_num_batched_tokens,
                                                arch.hc_mult * arch.hidden_size, dtype=vllm_config.model_config.dtype)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """The last step's pre-collapse streams [max_num_batched_tokens, h*D] (rows of the step's tokens
        valid), which vLLM's runner feeds the MTP drafter instead of the final hidden states; None
        without MTP speculation."""
        return self.model.mtp_states


class DeepseekV41ForCausalLM(DeepseekForCausalLM):
    """V4.1; for vLLM's V2 DSpark speculator (`VLLM_DEEPINFER_DSPARK_V2=1`) also vLLM's `SupportsEagle3`: the
    runner asks for the stream means entering the drafter's target layers as aux hidden states, which the
    forward then returns beside the hidden states."""

    family = V41
    supports_eagle3: ClassVar[Literal[True]] = True
    has_own_lm_head = has_own_embed_tokens = False
    aux_hidden_states = False  # set by set_aux_hidden_state_layers

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Capture the stream means entering `layers` (vLLM hands DSpark's `dspark_target_layer_ids`)."""
        self.enable_stream_capture(tuple(layers), self.max_num_tokens)
        self.aux_hidden_states = True

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.arch.dspark_target_layer_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs):
        """-> hidden [T, D], or (hidden, [len(layers) x [T, D]]) once aux hidden states are asked for (rows of
        prompt tokens that bounded replay drops past the cut are 0; DSpark's window never reads them)."""
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if not self.aux_hidden_states:
            return hidden
        return hidden, list(self.model.capture.features[: input_ids.shape[0]].unbind(1))
