"""Engram n-gram memory of DeepSeek-V4.1 (model-spec §3.9).

For each token, the n-grams (orders 2..max) ending at it are hashed into prime-sized buckets of
one FP8 table per Engram layer; the looked-up rows are projected to per-stream keys and one shared
value, and a per-stream gate adds the value into the residual streams. Previous token ids come
from a per-request token-history cache (a paged sliding window of max_ngram - 1 tokens), so
n-grams cross chunk and step boundaries.

Table placement (`engram_placement`: `DEEPINFER_ENGRAM_DEVICE`, else vLLM's `--engram-config`
`cpu_offload`): `gpu` keeps the tables in device memory
and looks rows up inside the layer. `host` (the default on CUDA; the release tables are ~200 GB) keeps
them in pinned host memory, which the GPU reads through a UVA view (`get_accelerator_view_from_cpu_tensor`,
as vLLM's in-tree Engram does): at the start of each step, once the token ids are in the history cache,
`EngramPrefetch` hashes every Engram layer's n-grams and gathers its rows into persistent device
staging buffers on a side stream, so the PCIe reads overlap the layers before the Engram layer, which
waits on its own event. Persistent buffers and a fork/join of the capturing stream keep the decode step
capturable as a full CUDA graph. Off CUDA there is no side stream; the host path still hashes and
stages all rows at step start, and must give bitwise the tokens of the in-layer path (tests).
Every rank holds whole tables (vLLM's in-tree splits them by hash head under TP). Host tables of a
deployment with several ranks on a node are one copy per node in shared memory (`models/shared_host.py`),
the node's first rank loading it: host memory per node is one set of tables whatever TP x DP (in-tree's
`dp_shared_memory` gives the same for DP; under TP it stores one copy of every shard per node).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_world_group
from vllm.utils.platform_utils import is_uva_available
from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

from vllm_deepinfer import ops
from vllm_deepinfer.attention.caches import PagedCache
from vllm_deepinfer.checkpoint import engram_hash
from vllm_deepinfer.config import ArchConfig
from vllm_deepinfer.log import get_logger
from vllm_deepinfer.models.layers import Linear, _param
from vllm_deepinfer.models.shared_host import NodeArena
from vllm_deepinfer.models.step import StepBatch
from vllm_deepinfer.moe.layer import image_ids

logger = get_logger(__name__)


def engram_placement(vllm_config: VllmConfig) -> tuple[bool, bool]:
    """(host tables, one node-shared copy) of this process, read at model construction.

    `DEEPINFER_ENGRAM_DEVICE` decides where it is set; otherwise vLLM's `--engram-config` does
    (`cpu_offload: false` keeps the tables on the device; default: host on CUDA). Host tables are one copy per
    node shared by all its ranks (`models/shared_host.py`) when more than one rank runs, unless
    `DEEPINFER_ENGRAM_SHARED=0`, or data parallel with vLLM's `dp_shared_memory: false`."""
    cfg = vllm_config.engram_config
    if cfg is not None and cfg.embedding_across_dp:
        logger.warning("vllm-deepinfer: --engram-config embedding_across_dp is not used: every rank holds whole Engram "
                       "tables, one host copy per node shared by its ranks (on one node the same host bytes as "
                       "in-tree's TP x DP shards; across nodes one copy per node, not 1/nodes)")
    if cfg is not None and cfg.use_thp:
        logger.warning("vllm-deepinfer: --engram-config use_thp is not used: host Engram tables are pinned pages "
                       "(vLLM's in-tree also falls back to them when huge pages are unavailable)")
    device_type = torch.device(vllm_config.device_config.device).type
    host = ops.parse_engram_device(os.environ.get(ops.ENGRAM_DEVICE_ENV), device_type,
                                   cfg is None or cfg.cpu_offload) == "host"
    par = vllm_config.parallel_config
    dp_private = par.data_parallel_size > 1 and cfg is not None and cfg.dp_shared_memory is False
    shared = (host and ops.parse_engram_shared(os.environ.get(ops.ENGRAM_SHARED_ENV)) and not dp_private
              and dist.is_initialized() and get_world_group().world_size > 1)
    return host, shared


def node_arena(arch: ArchConfig, pin: bool) -> NodeArena | None:
    """The node-shared mapping of every Engram table of `arch` (collective over vLLM's world group)."""
    shapes = [s for t in range(len(arch.engram_layer_ids)) for s in EngramTable.shapes(arch, t)]
    return NodeArena.create(NodeArena.size(shapes), get_world_group().cpu_group, pin)


class EngramHasher(nn.Module):
    """Model-wide n-gram hashing state: token map, per-layer multipliers, primes and offsets."""

    def __init__(self, arch: ArchConfig, tokenizer_dir: str | Path):
        super().__init__()
        # from_numpy ignores the default device that vLLM builds the model under; place the map there.
        token_map = torch.from_numpy(engram_hash.compressed_token_map(str(tokenizer_dir))).long()
        token_map = token_map.to(torch.get_default_device())
        n_compressed = int(token_map.max()) + 1
        if n_compressed != arch.engram_compressed_vocab_size:
            raise ValueError(f"config field 'engram_compressed_vocab_size' is {arch.engram_compressed_vocab_size}, "
                             f"but the tokenizer in {tokenizer_dir} normalises to {n_compressed} ids")
        pad = int(token_map[arch.engram_pad_token_id])
        if arch.vocab_size > token_map.numel():  # ids the tokenizer never emits hash like padding
            token_map = torch.cat((token_map, torch.full((arch.vocab_size - token_map.numel(),), pad)))
        self.register_buffer("token_map", token_map, persistent=False)
        self.pad_id, self.max_ngram = pad, arch.engram_max_ngram_size
        self.image = image_ids(arch.image_token_id)  # image tokens end every n-gram
        primes = engram_hash.bucket_primes(arch.engram_vocab_size, arch.engram_n_heads, arch.engram_max_ngram_size,
                                           len(arch.engram_layer_ids))
        if [sum(p) for p in primes] != list(arch.engram_num_embeddings):
            raise ValueError(f"config field 'engram_num_embeddings' is {list(arch.engram_num_embeddings)}; "
                             f"the bucket primes give {[sum(p) for p in primes]}")
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(engram_hash.bucket_offsets(primes), dtype=torch.long),
                             persistent=False)
        mult = [engram_hash.hash_multipliers(l, n_compressed, self.max_ngram) for l in arch.engram_layer_ids]
        self.register_buffer("multipliers", torch.tensor(mult, dtype=torch.long), persistent=False)

    def hash_ids(self, table: int, history: torch.Tensor, history_valid: torch.Tensor) -> torch.Tensor:
        """Bucket rows of table `table` of the n-grams ending at each token (`ops.engram_hash`).

        history, history_valid: [N, max_ngram] raw token ids at positions pos-(max_ngram-1) .. pos, and
        False before the sequence start. Returns [N, (max_ngram-1) * n_heads]."""
        return ops.engram_hash(history, history_valid, self.token_map, self.multipliers[table], self.primes[table],
                               self.offsets[table], self.pad_id, self.image)


class Engram(nn.Module):
    """One Engram layer: table lookup, projection and gated injection into the streams."""

    def __init__(self, arch: ArchConfig, table: int, hasher: EngramHasher, history: PagedCache,
                 host: bool = False, max_tokens: int = 0, arena: NodeArena | None = None):
        super().__init__()
        self.table, self.hasher, self.history = table, [hasher], history
        self.hc, self.hidden, self.eps = arch.hc_mult, arch.hidden_size, arch.rms_norm_eps
        n_cols = (arch.engram_max_ngram_size - 1) * arch.engram_n_heads
        self.embed = EngramTable(arch, table, n_cols, host, max_tokens, arena)
        self.prefetched: EngramPrefetch | None = None  # set by EngramPrefetch for host tables
        self.wkv = Linear(n_cols * arch.engram_head_dim, (self.hc + 1) * self.hidden)
        self.q_weight = _param(self.hc, self.hidden)
        self.k_weight = _param(self.hc, self.hidden)
        self.image = image_ids(arch.image_token_id)

    def forward(self, streams: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """streams: [T, h, D] -> [T, h, D] with the gated Engram value added."""
        if not batch.has_cache:
            return streams
        if self.embed.host:
            self.prefetched.wait(self)
            emb = self.embed.staged_rows(streams.shape[0]).flatten(1)          # prefetched at step start
        else:
            emb = self.embed(self.hash_rows(batch)).flatten(1)                # [T, cols * d]
        kv = self.wkv(emb).view(-1, self.hc + 1, self.hidden)
        mute = None
        if self.image is not None:  # image tokens get no Engram value
            (lo, hi), ids = self.image, batch.token_ids
            mute = batch.memo(("image tokens", lo), lambda: (ids >= lo) & (ids < hi))
        return ops.engram_inject(streams, kv[:, : self.hc], kv[:, self.hc], self.q_weight, self.k_weight, self.eps, mute)

    def hash_rows(self, batch: StepBatch) -> torch.Tensor:
        """Table rows of every token's n-grams, [n_dec + P, cols] (one-token requests first, then the prefill tokens)."""
        return self.hasher[0].hash_ids(self.table, *batch.memo(("engram history", id(self.history)),
                                                               lambda: self.lookback(batch)))

    def lookback(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids at positions pos-(max_ngram-1) .. pos of every token (one-token requests first, then the
        prefill tokens) from the history cache, which already holds this step's tokens: ids and validity,
        [n_dec + P, max_ngram] each (the same for every Engram layer: memoised per step)."""
        pf = batch.prefill
        if not batch.n_dec:
            req, pos = pf.req, pf.pos
        elif pf is None:
            req, pos = batch.req, batch.dec_positions
        else:
            req, pos = torch.cat((batch.req, pf.req)), torch.cat((batch.dec_positions, pf.pos))
        k = self.hasher[0].max_ngram
        pos = pos.unsqueeze(1) - (k - 1) + torch.arange(k, device=pos.device)
        valid = pos >= 0
        ids = self.history.read(batch.meta(self.history), req.unsqueeze(1), pos.clamp(min=0))[..., 0]
        return torch.where(valid, ids, 0), valid


class EngramTable(nn.Module):
    """FP8 table with one E8M0 scale per 32 values per row, decoded on lookup.

    `host`: the table lives in host memory (pinned on CUDA) and rows are gathered into persistent
    staging buffers of `max_tokens` tokens x `cols` rows by `prefetch` (see the module docstring).
    `arena`: host tables carved from the node-shared mapping, which only its writer's loader fills."""

    def __init__(self, arch: ArchConfig, table: int, cols: int, host: bool = False, max_tokens: int = 0,
                 arena: NodeArena | None = None):
        super().__init__()
        self.host = host
        device = torch.get_default_device()
        table_device = torch.device("cpu") if host else device
        self.pinned = pin = host and device.type == "cuda"
        if pin and not is_uva_available():
            raise RuntimeError(f"{ops.ENGRAM_DEVICE_ENV}=host needs UVA (pinned host memory the GPU can read); "
                               f"set {ops.ENGRAM_DEVICE_ENV}=gpu to keep the Engram tables in GPU memory")
        (w_shape, w_dtype), (s_shape, s_dtype) = self.shapes(arch, table)
        if arena is not None:
            weight, scale = arena.take(w_shape, w_dtype), arena.take(s_shape, s_dtype)
        else:
            weight = torch.zeros(w_shape, dtype=w_dtype, device=table_device, pin_memory=pin)
            scale = torch.zeros(s_shape, dtype=s_dtype, device=table_device, pin_memory=pin)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.shared = None if arena is None else f"{arena.path} ({arena.ranks} ranks)"
        self.loads_checkpoint = arena is None or arena.writer  # the loader skips the tables of other writers
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._n_staged = 0
        if host:  # persistent: addresses stay fixed across CUDA graph replays
            d = arch.engram_head_dim
            self.staged_weight = torch.zeros(max_tokens, cols, d, dtype=torch.float8_e4m3fn, device=device)
            self.staged_scale = torch.zeros(max_tokens, cols, d // 32, dtype=torch.float8_e8m0fnu, device=device)

    @staticmethod
    def shapes(arch: ArchConfig, table: int) -> list[tuple[tuple[int, int], torch.dtype]]:
        """(shape, dtype) of the codes and the scales of Engram table `table`."""
        n_rows, d = arch.engram_num_embeddings[table], arch.engram_head_dim
        return [((n_rows, d), torch.float8_e4m3fn), ((n_rows, d // 32), torch.float8_e8m0fnu)]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def _device_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table as the compute device sees it: itself, or for pinned tables their UVA views
        (built once after loading; the loader writes the pinned tensors in place)."""
        if not self.pinned:
            return self.weight, self.scale
        if self._views is None:
            self._views = (get_accelerator_view_from_cpu_tensor(self.weight),
                           get_accelerator_view_from_cpu_tensor(self.scale))
        return self._views

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, C] -> [T, C, dim] fp32 (no host round trip: the loader has rejected NaN codes)."""
        return ops.fp8_rows(self.weight, self.scale, rows.flatten()).view(*rows.shape, -1)

    def prefetch(self, rows: torch.Tensor) -> None:
        """Gather the FP8 rows [T, C] into the staging buffers (host tables; runs on the prefetch stream)."""
        t = rows.shape[0]
        if t > self.staged_weight.shape[0]:
            raise RuntimeError(f"Engram staging holds {self.staged_weight.shape[0]} tokens, the step has {t}")
        weight, scale = self._device_views()
        flat = rows.flatten()
        torch.index_select(weight.view(torch.uint8), 0, flat,
                           out=self.staged_weight[:t].view(torch.uint8).view(-1, weight.shape[-1]))
        torch.index_select(scale.view(torch.uint8), 0, flat,
                           out=self.staged_scale[:t].view(torch.uint8).view(-1, scale.shape[-1]))
        self._n_staged = t

    def staged_rows(self, t: int) -> torch.Tensor:
        """The prefetched rows of this step's T tokens, decoded: [T, C, dim] fp32."""
        if t != self._n_staged:
            raise RuntimeError(f"Engram rows were prefetched for {self._n_staged} tokens, the layer has {t}")
        w, sc = self.staged_weight[:t], self.staged_scale[:t]
        return ops.fp8_rows(w.flatten(0, 1), sc.flatten(0, 1)).view(*w.shape[:-1], -1)


class EngramPrefetch:
    """Starts the row gathers of every host-table Engram layer at the start of a step (after the token
    history is written) and makes each layer wait for its own rows only.

    On CUDA the gathers run on a side stream forked from the current stream (a legal multi-stream
    capture, so decode steps stay one full CUDA graph); elsewhere they run inline."""

    def __init__(self, layers: list[Engram]):
        self.layers = [e for e in layers if e.embed.host]
        cuda = bool(self.layers) and self.layers[0].embed.staged_weight.is_cuda
        self.stream = torch.cuda.Stream() if cuda else None
        self.events = {id(e): torch.cuda.Event() for e in self.layers} if cuda else {}
        for e in self.layers:
            e.prefetched = self

    def start(self, batch: StepBatch) -> None:
        if not batch.has_cache or not self.layers:
            return
        ctx = contextlib.nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            ctx = torch.cuda.stream(self.stream)
        with ctx:
            for e in self.layers:
                e.embed.prefetch(e.hash_rows(batch))
                if self.stream is not None:
                    self.events[id(e)].record(self.stream)

    def wait(self, layer: Engram) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_event(self.events[id(layer)])


def log_engram_placement(layers: list[Engram]) -> None:
    """One line the planner can check: bytes of the Engram tables in host vs device memory (this rank)."""
    host = sum(e.embed.nbytes for e in layers if e.embed.host)
    dev = sum(e.embed.nbytes for e in layers if not e.embed.host)
    shared = layers[0].embed.shared
    where = ("one node-shared copy, " + shared + (", written by this rank" if layers[0].embed.loads_checkpoint
                                                   else ", written by the node's first rank")
             if shared else "replicated per rank")
    logger.info("vllm-deepinfer Engram tables: %d bytes (%.1f MiB) in host memory%s, %d bytes (%.1f MiB) in "
                "device memory (%d layers, %s)", host, host / 2**20,
                " (pinned)" if any(e.embed.pinned for e in layers) else "", dev, dev / 2**20, len(layers), where)


def write_token_history(history: PagedCache, batch: StepBatch) -> None:
    """Record this step's token ids in the shared token-history cache (before any Engram layer)."""
    if not batch.has_cache:
        return
    if batch.n_dec:
        ids = batch.token_ids[: batch.n_dec].view(-1, 1).expand(-1, history.width)
        history.write(batch.meta(history), batch.req, batch.dec_positions, ids, keep=batch.live)
    pf = batch.prefill
    if pf is not None:
        ids = batch.token_ids[pf.start:pf.end].view(-1, 1).expand(-1, history.width)
        history.write(batch.meta(history), pf.req, pf.pos, ids)
