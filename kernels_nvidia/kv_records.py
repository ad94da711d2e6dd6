"""``fp8_ds_mla`` KV records (vLLM's FlashMLA block format): quantise-and-store and dequantising gather.

A record cache is pages [B, P] uint8 with R records per page: record r of block b has its 576 data bytes at
b*P + r*576 (448 E4M3 NoPE codes, then the 64 RoPE dims as BF16) and its 8 scale bytes at b*P + R*576 + r*8
(7 UE8M0 exponents, one per 64 NoPE dims, then a 0 pad byte). A flat slot s is record s % R of block s // R.

The values equal the oracle's (`vllm_deepinfer.ops.quant.kv_record_encode` / `kv_record_decode`) bit for bit:
the scale exponent ceil(log2(max(amax, 1e-4) / 448)) is read from the fp32 bits (no log2 rounding), the E4M3
conversion is the hardware's round-to-nearest-even with saturation, and dequantisation multiplies by an exact
power of two. `_record_rows` is also what the attention kernel (`attention.py`) loads in place of a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _record_rows(base, r, valid, offs_d, RPB):
    """fp32 rows [BN, 512] of the records r [BN] of pages at `base` [BN] (uint8 pointers to their blocks).

    Loads only what a record holds: 512 data bytes (448 codes, then the RoPE bytes, read again as BF16 below),
    8 scale bytes and 64 BF16, so a pipelined key loop buffers ~41 KB per stage for BN = 64."""
    BN: tl.constexpr = r.shape[0]
    data = base + r.to(tl.int64) * 576
    codes = tl.load(data[:, None] + offs_d[None, :], mask=valid[:, None], other=0)           # [BN, 512]
    g = tl.arange(0, 8)
    exps = tl.load(base[:, None] + RPB * 576 + r.to(tl.int64)[:, None] * 8 + g[None, :], mask=valid[:, None],
                   other=127)                                                                 # [BN, 8]
    scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)                          # 2 ** (byte - 127)
    rope = tl.load((data + 448).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :],
                   mask=valid[:, None], other=0.0)                                            # [BN, 64]
    nope = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BN, 8, 64)) * scale[:, :, None]
    return tl.reshape(tl.where((g == 7)[None, :, None], rope.to(tl.float32)[:, None, :], nope), (BN, 512))


@triton.jit
def _store_kernel(ROWS, s_rows, SLOTS, PAGES, P, RPB):
    """One record per program: quantise row t and store it at slot SLOTS[t]."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(SLOTS + t).to(tl.int64)
    base = PAGES + (s // RPB) * P
    r = s % RPB
    offs = tl.arange(0, 512)
    x = tl.load(ROWS + t * s_rows + offs).to(tl.bfloat16).to(tl.float32)
    g = tl.reshape(x, (8, 64))
    ratio = tl.math.div_rn(tl.maximum(tl.max(tl.abs(g), axis=1), 1e-4), 448.0)     # [8], IEEE division
    bits = ratio.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)      # exact ceil(log2)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)                            # 2 ** -e
    q = tl.reshape(tl.clamp(g * inv[:, None], -448.0, 448.0), (512,)).to(tl.float8e4nv)
    data = base + r * 576
    tl.store(data + offs, q.to(tl.uint8, bitcast=True), mask=offs < 448)
    tl.store((data + 448).to(tl.pointer_type(tl.bfloat16)) + (offs - 448), x.to(tl.bfloat16), mask=offs >= 448)
    j = tl.arange(0, 8)
    tl.store(base + RPB * 576 + r * 8 + j, tl.where(j < 7, e + 127, 0).to(tl.uint8))


@triton.jit
def _gather_kernel(PAGES, P, RPB, SLOTS, OUT, N, BN: tl.constexpr):
    """BN slots per program -> their dequantised rows (slot -1 reads slot 0)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    inside = offs_n < N
    s = tl.maximum(tl.load(SLOTS + offs_n, mask=inside, other=0).to(tl.int64), 0)
    offs_d = tl.arange(0, 512)
    rows = _record_rows(PAGES + (s // RPB) * P, s % RPB, inside, offs_d, RPB)
    tl.store(OUT + offs_n.to(tl.int64)[:, None] * 512 + offs_d[None, :], rows.to(OUT.dtype.element_ty),
             mask=inside[:, None])


def _check(pages: torch.Tensor) -> None:
    if pages.dtype != torch.uint8 or pages.stride(1) != 1:
        raise NotImplementedError("record pages must be uint8 with contiguous bytes")


def kv_record_store(pages: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rows_per_block: int) -> None:
    """Quantise rows [N, 512] into records at flat slots [N] of pages [B, P] uint8 (R = rows_per_block)."""
    _check(pages)
    if rows.shape[-1] != 512 or rows.stride(-1) != 1:
        raise NotImplementedError("records hold contiguous 512-wide rows")
    n = slots.shape[0]
    if n:
        _store_kernel[(n,)](rows, rows.stride(0), slots.contiguous(), pages, pages.stride(0), rows_per_block,
                            num_warps=4)


def kv_record_gather(pages: torch.Tensor, slots: torch.Tensor, rows_per_block: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantised records at flat slots [...] of pages [B, P] uint8 -> [..., 512] of `dtype`."""
    _check(pages)
    flat = slots.reshape(-1).contiguous()
    out = torch.empty(flat.shape[0], 512, dtype=dtype, device=pages.device)
    if flat.shape[0]:
        bn = 8
        _gather_kernel[(triton.cdiv(flat.shape[0], bn),)](pages, pages.stride(0), rows_per_block, flat, out,
                                                          flat.shape[0], BN=bn, num_warps=4)
    return out.view(*slots.shape, 512)
