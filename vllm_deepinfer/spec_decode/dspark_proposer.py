"""DeepInfer's DSpark drafter inside vLLM's V1 speculative decoding (the runner on CPU).

vLLM 0.32 runs `method="dspark"` only in its V2 runner; on V1 the runner would build an `EagleProposer`
(`use_eagle()` includes dspark), whose one-token autoregressive loop cannot drive a block drafter.
`patches/drafters_v1.py` makes V1 accept the method for DeepInfer's V4.1 drafter and puts this proposer in
the runner's place. It keeps the base class's input preparation (`prepare_next_token_ids_padded`,
`prepare_inputs_padded`), draft KV-cache group and metadata builders, and replaces the drafting:

    target forward  -> StreamCapture: features [T, 3, D] of the step's tokens (models/capture.py)
    propose         -> context KV of every step token (rejected ones too: they sit at positions >= the anchor,
                       which no block reads, and are overwritten when those positions are processed again),
                       then one block of N = num_speculative_tokens per request after its anchor
                       (next_token_ids) at position seq_len - rejected.

Drafts are greedy (argmax of the Markov-corrected logits): a deterministic proposal, so V1's rejection
sampler (no draft probabilities) stays exact for any target sampling. In batch-invariant mode the drafts of
sampled requests are the seeded draws with the target's noise instead (exact-match verification there).
The confidence head's c_k feed the draft-length policy (`DraftLengthPolicy.observe`); while its cold-drafter
rule says the block buys nothing (`schedule.ColdDrafter`), a proposal stores the context rows only. With CUDA
graphs on (any `cudagraph_mode` but NONE) decode and verification steps replay the proposer's own graphs
(`spec_decode/draft_graphs.py`); vLLM's dummy runs do nothing here. Not covered: multimodal inputs,
`disable_padded_drafter_batch`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.worker.utils import AttentionGroup

from vllm_deepinfer.attention.backend import PagedCacheMetadata
from vllm_deepinfer.patches.drafters_v1 import group_block_table
from vllm_deepinfer.spec_decode.draft_graphs import DraftStepGraphs
from vllm_deepinfer.spec_decode.dspark import DraftBatch, DSparkDrafter


class DSparkProposer(EagleProposer):
    """V1 proposer of `DSparkDrafter` (module docstring).

    vLLM splits KV-cache groups to equal layer counts, so the three stages' window caches may land in
    different groups (the base class asserts one group): each group gets its own metadata builder, and
    the block tables of groups other than the one the runner prepares for the drafter (`kv_cache_gid`)
    are read from the runner's input batch (`patches/drafters_v1.group_block_table`)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner):
        super().__init__(vllm_config, device, runner)
        if self.speculative_config.disable_padded_drafter_batch:
            # that path hands only the accepted tokens, which no longer line up with the capture's rows
            raise NotImplementedError("DeepInfer DSpark needs the padded drafter batch "
                                      "(disable_padded_drafter_batch=False)")
        self.runner = runner

    def load_model(self, target_model: nn.Module) -> None:
        """Build and load the drafter (vLLM's loader, architecture `DSparkV41DraftModel`), share the target's
        embedding and head, and install the target's stream capture."""
        target_layers = set(get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase))
        self.model: DSparkDrafter = self._get_model()
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self._draft_attn_layer_names = set(layers) - target_layers
        self.model.bind_target(target_model)
        max_tokens = self.vllm_config.scheduler_config.max_num_batched_tokens
        self.capture = target_model.enable_stream_capture(self.model.target_layers, max_tokens)

    def initialize_attn_backend(self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None) -> None:
        """One `AttentionGroup` (our paged-cache builder) per KV-cache group holding drafter caches."""
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self.draft_attn_groups = []
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            names = sorted(self._draft_attn_layer_names & set(group.layer_names))
            if names:
                attn_group = AttentionGroup(backend=layers[names[0]].get_attn_backend(), layer_names=names,
                                            kv_cache_spec=group.kv_cache_spec, kv_cache_group_id=gid)
                attn_group.create_metadata_builders(self.vllm_config, self.device)
                self.draft_attn_groups.append(attn_group)
        self.kv_cache_gid = self.draft_attn_groups[0].kv_cache_group_id
        self.block_size = self.draft_attn_groups[0].kv_cache_spec.block_size
        # data parallel: eager draft steps, whose MoE collectives `dummy_run` mirrors on idle ranks
        graphs = (self.device.type == "cuda" and self.vllm_config.parallel_config.data_parallel_size == 1
                  and self.vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE)
        self.fixed_steps = self.fixed_step_graphs(capture_graphs=True) if graphs else None

    def fixed_step_graphs(self, capture_graphs: bool) -> DraftStepGraphs:
        """The fixed-shape draft steps over this proposer's caches (`capture_graphs=False`: run eagerly)."""
        groups = {g.kv_cache_group_id: list(g.layer_names) for g in self.draft_attn_groups}
        return DraftStepGraphs(self.model, self.capture, self.vllm_config, groups,
                               self.speculative_config.num_speculative_tokens,
                               self.vllm_config.scheduler_config.max_num_seqs, self.device, capture_graphs)

    def _tables(self, cm: CommonAttentionMetadata) -> dict[int, torch.Tensor]:
        """Block table [R, blocks] of every drafter cache group for the step described by `cm`."""
        return {g.kv_cache_group_id: cm.block_table_tensor if g.kv_cache_group_id == self.kv_cache_gid
                else group_block_table(self.runner, g.kv_cache_group_id, cm.num_reqs) for g in self.draft_attn_groups}

    def _metadata(self, cm: CommonAttentionMetadata, tables: dict[int, torch.Tensor]) -> dict[str, PagedCacheMetadata]:
        """Per drafter cache layer: its group's metadata for the step described by `cm`."""
        out = {}
        for group in self.draft_attn_groups:
            meta = group.build_metadata(dataclasses.replace(cm, block_table_tensor=tables[group.kv_cache_group_id]))
            out.update(dict.fromkeys(group.layer_names, meta))
        return out

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True, is_graph_capturing: bool = False,
                  slot_mappings=None) -> None:
        """A data-parallel rank with no draft to make (vLLM's dummy batches: an idle rank, the profiling run)
        joins the collectives a draft makes (`propose`): the forward context's batch agreement across DP ranks,
        then every stage's MoE (expert-parallel all2all) on `num_tokens` zero rows. Without data parallelism,
        and while vLLM captures graphs, nothing: the drafter's caches are unbound during the profiling run and
        its own graphs are captured on first use (`fixed_steps`)."""
        if self.vllm_config.parallel_config.data_parallel_size == 1 or is_graph_capturing:
            return
        with torch.inference_mode(), set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            self.model.moe_collectives(num_tokens)

    def take_last_draft_probs(self) -> None:
        return None  # greedy drafts: a deterministic proposal

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        """-> draft token ids [num_reqs, num_speculative_tokens] (int64)."""
        cm = common_attn_metadata
        b, t, dev = cm.num_reqs, target_token_ids.shape[0], next_token_ids.device
        counts = np.diff(cm.query_start_loc_cpu[: b + 1].numpy())
        anchor_pos = cm.seq_lens[:b].long()
        if num_rejected_tokens_gpu is not None:
            anchor_pos = anchor_pos - num_rejected_tokens_gpu[:b].long()
        tables = self._tables(cm)
        metadata = self._metadata(cm, tables)
        policy = self.model.draft_policy
        # a cold drafter's proposal (`schedule.ColdDrafter`) runs no block: n = 0, the context rows only
        n = num_speculative_tokens if policy.block_runs(self.runner.input_batch.req_ids[:b]) else 0
        coupling = self._coupling(sampling_metadata, b) if n else {}
        r = None
        if self.fixed_steps is not None and not coupling:
            r = self.fixed_steps.size_for(b, int(counts.max(initial=0)))
        with torch.inference_mode():
            if r is not None:
                tokens, confidence = self.fixed_steps.propose(
                    r, n, metadata, tables, cm.query_start_loc, t, target_positions, next_token_ids[:b].long(),
                    anchor_pos)
            else:
                req = torch.from_numpy(np.repeat(np.arange(b), counts)).to(dev)
                # the context's token count is the block's (B * N rows through each stage's MoE: under data
                # parallelism the ranks agree on it, and an idle rank's `dummy_run` joins; data parallelism
                # turns the cold drafter off)
                with set_forward_context(metadata, self.vllm_config, num_tokens=b * n if n else t):
                    self.model.write_context(self.capture.features[:t], req, target_positions[:t].long(), metadata,
                                             keep=self.capture.valid[:t])
                    if n:
                        block = DraftBatch(torch.arange(b, device=dev), anchor_pos, n, metadata)
                        draft = self.model.draft(next_token_ids[:b].long(), block, **coupling)
                        tokens, confidence = draft.tokens, draft.confidence
        if not n:
            policy.skip(b, dev)  # survival 0: these drafts are never verified
            return next_token_ids[:b].long().unsqueeze(1).repeat(1, num_speculative_tokens)
        policy.observe(confidence)
        return tokens

    def _coupling(self, sampling_metadata, b: int) -> dict:
        """Batch-invariant mode (the step's seeds handed to the policy by `patches/seeded_sampler.py`): the
        requests' temperature, top-k / top-p and seeds, so the drafts are drawn with the target's noise
        (verification there is exact match); otherwise {} (greedy drafts)."""
        seeds = self.model.draft_policy.seeds
        if seeds is None or sampling_metadata.all_greedy:
            return {}
        cut = lambda x: None if x is None else x[:b]  # noqa: E731
        return dict(temperature=sampling_metadata.temperature[:b], seeds=seeds[:b].to(self.device),
                    top_k=cut(sampling_metadata.top_k), top_p=cut(sampling_metadata.top_p))
