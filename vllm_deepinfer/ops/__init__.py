"""The kernel interface of the model.

The model calls every op through this module. Backends: `reference` (torch; CPU and any device;
the oracle), `kernels_nvidia` and `kernels_ascend`. An op a device backend does not provide falls
back to the reference implementation, so a backend can grow one kernel at a time.

Dispatch: an op whose first tensor is on a CUDA device runs the `kernels_nvidia` kernel when that
package is available (CUDA + Triton), one on an Ascend NPU (`npu`) the `kernels_ascend` kernel
(torch_npu + triton-ascend); anything else, and any shape a kernel declines (NotImplementedError),
runs the reference (on the NPU: torch_npu's library ops). `VLLM_DEEPINFER_KERNELS=reference` forces the reference
everywhere (read at import).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from vllm_deepinfer.ops import deepgemm, flashmla, reference
from vllm_deepinfer.ops.reference import (  # noqa: F401  (reference-only ops)
    elementwise,
    grouped_low_rank,
    hc_head_weights,
    linear,
)

KERNELS = os.environ.get("VLLM_DEEPINFER_KERNELS", "auto").lower()
_BACKENDS: dict[str, object] = {}  # package name -> its ops module, or False once known unavailable


def _backend(x: torch.Tensor, device_type: str, package: str):
    """`package`.ops (kernels_nvidia / kernels_ascend) for tensors on `device_type` when usable, else None."""
    if x.device.type != device_type or KERNELS == "reference":
        return None
    if package not in _BACKENDS:
        try:
            mod = importlib.import_module(package)
            _BACKENDS[package] = mod.load_ops() if mod.available() else False
        except ImportError:
            _BACKENDS[package] = False
    return _BACKENDS[package] or None


def _nvidia(x: torch.Tensor):
    return _backend(x, "cuda", "kernels_nvidia")


def _ascend(x: torch.Tensor):
    return _backend(x, "npu", "kernels_ascend")


def _device_ops(x: torch.Tensor):
    return _nvidia(x) or _ascend(x)


def backend_for(x: torch.Tensor) -> str:
    """Which backend an op on `x` runs on: 'kernels_nvidia', 'kernels_ascend' or 'reference'."""
    if _nvidia(x) is not None:
        return "kernels_nvidia"
    return "kernels_ascend" if _ascend(x) is not None else "reference"


def _dispatch(name: str, x: torch.Tensor, *args, fallback=None, **kwargs):
    """The device kernel `name` for `x`'s device, else `fallback` (default: the reference op)."""
    dev = _device_ops(x)
    if dev is not None:
        fn = getattr(dev, name, None)
        if fn is not None:
            try:
                return fn(*args, **kwargs)
            except NotImplementedError:
                pass
    return (fallback or getattr(reference, name))(*args, **kwargs)


def swiglu(a, b, limit):
    return _dispatch("swiglu", a, a, b, limit)


def sqrtsoftplus_route(logits, bias, topk, scale, forced=None, vl=None, ids_dtype=torch.int64):
    return _dispatch("sqrtsoftplus_route", logits, logits, bias, topk, scale, forced, vl, ids_dtype)


def fp8_rows(weight, scale, rows=None):
    return _dispatch("fp8_rows", weight, weight, scale, rows)


def engram_hash(history, valid, token_map, multipliers, primes, offsets, pad_id, image=None):
    return _dispatch("engram_hash", history, history, valid, token_map, multipliers, primes, offsets, pad_id, image)


def engram_inject(streams, keys, value, q_weight, k_weight, eps, mute=None):
    return _dispatch("engram_inject", streams, streams, keys, value, q_weight, k_weight, eps, mute)


def swiglu_clamped(x, w1, w3, w2, limit, act=None):
    """`reference.swiglu_clamped` with the activation on the device kernel (`swiglu`)."""
    return reference.swiglu_clamped(x, w1, w3, w2, limit, act, activation=swiglu)


def rms_norm(x, weight, eps):
    return _dispatch("rms_norm", x, x, weight, eps)


def apply_rope(x, cos, sin, inverse=False):
    return _dispatch("apply_rope", x, x, cos, sin, inverse)


def rope_cos_sin(positions, inv_freq, scale=1):
    return _dispatch("rope_cos_sin", positions, positions, inv_freq, scale)


def apply_rope_(x, cos, sin, inverse=False):
    return _dispatch("apply_rope_", x, x, cos, sin, inverse)


def sparse_attention(q, keys, allowed, sink, scale):
    return _dispatch("sparse_attention", q, q, keys, allowed, sink, scale)


def sparse_attention_indexed(q, kv, idx, sink, scale):
    # FlashMLA's sparse prefill kernel from vLLM's CUDA wheel where it takes the shapes (`ops.flashmla`)
    if KERNELS != "reference" and not reference.BATCH_INVARIANT and flashmla.takes(q, kv):
        out = flashmla.sparse_attention_indexed(q, kv, idx, sink, scale)
        if out is not None:
            return out
    return _dispatch("sparse_attention_indexed", q, q, kv, idx, sink, scale)


def sparse_attention_gathered(q, keys, valid, sink, scale):
    return _dispatch("sparse_attention_gathered", q, q, keys, valid, sink, scale)


def indexer_scores_gathered(q, weights, keys):
    return _dispatch("indexer_scores_gathered", q, q, weights, keys)


def sparse_attention_paged(q, kv_a, idx_a, kv_b, idx_b, sink, scale):
    # without a paged kernel: gather the rows, then the device's (or the reference) gathered attention
    return _dispatch("sparse_attention_paged", q, q, kv_a, idx_a, kv_b, idx_b, sink, scale,
                     fallback=functools.partial(reference.sparse_attention_paged, attend=sparse_attention_gathered))


def kv_record_store(pages, slots, rows, rows_per_block):
    return _dispatch("kv_record_store", pages, pages, slots, rows, rows_per_block)


def kv_record_gather(pages, slots, rows_per_block, dtype):
    return _dispatch("kv_record_gather", pages, pages, slots, rows_per_block, dtype)


def sparse_attention_records(q, pages_a, idx_a, pages_b, idx_b, rows_per_block, sink, scale):
    # without a record kernel: dequantise the gathered records, then the device's (or the reference) gathered attention
    return _dispatch("sparse_attention_records", q, q, pages_a, idx_a, pages_b, idx_b, rows_per_block, sink, scale,
                     fallback=functools.partial(reference.sparse_attention_records, attend=sparse_attention_gathered))


def indexer_scores_paged(q, weights, keys, block_table, n_valid, n_rows, rows_per_block):
    # without a paged kernel: gather the keys, then the device's (or the reference) gathered scores
    return _dispatch("indexer_scores_paged", q, q, weights, keys, block_table, n_valid, n_rows, rows_per_block,
                     fallback=functools.partial(reference.indexer_scores_paged, score=indexer_scores_gathered))


def row_slots(block_table, req, row_ids, tokens_per_row, block_size, rows_per_block, masked=False, keep=None):
    return _dispatch("row_slots", block_table, block_table, req, row_ids, tokens_per_row, block_size, rows_per_block,
                     masked, keep)


def range_slots(block_table, req, start, count, stop, tokens_per_row, block_size, rows_per_block):
    return _dispatch("range_slots", block_table, block_table, req, start, count, stop, tokens_per_row, block_size,
                     rows_per_block)


def softmax_pool(values, logits):
    return _dispatch("softmax_pool", values, values, logits)


def indexer_scores(q, weights, keys):
    return _dispatch("indexer_scores", q, q, weights, keys)


def indexer_scores_ragged(q, weights, keys, key_start, n_keys, n_cols):
    return _dispatch("indexer_scores_ragged", q, q, weights, keys, key_start, n_keys, n_cols)


def topk_rows(scores, k, n_valid=None):
    return _dispatch("topk_rows", scores, scores, k, n_valid)


def linear_fp32_out(x, w):
    return _dispatch("linear_fp32_out", x, x, w)


def linear_fp8_block(x, w, scale, block, groups=1):
    return _dispatch("linear_fp8_block", x, x, w, scale, block, groups)


def hc_coefficients(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters):
    # DeepGEMM's tf32 prenorm GEMM from vLLM's CUDA build where switched on (`ops.deepgemm`)
    if KERNELS != "reference" and not reference.BATCH_INVARIANT and deepgemm.takes(streams):
        out = deepgemm.hc_coefficients(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)
        if out is not None:
            return out
    return _dispatch("hc_coefficients", streams, streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)


def hc_collapse(streams, weights):
    return _dispatch("hc_collapse", streams, streams, weights)


def hc_expand(streams, y, post, comb):
    return _dispatch("hc_expand", streams, streams, y, post, comb)


def routed_experts(x, ids, weights, w13, w2, limit):
    return _dispatch("routed_experts", x, x, ids, weights, w13, w2, limit)


def routed_experts_packed(x, ids, weights, w13, w13_scale, w2, w2_scale, limit, fmt="mxfp4"):
    return _dispatch("routed_experts_packed", x, x, ids, weights, w13, w13_scale, w2, w2_scale, limit, fmt)


INVARIANT_ENV = "DEEPINFER_BATCH_INVARIANT"
INVARIANT_OPTION = "deepinfer_batch_invariant"  # --additional-config '{"deepinfer_batch_invariant": true}'


def invariant_requested(vllm_config=None) -> bool:
    """Whether batch-invariant mode is asked for: `DEEPINFER_BATCH_INVARIANT` on, or the vLLM option
    `--additional-config '{"deepinfer_batch_invariant": true}'` (`vllm_config.additional_config`)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if INVARIANT_OPTION in extra:
        return bool(extra[INVARIANT_OPTION])
    return os.environ.get(INVARIANT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off", "none")


def configure_invariant(vllm_config=None) -> bool:
    """Set batch-invariant mode for the ops of this process (read once, at model construction).

    On CUDA it also selects the fixed-tile variants of `kernels_nvidia` (the module flags that
    `KERNELS_NVIDIA_BATCH_INVARIANT=1` sets): the FP8 block GEMM keeps its direct kernel for every M
    (no dequant + cuBLAS above `DIRECT_MAX_M`), the fp32-output GEMM (router, compressor) runs a fixed-tile
    kernel instead of cuBLAS, sparse attention always takes the gather form and
    never splits a token's key reduction, the mHC coefficients keep their decode tiles for every T.
    """
    on = invariant_requested(vllm_config)
    reference.BATCH_INVARIANT = on
    if torch.cuda.is_available() and KERNELS != "reference":
        try:
            from kernels_nvidia import attention, gemm, mhc
        except ImportError:  # no Triton: the reference ops run (their invariant variants)
            return on
        fixed = on or os.environ.get("KERNELS_NVIDIA_BATCH_INVARIANT") == "1"
        gemm.BATCH_INVARIANT = attention.BATCH_INVARIANT = mhc.BATCH_INVARIANT = fixed
    return on


def batch_invariant() -> bool:
    """Whether ops run their batch-invariant variants (see `configure_invariant`)."""
    return reference.BATCH_INVARIANT


FP8_LINEARS_ENV = "DEEPINFER_FP8_LINEARS"
EXPERT_STORAGE_ENV = "DEEPINFER_EXPERT_STORAGE"
ENGRAM_DEVICE_ENV = "DEEPINFER_ENGRAM_DEVICE"
ENGRAM_SHARED_ENV = "DEEPINFER_ENGRAM_SHARED"
_AUTO = ("", "auto", "0", "off", "false", "no", "none")  # values that mean `auto` for the settings below


def parse_storage(env: str, value: str | None) -> str:
    """A weight-storage setting (`DEEPINFER_FP8_LINEARS`, `DEEPINFER_EXPERT_STORAGE`) -> 'auto', 'packed' or 'bf16'.

    `packed` keeps the checkpoint codes (E4M3 + E8M0 linears, MXFP4 experts); `bf16` dequantises at load
    (to the model dtype); `auto` (default; also unset or an off value) is resolved per setting: FP8 linears
    `packed` on CUDA (`packed_storage`: vLLM's Marlin W8A16 GEMM, `ops.marlin`, the kernel vLLM's in-tree
    V4.1 runs on SM90) and `bf16` elsewhere; routed experts `packed` on CUDA through vLLM's MXFP4 fused-MoE
    method (`moe.method.expert_storage`).
    """
    v = (value or "").strip().lower()
    if v in _AUTO:
        return "auto"
    if v not in ("packed", "bf16"):
        raise ValueError(f"{env}={value!r}: expected auto, packed or bf16")
    return v


def parse_engram_device(value: str | None, device_type: str, cpu_offload: bool = True) -> str:
    """`DEEPINFER_ENGRAM_DEVICE` -> 'host' or 'gpu'. `auto` (default; also unset or an off value): host
    memory on CUDA unless vLLM's `--engram-config` says `cpu_offload: false`, device memory elsewhere (off
    CUDA both are the same memory)."""
    v = (value or "").strip().lower()
    if v in _AUTO:
        return "host" if device_type == "cuda" and cpu_offload else "gpu"
    if v in ("host", "cpu"):
        return "host"
    if v in ("gpu", "device"):
        return "gpu"
    raise ValueError(f"{ENGRAM_DEVICE_ENV}={value!r} is unknown; accepted: host, gpu, auto")


def parse_engram_shared(value: str | None) -> bool:
    """`DEEPINFER_ENGRAM_SHARED` -> whether host tables may be one node-shared copy (`auto`, the default, and
    `1`: yes, where more than one rank runs on a node; `0`: a private copy per rank)."""
    v = (value or "").strip().lower()
    if v in ("", "auto", "1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{ENGRAM_SHARED_ENV}={value!r} is unknown; accepted: auto, 1, 0")


def packed_storage(env: str, device_type: str) -> bool:
    """Whether the FP8 block linears on `device_type` keep their packed checkpoint codes (`auto`: packed on
    CUDA, bf16 elsewhere; read at model build)."""
    storage = parse_storage(env, os.environ.get(env))
    return storage == "packed" or (storage == "auto" and device_type == "cuda")


for _f in (rms_norm, rope_cos_sin, apply_rope, apply_rope_, sparse_attention, sparse_attention_indexed,
           sparse_attention_gathered,
           sparse_attention_paged, kv_record_store, kv_record_gather, sparse_attention_records, row_slots, range_slots,
           softmax_pool, indexer_scores, indexer_scores_gathered, indexer_scores_paged,
           indexer_scores_ragged, topk_rows, linear_fp32_out, linear_fp8_block,
           hc_coefficients, hc_collapse, hc_expand, routed_experts, routed_experts_packed, sqrtsoftplus_route,
           fp8_rows, engram_hash, engram_inject):
    _f.__doc__ = getattr(reference, _f.__name__).__doc__
del _f
