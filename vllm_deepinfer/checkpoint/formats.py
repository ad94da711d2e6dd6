"""Encode / decode of the quantised tensor formats stored in DeepSeek-V4(.1)-Flash checkpoints.

Model-spec §4. All decoders are vectorised torch code and return ``torch.float32``; all encoders
produce exactly the dtypes written to safetensors.

Stored formats
--------------
* FP8 E4M3 (``F8_E4M3`` / ``torch.float8_e4m3fn``): codes ``0x7F``/``0xFF`` are NaN and never emitted.
* UE8M0 scale (``F8_E8M0`` / ``torch.float8_e8m0fnu``): byte ``b`` means ``2**(b-127)``; ``0xFF`` is NaN
  and is rejected by every decoder here.
* Block-FP8 linear (§4.2): ``weight`` E4M3 ``[N, K]`` + ``scale`` E8M0 ``[ceil(N/B), ceil(K/B)]``.
* MXFP4 routed expert (§4.3): ``weight`` int8 ``[N, K/2]`` (two E2M1 codes per byte, element ``2j`` in the
  low nibble, ``2j+1`` in the high nibble) + ``scale`` E8M0 ``[N, K/32]``.
* Row FP8 (Engram tables, §4.4): ``weight`` E4M3 ``[N, d]`` + ``scale`` E8M0 ``[N, d/32]``.

Public API (everything else is private)::

    e8m0_to_float(scale) -> fp32                       # decode UE8M0 bytes, reject 0xFF (e8m0_decode: no check)
    float_exponent_to_e8m0(exp) -> e8m0                # integer exponents -> UE8M0 tensor
    fp8_to_float(weight) -> fp32                       # decode E4M3
    dequant_fp8_block(weight, scale, block) -> fp32    # §4.2
    quant_fp8_block(w, block) -> (weight, scale)       # §4.7
    dequant_mxfp4(weight_i8, scale, checked) -> fp32   # §4.3
    quant_mxfp4(w) -> (weight_i8, scale)               # §4.7
    dequant_fp8_rows(weight, scale, group=32) -> fp32  # §4.4 (Engram rows; works on gathered rows too)
    quant_fp8_rows(w, group=32) -> (weight, scale)     # §4.4
    check_no_nan_codes(t) -> None                      # raises on NaN FP8 / E8M0 codes

Leading batch dimensions (e.g. a stacked ``[E, N, K/2]`` expert tensor) are accepted by the MXFP4 and
row decoders; the block decoder accepts ``[..., N, K]``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP8_DTYPE", "E8M0_DTYPE", "FP8_MAX", "FP4_MAX", "MX_BLOCK", "E2M1_VALUES",
    "FormatError", "e8m0_decode", "e8m0_to_float", "float_exponent_to_e8m0", "fp8_to_float",
    "dequant_fp8_block", "quant_fp8_block", "dequant_mxfp4", "quant_mxfp4",
    "dequant_fp8_rows", "quant_fp8_rows", "check_no_nan_codes",
]

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu
FP8_MAX = 448.0
FP4_MAX = 6.0
MX_BLOCK = 32
#: E2M1 magnitudes of codes 0..7 (bit 3 of a nibble is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Signed E2M1 value of every nibble 0..15.
_E2M1_LUT = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)
# Both E2M1 values of every packed byte: row b = (value of low nibble, value of high nibble).
_E2M1_PAIR_LUT = torch.stack((_E2M1_LUT[torch.arange(256) & 0x0F], _E2M1_LUT[torch.arange(256) >> 4]), dim=1).contiguous()


class FormatError(ValueError):
    """A stored tensor that does not decode (wrong dtype, NaN code, bad shape)."""


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise FormatError(f"expected a 1-byte dtype, got {t.dtype}")
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------- scales
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode UE8M0 scale bytes (``float8_e8m0fnu`` or raw ``uint8``) to exact fp32 ``2**(b-127)``.

    Raises FormatError if any byte is 0xFF (NaN).
    """
    b = _as_u8(scale)
    if bool((b == 0xFF).any()):
        raise FormatError("E8M0 scale contains the NaN byte 0xFF")
    return e8m0_decode(b)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 ``2**(b-127)`` by torch's own cast, without the 0xFF check: no host round trip
    (CUDA-graph safe), for tensors validated at load."""
    return _as_u8(scale).view(E8M0_DTYPE).to(torch.float32)


def _scales(scale: torch.Tensor, checked: bool) -> torch.Tensor:
    """E8M0 scales -> fp32; `checked` rejects 0xFF (a host sync), else the unchecked cast."""
    return e8m0_to_float(scale) if checked else e8m0_decode(scale)


def float_exponent_to_e8m0(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents ``e`` (value ``2**e``, ``-127 <= e <= 127``) -> ``float8_e8m0fnu`` tensor."""
    e = exp.to(torch.int32)
    if bool(((e < -127) | (e > 127)).any()):
        raise FormatError("E8M0 exponent out of range [-127, 127]")
    return (e + 127).to(torch.uint8).view(E8M0_DTYPE)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite float32 x (via frexp, no rounding issues)."""
    mant, exp = torch.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)


# ---------------------------------------------------------------------------------------- FP8
def fp8_to_float(weight: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 (``float8_e4m3fn`` or raw ``uint8`` bytes) to fp32."""
    if weight.dtype != FP8_DTYPE:
        weight = _as_u8(weight).view(FP8_DTYPE)
    return weight.to(torch.float32, memory_format=torch.contiguous_format)


def _to_fp8_(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 with round-to-nearest-even, clamped to +-448 (never produces NaN codes: NaN -> 0).
    Modifies `x` (a float32 temporary) in place."""
    return torch.nan_to_num_(x, nan=0.0).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _block_pair(block) -> tuple[int, int]:
    if isinstance(block, int):
        return block, block
    bn, bk = (int(v) for v in block)
    return bn, bk


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block=128) -> torch.Tensor:
    """Block-FP8 linear -> fp32 (§4.2): ``W[i,k] = fp8(weight[i,k]) * 2**(scale[i//B, k//B] - 127)``.

    ``weight``: E4M3 ``[..., N, K]``; ``scale``: E8M0 (or uint8, or an already-float scale such as the
    float32 scales of FP8 experts) ``[..., ceil(N/B), ceil(K/B)]``; ``block``: ``B`` or ``(B_n, B_k)``.
    Partial edge blocks are handled.
    """
    bn, bk = _block_pair(block)
    n, k = weight.shape[-2], weight.shape[-1]
    nb, kb = -(-n // bn), -(-k // bk)
    if tuple(scale.shape[-2:]) != (nb, kb) or scale.shape[:-2] != weight.shape[:-2]:
        raise FormatError(f"block scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                          f"with block {bn}x{bk} (expected {tuple(weight.shape[:-2]) + (nb, kb)})")
    s = scale.to(torch.float32) if scale.is_floating_point() and scale.dtype != E8M0_DTYPE else e8m0_to_float(scale)
    out = fp8_to_float(weight)
    lead = weight.shape[:-2]
    if n % bn == 0 and k % bk == 0:  # broadcast in place, no full-size scale tensor
        out.view(*lead, nb, bn, kb, bk).mul_(s.reshape(*lead, nb, 1, kb, 1))
        return out
    full = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return out.mul_(full)


def quant_fp8_block(w: torch.Tensor, block=128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [N, K]`` to block-FP8 (§4.7). Returns ``(weight E4M3 [N,K], scale E8M0 [ceil(N/B), ceil(K/B)])``.

    Per block: ``e = ceil(log2(max(amax, 2**-126 * 448) / 448))``, scale byte ``e + 127``,
    ``weight = e4m3(w / 2**e)`` (round-to-nearest-even, clamp +-448).
    """
    bn, bk = _block_pair(block)
    w = w.to(torch.float32)
    if w.dim() != 2:
        raise FormatError(f"quant_fp8_block expects a 2-D matrix, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    if n % bn or k % bk:
        padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32)
        padded[:n, :k] = w
    else:
        padded = w.contiguous()
    blocks = padded.view(nb, bn, kb, bk)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), -blocks.amin(dim=(1, 3)))
    e = ceil_log2(torch.clamp(amax, min=math.ldexp(FP8_MAX, -126)) / FP8_MAX).clamp(-127, 127)
    inv = torch.ldexp(torch.ones_like(amax), -e)  # exact 2**-e
    scaled = (blocks * inv.view(nb, 1, kb, 1)).view(nb * bn, kb * bk)[:n, :k]
    return _to_fp8_(scaled), float_exponent_to_e8m0(e)


# ---------------------------------------------------------------------------------------- MXFP4
def dequant_mxfp4(weight: torch.Tensor, scale: torch.Tensor, checked: bool = True) -> torch.Tensor:
    """MXFP4 expert -> fp32 (§4.3). ``weight``: int8/uint8 ``[..., N, K/2]``; ``scale``: E8M0 ``[..., N, K/32]``.

    ``W[i,k] = e2m1(nibble(weight[i, k//2], k % 2)) * 2**(scale[i, k//32] - 127)``; the even element is the
    low nibble. ``checked=False`` skips the NaN-scale check (a host sync) for scales validated at load.
    """
    b = _as_u8(weight)
    k = b.shape[-1] * 2
    if scale.shape[:-1] != b.shape[:-1] or scale.shape[-1] * MX_BLOCK != k:
        raise FormatError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed weight {tuple(b.shape)} "
                          f"(expected {tuple(b.shape[:-1]) + (k // MX_BLOCK,)})")
    pair_lut = _E2M1_PAIR_LUT.to(b.device)  # byte -> (low-nibble value, high-nibble value)
    vals = pair_lut.index_select(0, b.reshape(-1).to(torch.int32)).view(*b.shape[:-1], k)  # fresh, contiguous
    vals.view(*b.shape[:-1], k // MX_BLOCK, MX_BLOCK).mul_(_scales(scale, checked).unsqueeze(-1))
    return vals


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 nibble of each element (ties to the even code; magnitudes saturate at 6).

    The E2M1 grid has step 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6], so the code is a half-to-even rounding
    inside the segment (the parity of the rounded step equals the parity of the code).
    """
    mag = torch.nan_to_num(x.abs(), nan=0.0).clamp_(max=FP4_MAX)
    step = torch.where(mag < 2.0, mag * 2.0, torch.where(mag < 4.0, mag + 2.0, mag * 0.5 + 4.0))
    # round half to even of values in [0, 7] via the float32 magic number 1.5 * 2**23 (exact IEEE arithmetic;
    # torch.round is very slow on some CPUs)
    code = (step + 12582912.0) - 12582912.0
    code = code.to(torch.uint8)
    return code | (((x < 0) & (code > 0)).to(torch.uint8) << 3)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [..., N, K]`` (K a multiple of 32) to MXFP4 (§4.7).

    Returns ``(weight int8 [..., N, K/2], scale E8M0 [..., N, K/32])``. Per row and 32-group:
    ``e = ceil(log2(max(amax, 6 * 2**-126) / 6))``, codes = nearest E2M1 of ``w / 2**e``.
    """
    w = w.to(torch.float32)
    k = w.shape[-1]
    if k % MX_BLOCK:
        raise FormatError(f"MXFP4 needs the input dim to be a multiple of {MX_BLOCK}, got {k}")
    g = w.reshape(*w.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    amax = torch.maximum(g.amax(dim=-1), -g.amin(dim=-1))
    e = ceil_log2(torch.clamp(amax, min=math.ldexp(FP4_MAX, -126)) / FP4_MAX).clamp(-127, 127)
    scaled = g * torch.ldexp(torch.ones_like(amax), -e).unsqueeze(-1)
    codes = _e2m1_codes(scaled).view(*w.shape[:-1], k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), float_exponent_to_e8m0(e)


# ---------------------------------------------------------------------------------------- row FP8
def dequant_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, group: int = MX_BLOCK,
                     checked: bool = True) -> torch.Tensor:
    """Row-wise FP8 with one E8M0 scale per ``group`` values (Engram tables, §4.4) -> fp32.

    ``weight``: E4M3 ``[..., N, d]``; ``scale``: E8M0 ``[..., N, d/group]``. Works on a gathered subset of
    rows as well (e.g. ``dequant_fp8_rows(table_w[idx], table_s[idx])``). ``checked=False`` skips the NaN-code
    check (a host sync) for tables validated at load.
    """
    d = weight.shape[-1]
    if scale.shape[:-1] != weight.shape[:-1] or scale.shape[-1] * group != d:
        raise FormatError(f"row scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                          f"with group {group}")
    w = fp8_to_float(weight)
    w.view(*weight.shape[:-1], d // group, group).mul_(_scales(scale, checked).unsqueeze(-1))
    return w


def quant_fp8_rows(w: torch.Tensor, group: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [..., N, d]`` to row FP8 with per-``group`` E8M0 scales (§4.4, recipe of §4.7)."""
    w = w.to(torch.float32)
    d = w.shape[-1]
    if d % group:
        raise FormatError(f"row FP8 needs the last dim to be a multiple of {group}, got {d}")
    g = w.reshape(*w.shape[:-1], d // group, group)
    amax = g.abs().amax(dim=-1)
    e = ceil_log2(torch.clamp(amax, min=math.ldexp(FP8_MAX, -126)) / FP8_MAX).clamp(-127, 127)
    q = _to_fp8_(g * torch.ldexp(torch.ones_like(amax), -e).unsqueeze(-1))
    return q.reshape(w.shape), float_exponent_to_e8m0(e)


# ---------------------------------------------------------------------------------------- checks
def check_no_nan_codes(t: torch.Tensor, name: str = "tensor") -> None:
    """Raise FormatError if an E4M3 tensor holds 0x7F/0xFF or an E8M0 tensor holds 0xFF."""
    if t.dtype == FP8_DTYPE:
        b = t.view(torch.uint8)
        if bool(((b & 0x7F) == 0x7F).any()):
            raise FormatError(f"{name}: FP8 E4M3 tensor contains NaN codes (0x7F/0xFF)")
    elif t.dtype == E8M0_DTYPE:
        if bool((t.view(torch.uint8) == 0xFF).any()):
            raise FormatError(f"{name}: E8M0 scale tensor contains the NaN byte 0xFF")
