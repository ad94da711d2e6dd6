"""Quantise-dequantise simulations of vLLM 0.32's in-tree NVIDIA SM90 (Hopper) numerics.

"Parity" numerics mode (``DEEPINFER_NUMERICS``, read once at model construction, default ``exact``):
the torch model keeps weights dequantised and activations / KV in the model dtype; in parity mode it
additionally rounds the tensors that vLLM's in-tree DeepSeek V4 / V4.1 path stores or multiplies in
FP8 through exactly the same quantiser (scale recipe, rounding, clamping), then dequantises. Every
function here returns a tensor of the input's shape and dtype whose values are representable in the
simulated format; none of them changes anything when parity mode is off (callers check
``enabled(component)``).

Common recipe (all scales are powers of two, so ``x / s`` and ``x * (1/s)`` are bit-identical):

    x  = bf16(x)                                  (vLLM rounds its fp32 results to bf16 before quantising)
    a  = max(max|x_block|, floor)
    s  = 2 ** ceil(log2(a / 448))                 (UE8M0 / power-of-two fp32 scale)
    q  = e4m3fn(clamp(x / s, -448, 448))          (round to nearest even)
    x' = q * s

Sources (paths relative to ``site-packages/vllm/``, v0.32.0):

* KV record ``fp8_ds_mla`` (window and compressed KV, V4 and V4.1 on SM90): 448 NoPE dims FP8 with one
  UE8M0 scale per 64 dims, floor 1e-4; 64 RoPE dims BF16 (584 B/token).
  ``models/deepseek_v4/common/ops/fused_compress_quant_cache.py:274-297`` (compressed rows; the window rows
  go through the compiled ``_C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``, same record);
  ``models/deepseek_v41/attention.py:122-129`` (the 528-B all-FP8 V4.1 record is SM100 only).
* Index keys (FP8 indexer cache, the default: ``v1/attention/backends/mla/indexer.py:59``): one
  power-of-two fp32 scale per 128-dim row, floor 1e-4.
  ``models/deepseek_v4/common/ops/fused_compress_quant_cache.py:864-881`` (V4),
  ``models/deepseek_v41/common/ops/indexer_k_store.py:240-250`` (V4.1).
* Index queries: FP8 with one power-of-two scale per (token, head) over the 128 dims, floor 1e-4; the
  scale is folded into the head weights, which is the same as dequantising q because ReLU commutes
  with a positive scale. ``models/deepseek_v4/common/ops/fused_indexer_q.py:153-203``.
* Linear activations, V4 only (``FlashInferFp8DeepGEMMDynamicBlockScaledKernel``, DeepGEMM W8A8 with
  UE8M0): per token and 128 consecutive input elements, floor (eps) 1e-10.
  ``model_executor/layers/quantization/utils/fp8_utils.py:131-134``; the grouped ``wo_a`` input is
  quantised the same way per 128 dims after the inverse RoPE
  (``models/deepseek_v4/nvidia/ops/o_proj.py:61-95``, ``common/ops/fused_inv_rope_fp8_quant.py:150-153``).
  V4.1 on SM90 does NOT quantise activations: its MXFP8 linears run ``MarlinMxfp8LinearKernel``
  (weight-only) and ``wo_a`` runs ``EmulationMxfp8LinearKernel`` with the weight dequantised to BF16 at
  load (``model_executor/kernels/linear/mxfp8/emulation.py``, ``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD``
  defaults to true, so ``deep_gemm_fp8_o_proj`` takes its BF16 ``bmm`` branch).
* mHC (both families): the ``x . fn^T`` GEMM of the coefficient pre-norm runs in TF32 on DeepGEMM
  (``tf32_hc_prenorm_gemm``, ``model_executor/kernels/mhc/tilelang.py:35-57, 124-173, 339-423``). The
  streams are BF16, hence exact in TF32; only the fp32 ``fn`` loses its low 13 mantissa bits. Simulated
  by truncation (what an MMA does with fp32 bits it reads as TF32); the kernel source (DeepGEMM, compiled)
  was not read, so round-to-nearest is possible too.
* Not simulated (see the parity report): FlashMLA's BF16 rounding of softmax probabilities before P.V; the
  DeepGEMM FP8 MMA's limited-precision accumulation inside each 128-K block; V4 decode-sized batches
  (< 32 tokens), where the FP8 linears switch to FlashInfer's swapAB GEMM (BF16 input, quantised inside the
  compiled kernel, recipe not visible) and mHC to the fused post+pre kernel that takes its coefficients
  from the fp32 residual before BF16 rounding, in plain fp32 FMA
  (``model_executor/kernels/linear/scaled_mm/flashinfer.py:301``,
  ``model_executor/kernels/mhc/tilelang_kernels.py:64, 668-760``).
* Routed experts (both families): ``MARLIN`` MXFP4 backend = W4A16, activations stay BF16
  (``VLLM_MARLIN_INPUT_DTYPE`` unset, ``quantization/utils/marlin_utils.py:720``): nothing to simulate.

Limit of ``act`` (V4 W8A8), measured on the tiny V4 checkpoint (CPU, prompts of 37/300 tokens): the FP8
activation quantiser makes the model's output chaotic in its input. A BF16-ulp-level perturbation upstream
(switching the TF32 truncation of the mHC ``fn`` on or off) moves prompt logprobs by a mean |delta| of
0.018 / 0.010 nats in exact mode and by 0.090 / 0.064 nats with ``act`` on (0.011 / 0.017 with ``kv`` only):
rounding decisions of the E4M3 grid flip and the flips grow through the layers. The same simulation on the
H200 and on the CPU differs by 0.063 / 0.052. So ``act`` reproduces the *size* of vLLM's W8A8 noise, never
its realisation, and V4 agreement with the in-tree model stays at that level (0.06-0.08 nats) unless every
tensor entering a quantiser is bit-identical to vLLM's. V4.1 has no activation quantisation on SM90, which is
why ``kv`` alone brings it to the BF16 spread.
"""

from __future__ import annotations

import os

import torch

from vllm_deepinfer.checkpoint.formats import FP8_DTYPE, FP8_MAX, ceil_log2, e8m0_decode

ENV = "DEEPINFER_NUMERICS"

#: Components of parity mode. ``act`` applies to V4 only (see module docstring).
COMPONENTS = ("kv", "index_k", "index_q", "act", "tf32")

_mode: frozenset[str] | None = None


def parse_mode(value: str | None) -> frozenset[str]:
    """``exact`` (default, also empty/off) -> {}; ``parity`` -> all components; or a comma-separated
    subset of ``COMPONENTS`` (per-component measurements), e.g. ``kv,index_k``."""
    v = (value or "").strip().lower()
    if v in ("", "exact", "0", "off", "false", "no", "none"):
        return frozenset()
    if v in ("parity", "1", "on", "all"):
        return frozenset(COMPONENTS)
    parts = frozenset(p.strip() for p in v.replace("+", ",").split(",") if p.strip())
    bad = parts - set(COMPONENTS)
    if bad:
        raise ValueError(f"{ENV}={value!r}: unknown component(s) {sorted(bad)}; "
                         f"use exact, parity or a subset of {list(COMPONENTS)}")
    return parts


def configure(value: str | None = None) -> frozenset[str]:
    """Read the mode once (model construction); ``value`` overrides the environment."""
    global _mode
    _mode = parse_mode(os.environ.get(ENV) if value is None else value)
    return _mode


def mode() -> frozenset[str]:
    return configure() if _mode is None else _mode


def enabled(component: str) -> bool:
    return component in mode()


# ----------------------------------------------------------------------------- element formats
def pow2_exponent(amax: torch.Tensor, floor: float, qmax: float = FP8_MAX) -> torch.Tensor:
    """ceil(log2(max(amax, floor) / qmax)) as int32, computed exactly (frexp, no log2 rounding)."""
    return ceil_log2(torch.clamp(amax.float(), min=floor) / qmax)


def pow2_scale(amax: torch.Tensor, floor: float, qmax: float = FP8_MAX) -> torch.Tensor:
    """2 ** `pow2_exponent` in fp32."""
    e = pow2_exponent(amax, floor, qmax)
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e)


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 codes of x (saturating at ±448, nearest-even)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to FP8 E4M3 (saturating at ±448, nearest-even), returned as fp32."""
    return e4m3_codes(x).float()


def fp8_block_roundtrip(x: torch.Tensor, block: int, floor: float, bf16_first: bool = True) -> torch.Tensor:
    """FP8 E4M3 with one power-of-two scale per `block` consecutive elements of the last dim.

    x: [..., n] with n % block == 0 -> same shape and dtype. `bf16_first`: round x to BF16 before the
    amax and the division (what every vLLM quantiser above sees).
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quantisation block {block}")
    xf = x.to(torch.bfloat16).float() if bf16_first else x.float()
    g = xf.unflatten(-1, (n // block, block))
    s = pow2_scale(g.abs().amax(-1, keepdim=True), floor)
    return (e4m3_round(g / s) * s).flatten(-2).to(x.dtype)


def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 (10 mantissa bits) by dropping the low 13 bits (round toward zero); fp32 out."""
    bits = x.float().contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


# ----------------------------------------------------------------------------- vLLM recipes
def kv_record_roundtrip(rows: torch.Tensor, rope_dim: int = 64, block: int = 64) -> torch.Tensor:
    """``fp8_ds_mla`` record. rows: [..., d] (RoPE already applied to the last `rope_dim` dims).

    NoPE dims [..., :d-rope_dim]: FP8 E4M3, one UE8M0 scale per 64 dims, amax floor 1e-4.
    RoPE dims: BF16. Returns rows.dtype.
    """
    nope, rope = rows[..., :-rope_dim], rows[..., -rope_dim:]
    return torch.cat((fp8_block_roundtrip(nope, block, 1e-4),
                      rope.to(torch.bfloat16).to(rows.dtype)), dim=-1)


#: ``fp8_ds_mla`` record of one 512-wide KV row, vLLM's FlashMLA layout: per token 448 E4M3 NoPE bytes then the
#: 64 RoPE dims as BF16 (576 B, the "data" area of a block), and in a separate area after all of a block's data
#: 7 UE8M0 scale bytes (one per 64 NoPE dims) + 1 pad byte (0). 584 B per token.
KV_RECORD_WIDTH, KV_RECORD_ROPE, KV_RECORD_BLOCK = 512, 64, 64
KV_RECORD_NOPE = KV_RECORD_WIDTH - KV_RECORD_ROPE
KV_RECORD_DATA_BYTES = KV_RECORD_NOPE + 2 * KV_RECORD_ROPE                # 576
KV_RECORD_SCALES = KV_RECORD_NOPE // KV_RECORD_BLOCK                      # 7
KV_RECORD_SCALE_BYTES = 8                                                 # 7 scales + 1 pad
KV_RECORD_BYTES = KV_RECORD_DATA_BYTES + KV_RECORD_SCALE_BYTES            # 584


def kv_record_encode(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_ds_mla`` bytes of rows [N, 512] (RoPE applied to the last 64 dims) -> data [N, 576] uint8,
    scales [N, 8] uint8. `kv_record_decode` of them equals `kv_record_roundtrip(rows)` bit for bit."""
    n = rows.shape[0]
    nope = rows[:, :KV_RECORD_NOPE].to(torch.bfloat16).float().unflatten(-1, (KV_RECORD_SCALES, KV_RECORD_BLOCK))
    exp = pow2_exponent(nope.abs().amax(-1, keepdim=True), 1e-4)                           # [N, 7, 1]
    codes = e4m3_codes(nope / torch.ldexp(torch.ones_like(nope[..., :1]), exp))
    rope = rows[:, KV_RECORD_NOPE:].to(torch.bfloat16).contiguous()
    data = torch.cat((codes.flatten(1).view(torch.uint8), rope.view(torch.uint8)), dim=1)
    scales = torch.zeros(n, KV_RECORD_SCALE_BYTES, dtype=torch.uint8, device=rows.device)
    scales[:, :KV_RECORD_SCALES] = (exp.squeeze(-1) + 127).to(torch.uint8)
    return data, scales


def kv_record_decode(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of records: data [..., 576] uint8, scales [..., 8] uint8 -> [..., 512] of `dtype`."""
    codes = data[..., :KV_RECORD_NOPE].contiguous().view(FP8_DTYPE).float()
    s = e8m0_decode(scales[..., :KV_RECORD_SCALES].contiguous()).unsqueeze(-1)
    nope = (codes.unflatten(-1, (KV_RECORD_SCALES, KV_RECORD_BLOCK)) * s).flatten(-2)
    rope = data[..., KV_RECORD_NOPE:].contiguous().view(torch.bfloat16)
    return torch.cat((nope.to(dtype), rope.to(dtype)), dim=-1)


def index_key_roundtrip(keys: torch.Tensor) -> torch.Tensor:
    """FP8 indexer K cache: keys [..., d_I] (after RoPE), one power-of-two fp32 scale per row, floor 1e-4."""
    return fp8_block_roundtrip(keys, keys.shape[-1], 1e-4)


def index_query_roundtrip(q: torch.Tensor) -> torch.Tensor:
    """FP8 index queries: q [T, H_I, d_I] (after RoPE), one power-of-two scale per (token, head), floor
    1e-4. vLLM folds the scale into the head weights; dequantising q gives the same scores."""
    return fp8_block_roundtrip(q, q.shape[-1], 1e-4)


def act_roundtrip(x: torch.Tensor, block: int = 128, bf16_first: bool = True) -> torch.Tensor:
    """DeepGEMM W8A8 activation quantiser (V4 FP8 block linears): per token, per `block` input elements,
    UE8M0 scale, eps 1e-10. x: [..., K] -> same shape/dtype.

    For the grouped ``wo_a`` input vLLM quantises the fp32 result of the inverse RoPE directly (no BF16
    rounding in between): pass the fp32 tensor with ``bf16_first=False``."""
    return fp8_block_roundtrip(x, block, 1e-10, bf16_first=bf16_first)
