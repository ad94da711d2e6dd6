"""Memory planner: per-GPU bytes of a DeepSeek-V4.1 / V4 deployment with the plugin under vLLM 0.32.

CLI::

    python -m vllm_deepinfer.tools.plan --model-config DIR_OR_PRESET [--arch v4.1-flash|v4-flash]
        [--tp N] [--dp N] [--ep] [--num-redundant-experts R] [--engram host|gpu]
        [--fp8-linears packed|bf16] [--experts packed|bf16] [--dtype bfloat16|float32] [--kv-dtype ...]
        [--kv-cache-dtype auto|bfloat16|fp8_ds_mla|fp8]
        [--speculative] [--block-size 64] [--max-model-len L] [--max-num-batched-tokens T] [--batch B]
        [--gpu-memory GiB] [--gpu-util 0.9] [--overhead-gib G] [--kv-gib K] [--json]

`--model-config` is a model directory (its ``config.json``), a config file, or a preset: ``release`` (the
40-layer V4.1-Flash / 43-layer V4-Flash release configs, by ``--arch``), or a make_checkpoint preset
(``tiny``, ``tiny-gpu``, ``full-width``) with ``--layers N``.

What it counts (every tensor comes from `checkpoint.inventory.expected_tensors`, so shapes are exact):

* Weights by kind, as the plugin stores them (the *storage rules*, explicit parameters):
  - block-FP8 linears: ``--fp8-linears marlin`` (default: CUDA's packed storage, vLLM's Marlin W8A16 layout) =
    E4M3 codes (1 B) + one E8M0 byte per 1 x 32 group (Marlin's padding of N and K to its tiles is not counted:
    the release widths are multiples of 256); ``packed`` (the packed storage elsewhere) = codes + one E8M0 byte
    per B x B block; ``bf16`` = dequantised to ``--dtype``.
  - MXFP4 routed experts: ``--experts packed`` = the checkpoint bytes (0.5 B per value + one E8M0 byte per 32);
    ``bf16`` = dequantised to ``--dtype``.
  - Engram tables: FP8 codes + one E8M0 byte per 32 values, always packed; ``--engram host`` (default; CUDA
    keeps them in host memory and gathers the looked-up rows) counts them as host bytes (one copy per node, shared
    by all its ranks in /dev/shm; ``DEEPINFER_ENGRAM_SHARED=0``: one per rank), ``gpu`` on the device.
    The CPU test checks the plugin's CPU behaviour, where the tables are ordinary module buffers.
  - BF16 tensors (norms, embedding, head, router, index keys/weights projections) in ``--dtype``; F32 tensors
    (mHC, attention sink, router bias, compressor ``ape``) in float32; V4 hash-routing tables int64.
  - The drafter (``mtp.*``: V4's MTP block, V4.1's DSpark stages with their Markov and confidence heads) with
    ``--speculative`` (``vllm serve --speculative-config``), under the same storage rules; shown apart (not
    loaded) otherwise, as is the vision tower (text-only serving skips it). DSpark calls the target's embedding
    and head; MTP's copies (``mtp.0.emb`` / ``mtp.0.head``) are dropped for the target's by vLLM's proposer
    when they are equal to them (`_maybe_share_embeddings` / `_maybe_share_lm_head`), so they are not counted
    (a checkpoint with distinct copies adds them once more). DSpark's confidence head is held in float32.
* Sharding (vLLM's rules; the plugin's tensor-parallel path follows them): TP splits attention heads (``wq_b``
  by head, ``wo_a`` by output group, ``wo_b`` by input, ``attn_sink``), the shared experts' intermediate dim, the
  vocabulary (embedding, head); ``wq_a``, ``wkv``, norms, compressor, indexer, mHC, router and Engram are
  replicated on every TP rank; the drafter's blocks follow the same rules. Routed experts: ``--ep`` spreads
  (experts + redundant, in every MoE layer, the drafter's included) over EP = TP x DP ranks;
  without ``--ep`` TP splits every expert's intermediate dim and DP replicates. DP replicates everything else.
* KV cache, the plugin's paged caches (`vllm_deepinfer/attention/caches.py`): per layer a window cache (one
  ``head_dim`` row per token, window W), per KV source a compressed cache (one row per m tokens) and, if
  gated, compressor state ([kv || score] fp32 per token, window = pooling span), per index-key owner an index-key
  cache (``index_head_dim`` per m tokens; V4 also its compressor state), the V4.1 token history (rows padded
  to the window row) and, with ``--speculative``, one window cache per drafter block (exact rows, window W).
  One page = ``--block-size`` window rows; every cache's block size = page / row x m.
  ``--kv-cache-dtype fp8_ds_mla`` (or ``fp8``): the window and compressed KV are 584-B ``fp8_ds_mla`` records,
  page // 584 of them per page (the page's tail unused); the other caches keep their rows.
  MLA-style caches hold one latent: TP replicates them, each DP rank has its own pool.
  Reported as vLLM accounts for them (`kv_cache_utils`): groups of the same spec (padded to vLLM's group size),
  blocks = KV bytes // bytes per block, blocks per request at length L = full caches cdiv(L, block) + window
  caches cdiv(min(W - 1 + in-flight tokens, L), block) + 1, which gives vLLM's "KV cache size: N tokens" and
  "Maximum concurrency" lines, and the largest context at ``--batch``.

Not counted: activations, CUDA graphs, NCCL and allocator overhead (``--overhead-gib``, default 10 GiB on a
GPU, is subtracted from the KV budget as a stated estimate: vLLM measures the real peak at start-up).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from ..checkpoint.inventory import expected_tensors
from ..config import V4, V41, ArchConfig
from ..ops.quant import KV_RECORD_BYTES

GIB = 2 ** 30
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "float32": 4, "fp32": 4}
KINDS = ("attention", "routed experts", "shared experts", "router", "indexer", "compressor", "mHC",
         "embedding + head", "norms", "Engram projections", "Engram tables", "drafter")


# ============================================================================ configs
def release_config(arch: str) -> dict:
    """The release config.json of V4.1-Flash (40 layers) or V4-Flash (43 layers), model-spec §1.2/§1.3: the
    full-width template with the release depth (layer plans of make_checkpoint), vocabulary and expert counts."""
    from .make_checkpoint import _family, build_config, load_template

    if _family(arch) == V41:
        cfg = load_template("v4.1-flash", "full-width")
        cfg["text_config"]["engram_vocab_size"] = 16000000  # table rows are derived from it (prime search)
        return build_config("v4.1-flash", "full-width", 40, config=cfg, overrides={
            "vocab_size": 129280, "n_routed_experts": 384, "num_experts_per_tok": 6,
            "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "vision_config.num_hidden_layers": 32})
    return build_config("v4-flash", "full-width", 43, overrides={"vocab_size": 129280, "n_routed_experts": 256})


def load_config(model_config: str, arch: str = "v4.1-flash", layers: int | None = None) -> dict:
    """config.json dict of a model directory, a JSON file, ``release`` or a make_checkpoint preset."""
    from .make_checkpoint import PRESETS, build_config

    p = Path(model_config)
    if p.is_dir():
        return json.loads((p / "config.json").read_text())
    if p.is_file():
        return json.loads(p.read_text())
    if model_config == "release":
        return release_config(arch)
    if model_config in PRESETS:
        return build_config(arch, model_config, layers)
    raise ValueError(f"--model-config {model_config!r}: not a directory, a file, 'release' or one of {PRESETS}")


# ============================================================================ deployment and storage
@dataclasses.dataclass(frozen=True)
class Deployment:
    """Parallel layout and storage rules (defaults: one GPU, the plugin's CUDA settings of the protocol)."""

    tp: int = 1
    dp: int = 1
    ep: bool = False
    redundant_experts: int = 0
    dtype_bytes: int = 2            # --dtype of the model (bf16)
    fp8_linears: str = "marlin"     # marlin (CUDA) | packed (elsewhere) | bf16
    experts: str = "packed"         # packed | bf16
    engram: str = "host"            # host | gpu
    kv_dtype_bytes: int = 2         # the plugin's cache rows are in the model dtype
    kv_records: bool = False        # --kv-cache-dtype fp8_ds_mla: window and compressed KV as 584-B records
    block_size: int = 64
    bounded_replay: bool = True     # vLLM's --swa-bounded-replay (default on; DEEPINFER_YOCO_* decide when set)
    prefix_caching: bool = True     # vLLM's --enable-prefix-caching (default on)
    speculative: bool = False       # --speculative-config: the drafter (MTP on V4, DSpark on V4.1) is loaded

    @property
    def ep_size(self) -> int:
        return self.tp * self.dp if self.ep else 1


def _kind(name: str) -> str:
    """Weight kind of a checkpoint tensor name (DeepSeek-native names)."""
    if name in ("embed.weight", "head.weight"):
        return "embedding + head"
    if name.startswith("hc_head") or ".hc_" in name:
        return "mHC"
    if name == "norm.weight" or name.endswith(("attn_norm.weight", "ffn_norm.weight")):
        return "norms"
    if ".engram.embed." in name:
        return "Engram tables"
    if ".engram." in name:
        return "Engram projections"
    if ".attn.indexer." in name:
        return "indexer"
    if ".attn.compressor." in name:
        return "compressor"
    if ".attn." in name:
        return "attention"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".ffn.shared_experts." in name:
        return "shared experts"
    if ".ffn.gate." in name:
        return "router"
    if name.startswith("mtp."):  # drafter projections, norms, MTP embedding / head, DSpark heads
        return "drafter"
    raise ValueError(f"no weight kind for tensor {name}")


def _tp_split(name: str) -> bool:
    """Whether tensor parallelism splits this tensor (vLLM's column/row-parallel and vocab-parallel layers)."""
    if name in ("embed.weight", "head.weight"):
        return True
    return name.split(".", 2)[-1].startswith(("attn.wq_b.", "attn.wo_a.", "attn.wo_b.", "attn.attn_sink",
                                              "ffn.shared_experts."))


def stored_bytes(name: str, dtype: str, shape: tuple[int, ...], dep: Deployment, block: int) -> int:
    """Bytes the plugin holds for checkpoint tensor `name` (before sharding); `block`: the FP8 block edge."""
    n = math.prod(shape)
    if dtype == "F8_E8M0":  # a scale: kept only with its codes (packed storage, Engram tables)
        packed = {"routed experts": dep.experts, "Engram tables": "packed"}.get(_kind(name), dep.fp8_linears)
        if packed == "marlin":  # one byte per 1 x 32 group of the block's B x B values
            return n * block * block // 32
        return n if packed == "packed" else 0
    if dtype == "I8":  # MXFP4 expert codes, two values per byte
        return n if dep.experts == "packed" else 2 * n * dep.dtype_bytes
    if dtype == "F8_E4M3":
        if _kind(name) == "Engram tables" or dep.fp8_linears != "bf16":
            return n
        return n * dep.dtype_bytes
    if name.endswith(".confidence_head.proj.weight"):  # DSpark's confidence head: fp32 math, held in fp32
        return 4 * n
    return {"BF16": dep.dtype_bytes, "F32": 4, "I64": 8}[dtype] * n


@dataclasses.dataclass
class WeightPlan:
    per_gpu: dict[str, int]      # kind -> bytes on one GPU
    host: dict[str, int]         # kind -> bytes in host memory per process
    not_loaded: dict[str, int]   # vision tower / drafter, bytes as the checkpoint stores them
    total: dict[str, int]        # kind -> bytes before sharding

    @property
    def gpu_bytes(self) -> int:
        return sum(self.per_gpu.values())


def plan_weights(arch: ArchConfig, dep: Deployment) -> WeightPlan:
    inv = expected_tensors(arch, include_vision=arch.family == V41 and arch.vision_n_layers > 0)
    per_gpu: dict[str, int] = defaultdict(int)
    host: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    not_loaded: dict[str, int] = defaultdict(int)
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
    for name, (dt, shape) in inv.items():
        if name.startswith(("vision.", "aligner.", "image_")):
            not_loaded["vision tower (skipped: text-only)"] += size[dt] * math.prod(shape)
            continue
        drafter = name.startswith("mtp.")
        if drafter and dep.speculative and name.split(".", 2)[-1] in ("emb.tok_emb.weight", "head.weight"):
            continue  # the target's, shared by vLLM's proposer (module docstring)
        if drafter and not dep.speculative:
            not_loaded["drafter mtp.* (loaded with --speculative-config)"] += size[dt] * math.prod(shape)
            continue
        b = stored_bytes(name, dt, shape, dep, arch.weight_block_size)
        kind = "drafter" if drafter else _kind(name)  # the drafter is one row of the report
        total[kind] += b
        if kind == "Engram tables" and dep.engram == "host":
            host[kind] += b
        elif ".ffn.experts." in name:  # the drafter's MoE layers get redundant experts too (moe/layer.py)
            E = arch.moe_experts(arch.num_layers + int(name.split(".")[1]) if drafter else 0)[0]
            per_gpu[kind] += b * (E + dep.redundant_experts) // E // (dep.ep_size if dep.ep else dep.tp)
        else:
            per_gpu[kind] += b // dep.tp if _tp_split(name) else b
    return WeightPlan(dict(per_gpu), dict(host), dict(not_loaded), dict(total))


# ============================================================================ KV cache
@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One paged cache layer: `row_bytes` per row, one row per `tokens_per_row` tokens; `window` in tokens
    (a sliding-window cache) or None (rows kept for the whole request)."""

    name: str
    row_bytes: int
    tokens_per_row: int = 1
    window: int | None = None
    replay: bool = False            # window KV past the bounded-replay cut (its own vLLM spec, own groups)
    record: bool = False            # fp8_ds_mla records: page // row_bytes of them, the page's tail unused

    def block_size(self, page: int) -> int:
        return page // self.row_bytes * self.tokens_per_row

    def key(self, page: int) -> tuple:
        return (self.row_bytes, self.tokens_per_row, self.window, self.block_size(page), self.replay, self.record)


def cache_specs(arch: ArchConfig, dep: Deployment) -> list[CacheSpec]:
    """Every cache layer the plugin's model registers, in model order (model-spec §6.1, attention/caches.py).

    Bounded replay (V4.1, `models/replay.py`, resolved as the model resolves it): the window KV past the cut is
    its own spec; with prefix caching every other sliding-window cache retains `keep` more tokens."""
    from ..models.replay import resolve

    policy = resolve(arch, dep.bounded_replay)
    cut = policy.cut if policy is not None else arch.num_layers
    extra = policy.keep if policy is not None and dep.prefix_caching else 0
    d, kvb = arch.head_dim, dep.kv_dtype_bytes
    kv_row = dict(row_bytes=KV_RECORD_BYTES, record=True) if dep.kv_records else dict(row_bytes=d * kvb)
    out = []
    if arch.family == V41 and arch.engram_layer_ids:
        out.append(CacheSpec("engram.history", d * kvb, window=arch.engram_max_ngram_size + extra))
    for l in range(arch.num_layers):
        p = arch.layer_plan(l)
        past = l > cut
        out.append(CacheSpec(f"layers.{l}.window", window=arch.window + (0 if past else extra), replay=past, **kv_row))
        if p.owns_compressor:
            c = 2 if p.compressor_overlap else 1
            if p.compressor_gated:
                out.append(CacheSpec(f"layers.{l}.compressor.state", 2 * c * d * 4, window=c * p.ratio + extra))
            out.append(CacheSpec(f"layers.{l}.compressed", tokens_per_row=p.ratio, **kv_row))
        if p.owns_index_keys:
            if arch.family == V4:
                out.append(CacheSpec(f"layers.{l}.indexer.compressor.state", 2 * 2 * arch.index_head_dim * 4,
                                     window=2 * p.ratio + extra))
            out.append(CacheSpec(f"layers.{l}.index_keys", arch.index_head_dim * kvb, p.ratio))
    if dep.speculative:  # MTP block / DSpark stages: window KV only, exact rows, no retained replay tokens
        out += [CacheSpec(f"drafter.{i}.window", d * kvb, window=arch.window) for i in range(arch.num_draft_layers)]
    return out


@dataclasses.dataclass
class KVPlan:
    page: int                       # bytes of one page (every cache layer)
    groups: list[tuple[CacheSpec, int]]  # (spec, layers in the group incl. padding) per vLLM group
    bytes_per_block: int            # one block id across all layers of a group
    growth_per_token: float         # bytes per context token, full caches (without page rounding)
    fixed_per_request: int          # bytes of the window caches of one request in steady decode

    def blocks_per_request(self, length: int, in_flight: int) -> int:
        """vLLM's per-request block need at `length` tokens (get_max_concurrency_for_kv_cache_config)."""
        n = 0
        for spec, _ in self.groups:
            bs = spec.block_size(self.page)
            if spec.window is None:
                n += -(-length // bs)
            else:
                n += -(-min(spec.window - 1 + in_flight, length) // bs) + 1
        return n

    def capacity(self, kv_bytes: int, max_model_len: int, in_flight: int) -> tuple[int, int, float]:
        """(num_blocks, vLLM's 'KV cache size: N tokens', max concurrency) for `kv_bytes` of KV memory."""
        blocks = kv_bytes // self.bytes_per_block
        conc = blocks / self.blocks_per_request(max_model_len, in_flight)
        return blocks, int(conc * max_model_len), conc

    def largest_context(self, kv_bytes: int, batch: int, in_flight: int, limit: int = 1 << 24) -> int:
        """Largest L such that `batch` requests of L tokens fit the pool (vLLM's accounting)."""
        blocks = kv_bytes // self.bytes_per_block
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if batch * self.blocks_per_request(mid, in_flight) <= blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def plan_kv(arch: ArchConfig, dep: Deployment) -> KVPlan:
    page = dep.block_size * arch.head_dim * dep.kv_dtype_bytes
    specs = cache_specs(arch, dep)
    buckets: dict[tuple, list[CacheSpec]] = defaultdict(list)
    for s in specs:
        if page % s.row_bytes and not s.record:
            raise ValueError(f"{s.name}: page of {page} B does not hold whole {s.row_bytes}-B rows")
        buckets[s.key(page)].append(s)
    counts = [len(v) for v in buckets.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)  # vLLM's group size rule
    groups = []
    for members in buckets.values():
        for i in range(-(-len(members) // size)):
            groups.append((members[0], size))
    growth = sum(s.row_bytes / s.tokens_per_row for s in specs if s.window is None)
    fixed = sum((-(-s.window // s.block_size(page)) + 1) * page for s in specs if s.window is not None)
    return KVPlan(page, groups, size * page, growth, fixed)


# ============================================================================ report
def _gib(b: float) -> str:
    return f"{b / GIB:9.2f} GiB"


def report(arch: ArchConfig, dep: Deployment, a) -> dict:
    w = plan_weights(arch, dep)
    kv = plan_kv(arch, dep)
    gpu = a.gpu_memory * GIB if a.gpu_memory else 0
    in_flight = a.max_num_batched_tokens * (2 if a.async_scheduling else 1)
    if a.kv_gib is not None:
        kv_bytes = int(a.kv_gib * GIB)
    else:
        kv_bytes = max(0, int(gpu * a.gpu_util - w.gpu_bytes - a.overhead_gib * GIB))
    blocks, tokens, conc = kv.capacity(kv_bytes, a.max_model_len, in_flight)
    largest = kv.largest_context(kv_bytes, a.batch, in_flight)
    largest_decode = kv.largest_context(kv_bytes, a.batch, 1)
    lines = [f"model: {arch.family} {arch.num_layers} layers, hidden {arch.hidden_size}, "
             f"{arch.n_routed_experts} experts top-{arch.num_experts_per_tok}, vocab {arch.vocab_size}",
             f"layout: TP {dep.tp} x DP {dep.dp}, EP {'on (' + str(dep.ep_size) + ' ranks)' if dep.ep else 'off'}, "
             f"redundant experts {dep.redundant_experts}; storage: FP8 linears {dep.fp8_linears}, experts "
             f"{dep.experts}, Engram tables on {dep.engram}, dtype {dep.dtype_bytes} B, KV rows {dep.kv_dtype_bytes} B"
             + (f", window/compressed KV as {KV_RECORD_BYTES}-B fp8_ds_mla records" if dep.kv_records else ""),
             "", "weights per GPU (before sharding in brackets):"]
    for k in KINDS:
        if k in w.per_gpu or k in w.host:
            lines.append(f"  {k:20s} {_gib(w.per_gpu.get(k, 0))}   [{_gib(w.total.get(k, 0)).strip()}]")
    lines.append(f"  {'total on GPU':20s} {_gib(w.gpu_bytes)}")
    for k, b in w.host.items():
        lines.append(f"  {'host: ' + k:20s} {_gib(b)}   (one copy per node, in /dev/shm when several ranks share it;"
                     " DEEPINFER_ENGRAM_SHARED=0: per rank)")
    for k, b in w.not_loaded.items():
        lines.append(f"  not loaded: {k}: {_gib(b).strip()} as stored")
    lines += ["", f"KV cache (page {kv.page} B = {dep.block_size} window rows; {len(kv.groups)} vLLM groups of "
                  f"{kv.groups[0][1]} layer(s)):",
              f"  growth per context token   {kv.growth_per_token:,.1f} B  (compressed KV + index keys)",
              f"  window caches per request  {kv.fixed_per_request / 2**20:,.2f} MiB in steady decode",
              f"  KV budget per GPU          {_gib(kv_bytes).strip()}"
              + ("" if a.kv_gib is not None else f" = {a.gpu_util} x {a.gpu_memory} GiB - weights - "
                                                 f"{a.overhead_gib} GiB overhead (estimate)"),
              f"  vLLM: {blocks:,} blocks; KV cache size: {tokens:,} tokens, Maximum concurrency for "
              f"{a.max_model_len:,} tokens per request: {conc:.2f}x (in-flight {in_flight} tokens)",
              f"  largest context at batch {a.batch} per DP rank: {largest:,} tokens (vLLM's admission reserve: "
              f"window caches hold W - 1 + in-flight tokens); {largest_decode:,} in steady decode"]
    print("\n".join(lines))
    return {"weights_per_gpu": w.per_gpu, "weights_total": w.total, "host": w.host, "not_loaded": w.not_loaded,
            "weights_gpu_bytes": w.gpu_bytes, "kv_page_bytes": kv.page, "kv_groups": len(kv.groups),
            "kv_growth_bytes_per_token": kv.growth_per_token, "kv_fixed_bytes_per_request": kv.fixed_per_request,
            "kv_bytes": kv_bytes, "num_blocks": blocks, "kv_cache_tokens": tokens, "max_concurrency": conc,
            "largest_context": largest, "largest_context_decode": largest_decode, "batch": a.batch}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", default="release", help="model dir, config file, 'release' or a preset")
    p.add_argument("--arch", default="v4.1-flash", help="for presets: v4.1-flash | v4-flash")
    p.add_argument("--layers", type=int, default=None, help="for make_checkpoint presets")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", action="store_true", help="expert parallel over TP x DP ranks")
    p.add_argument("--num-redundant-experts", type=int, default=0, help="EPLB redundant experts (all ranks)")
    p.add_argument("--engram", choices=["host", "gpu"], default="host")
    p.add_argument("--fp8-linears", choices=["marlin", "packed", "bf16"], default="marlin")
    p.add_argument("--experts", choices=["packed", "bf16"], default="packed")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--kv-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="cache row dtype (default: --dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_ds_mla", "fp8"],
                   help="vLLM's flag: fp8_ds_mla / fp8 = window and compressed KV as fp8_ds_mla records")
    p.add_argument("--speculative", action="store_true",
                   help="--speculative-config given: count the drafter (MTP on V4, DSpark on V4.1) and its caches")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--no-bounded-replay", action="store_true", help="vLLM's --no-swa-bounded-replay")
    p.add_argument("--no-prefix-caching", action="store_true", help="vLLM's --no-enable-prefix-caching")
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--async-scheduling", action="store_true",
                   help="two batches in flight (vLLM's default on CUDA): window caches reserve twice the budget")
    p.add_argument("--batch", type=int, default=64, help="concurrent requests for the largest context")
    p.add_argument("--gpu-memory", type=float, default=141.0, help="GiB per GPU (H200 141, B200 ~180)")
    p.add_argument("--gpu-util", type=float, default=0.9)
    p.add_argument("--overhead-gib", type=float, default=10.0, help="activations + CUDA graphs (estimate)")
    p.add_argument("--kv-gib", type=float, default=None, help="fixed KV budget (kv_cache_memory_bytes)")
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    a = p.parse_args(argv)
    cfg = load_config(a.model_config, a.arch, a.layers)
    arch = ArchConfig.from_hf(cfg)
    dep = Deployment(tp=a.tp, dp=a.dp, ep=a.ep, redundant_experts=a.num_redundant_experts,
                     dtype_bytes=DTYPE_BYTES[a.dtype], fp8_linears=a.fp8_linears, experts=a.experts,
                     engram=a.engram, kv_dtype_bytes=DTYPE_BYTES[a.kv_dtype or a.dtype],
                     kv_records=a.kv_cache_dtype in ("fp8_ds_mla", "fp8"), block_size=a.block_size,
                     bounded_replay=not a.no_bounded_replay, prefix_caching=not a.no_prefix_caching,
                     speculative=a.speculative)
    if arch.n_routed_experts % (dep.ep_size if dep.ep else 1) and not dep.redundant_experts:
        print(f"warning: {arch.n_routed_experts} experts do not divide over {dep.ep_size} EP ranks", file=sys.stderr)
    out = report(arch, dep, a)
    if a.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
