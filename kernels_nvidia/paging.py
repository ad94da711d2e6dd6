"""Slots of paged cache rows, one kernel per call (the oracle's `row_slots` / `range_slots`).

A row i of a request r in a paged buffer with m tokens per row and B tokens per block lives at
block_table[r, i*m // B] * rows_per_block + (i*m % B) // m. The oracle computes that with ten to fifteen
small torch kernels (products, floor divisions, clamps, a gather, a cast, comparisons, selects); a decode
step asks for it several times per layer (window rows, selected compressed rows, each cache write), which
made these index kernels about 300 of a decode step's launches on the H200 (2026-12-03 profile, batch 64).
Here each call is one program per (token, block of columns); integer math only, so the result equals the
oracle's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_slots_kernel(BT, s_bt, n_cols, REQ, IDS, s_ids, START, STOP, KEEP, OUT, K, TPR, BS, RPB,
                      EXPLICIT: tl.constexpr, MASKED: tl.constexpr, HAS_STOP: tl.constexpr,
                      HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = j < K
    if EXPLICIT:
        ids = tl.load(IDS + t * s_ids + j, mask=inside, other=0).to(tl.int64)
        valid = ids >= 0
    else:
        ids = tl.load(START + t).to(tl.int64) + j
        valid = ids >= 0
        if HAS_STOP:
            valid = valid & (ids < tl.load(STOP + t).to(tl.int64))
    if MASKED:
        ids = tl.where(valid, ids, 0)
    tok = ids * TPR
    col = tok // BS
    rem = tok % BS
    neg = rem < 0  # floor division and modulo for negative ids (unmasked calls), as torch computes them
    rem = tl.where(neg, rem + BS, rem)
    col = tl.where(neg, col - 1, col)
    col = tl.minimum(tl.maximum(col, 0), n_cols - 1)
    r = tl.load(REQ + t).to(tl.int64)
    block = tl.load(BT + r * s_bt + col, mask=inside, other=0).to(tl.int64)
    slot = block * RPB + rem // TPR
    if HAS_KEEP:
        slot = tl.where(tl.load(KEEP + t) != 0, slot, 0)
    if MASKED:
        slot = tl.where(valid, slot, -1)
    tl.store(OUT + t * K + j, slot, mask=inside)


def _launch(block_table: torch.Tensor, req: torch.Tensor, t: int, k: int, *, ids=None, start=None, stop=None,
            keep=None, masked: bool, tokens_per_row: int, block_size: int, rows_per_block: int) -> torch.Tensor:
    out = torch.empty((t, k), dtype=torch.int64, device=block_table.device)
    if t and k:
        if block_table.stride(1) != 1:
            block_table = block_table.contiguous()
        dummy = req
        block = min(256, triton.next_power_of_2(k))
        _row_slots_kernel[(t, triton.cdiv(k, block))](
            block_table, block_table.stride(0), block_table.shape[1], req,
            dummy if ids is None else ids, 0 if ids is None else ids.stride(0),
            dummy if start is None else start, dummy if stop is None else stop,
            dummy if keep is None else keep, out, k, tokens_per_row, block_size, rows_per_block,
            EXPLICIT=ids is not None, MASKED=masked, HAS_STOP=stop is not None, HAS_KEEP=keep is not None,
            BLOCK=block, num_warps=1 if block <= 128 else 2)
    return out


def _per_token(x: torch.Tensor, t: int, name: str) -> torch.Tensor:
    if x.numel() != t or (x.dim() == 2 and x.shape[1] != 1) or x.dim() > 2:
        raise NotImplementedError(f"{name} must hold one value per token")
    return x.reshape(t).contiguous()


def row_slots(block_table: torch.Tensor, req: torch.Tensor, row_ids: torch.Tensor, tokens_per_row: int,
              block_size: int, rows_per_block: int, masked: bool = False,
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle's `row_slots`. block_table: [R, NB]; req: [T] or [T, 1]; row_ids: [T] or [T, K] -> int64."""
    if not isinstance(req, torch.Tensor) or row_ids.dim() not in (1, 2):
        raise NotImplementedError("row_slots kernel: a request tensor and 1-D or 2-D row ids")
    t = row_ids.shape[0]
    ids = row_ids.reshape(t, -1)
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    keep = None if keep is None else _per_token(keep, t, "keep").to(torch.int8)
    out = _launch(block_table, _per_token(req, t, "req"), t, ids.shape[1], ids=ids, keep=keep, masked=masked,
                  tokens_per_row=tokens_per_row, block_size=block_size, rows_per_block=rows_per_block)
    return out.view(row_ids.shape)


def range_slots(block_table: torch.Tensor, req: torch.Tensor, start: torch.Tensor, count: int,
                stop: torch.Tensor | None, tokens_per_row: int, block_size: int, rows_per_block: int) -> torch.Tensor:
    """The oracle's `range_slots`. block_table: [R, NB]; req, start, stop: [T] -> [T, count] int64."""
    t = start.shape[0]
    return _launch(block_table, _per_token(req, t, "req"), t, count, start=_per_token(start, t, "start"),
                   stop=None if stop is None else _per_token(stop, t, "stop"), masked=True,
                   tokens_per_row=tokens_per_row, block_size=block_size, rows_per_block=rows_per_block)
