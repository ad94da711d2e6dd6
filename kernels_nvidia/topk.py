"""Deterministic top-k of score rows (the indexer's selection, model-spec §3.6) as a Triton radix select.

`topk_rows(scores, k, n_valid)` equals the oracle bitwise: the indices of the k largest scores of every row in
descending score order, ties to the lower index, -inf never selected (-1), +inf kept, NaN sorted first with -1
(torch.sort's order), -1 padding past the row's finite entries. With `n_valid` ([T], entries at or past
n_valid[t] are -inf by contract) a row is read only over [0, n_valid[t]), so the work follows each row's
context, not the fixed (CUDA-graph) width.

Every float is mapped to a uint32 key u whose unsigned order is the oracle's (-0.0 folded into +0.0, every NaN
to the top key; the formula of `indexer._ordered_int` with the sign bit flipped). Launches, all on a fixed grid
[T, n_split] (no host sync; a row's valid prefix is cut into n_split contiguous ranges, one program each):

1. four histogram passes, one per byte of u from the top: pass p counts the digit (u >> 24 - 8p) & 255 of the
   keys whose higher bytes equal the prefix found so far and adds the 256 counts into the row's histogram
   (integer atomics: order-free). Each program first replays the passes before its own from the histograms
   (`_radix_state`): the threshold digit b is the bin holding the rem-th largest key, rem -= count above b.
   When bin b holds exactly rem keys the row is done: every key >= lo = prefix << shift is selected.
2. select: every key > lo, and the first `need` keys == lo in index order (ranks from the per-program
   counts of the last pass), go into the output row as packed int64 (signed key << 32 | 2^32 - 1 - index);
   slots come from a per-row atomic counter (any order: step 3 sorts unique keys).
3. sort: one program per row sorts its min(k, n_valid) packed keys (tl.sort, descending) and decodes them.

Each valid score is read five times (four passes, select); rows wholly past the valid prefix cost nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 1024         # scores per program step
WARPS = 4            # warps of the pass and select programs
SORT_WARPS = 8       # warps of the per-row sort
WAVES = 4            # programs aimed at per SM when a row is cut into ranges
MAX_K = 4096         # the per-row sort holds next_pow2(k) int64 keys in registers; larger k: the oracle
BINS = tl.constexpr(256)                 # radix digit of 8 bits: four passes cover a 32-bit key
STATE = tl.constexpr(4 * BINS.value + 1)  # int32 state per row: the four pass histograms, the select slot counter


@triton.jit
def _radix_keys(x):
    """fp32 [B] -> uint32 [B] keys whose unsigned order is torch.sort's float order (-0.0 = +0.0, NaN on top)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)                      # -0.0 -> +0.0
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                  # signed order = float order
    key = tl.where(x != x, 0x7FFFFFFF, key)                            # every NaN above +inf
    return (key ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _radix_state(H, rem, PASSES: tl.constexpr):
    """Replay the first PASSES digit passes of a row from its histograms H [4, BINS] for the rem largest keys.

    Returns (lo, need, done): after a full resolution (four passes) lo is the rem-th largest key and need the
    number of keys equal to it to take; once a threshold bin holds exactly the keys still needed, done is true
    and every key >= lo (the bin's lowest key) is selected."""
    bins = tl.arange(0, BINS)
    prefix = tl.full([], 0, tl.uint32)
    lo = tl.full([], 0, tl.uint32)
    done = rem < 0
    for p in tl.static_range(PASSES):
        h = tl.load(H + p * BINS + bins)
        at_least = tl.cumsum(h, 0, reverse=True)                       # keys with digit >= bin
        b = tl.sum((at_least >= rem).to(tl.int32), 0) - 1               # bin holding the rem-th largest
        above = tl.sum(tl.where(bins > b, h, 0), 0)
        left = rem - above
        prefix = tl.where(done, prefix, (prefix << 8) | b.to(tl.uint32))
        lo = tl.where(done, lo, prefix << (24 - 8 * p))
        rem = tl.where(done, rem, left)
        done = done | (tl.sum(tl.where(bins == b, h, 0), 0) == left)
    return lo, rem, done


@triton.jit
def _split_range(nv, split, n_split, BLOCK: tl.constexpr):
    """[start, stop) of program `split` of n_split over a row's valid prefix [0, nv), in whole BLOCKs."""
    span = tl.cdiv(tl.cdiv(nv, n_split), BLOCK) * BLOCK
    start = tl.minimum(split * span, nv)
    return start, tl.minimum(start + span, nv)


@triton.jit
def _row(NV, n_cols, k):
    """This program's row, its valid length clamped to [0, n_cols] and its selection size min(k, n_valid)."""
    row = tl.program_id(0)
    nv = tl.minimum(tl.maximum(tl.load(NV + row).to(tl.int32), 0), n_cols)
    return row, nv, tl.minimum(k, nv)


@triton.jit
def _topk_hist_kernel(S, NV, W, CNT3, n_cols, s_row, n_split, k, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """Digit pass PASS of row program_id(0) over range program_id(1): W[row, PASS] += histogram of digit
    (u >> 24 - 8 PASS) & 255 of the keys matching the prefix; the last pass also keeps its counts per
    program in CNT3[row, split]."""
    row, nv, n_sel = _row(NV, n_cols, k)
    split = tl.program_id(1)
    H = W + row * STATE
    lo, need, done = _radix_state(H, n_sel, PASS)
    start, stop = _split_range(nv, split, n_split, BLOCK)
    stop = tl.where(done, start, stop)
    hist = tl.zeros([BINS], tl.int32)
    for c in range(start, stop, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        valid = offs < stop
        u = _radix_keys(tl.load(S + row.to(tl.int64) * s_row + offs, mask=valid, other=0.0))
        if PASS > 0:
            valid &= (u >> (32 - 8 * PASS)) == (lo >> (32 - 8 * PASS))
        hist += tl.histogram(((u >> (24 - 8 * PASS)) & 255).to(tl.int32), BINS, mask=valid)
    bins = tl.arange(0, BINS)
    tl.atomic_add(H + PASS * BINS + bins, hist, mask=hist > 0, sem="relaxed")
    if PASS == 3:
        tl.store(CNT3 + (row * n_split + split) * BINS + bins, hist)


@triton.jit
def _topk_select_kernel(S, NV, W, CNT3, OUT, n_cols, s_row, n_split, k, BLOCK: tl.constexpr):
    """Write row program_id(0)'s selected keys of range program_id(1) as packed int64 into OUT[row, :n_sel]."""
    row, nv, n_sel = _row(NV, n_cols, k)
    split = tl.program_id(1)
    H = W + row * STATE
    lo, need, done = _radix_state(H, n_sel, 4)
    need = tl.where(done, nv, need)
    # keys == lo in the ranges before this one (their index order): counts of the last pass, digit lo & 255
    ties = tl.full([], 0, tl.int32)
    for s0 in range(0, split, 64):
        offs_s = s0 + tl.arange(0, 64)
        ties += tl.sum(tl.load(CNT3 + (row * n_split + offs_s) * BINS + (lo & 255).to(tl.int32),
                               mask=offs_s < split, other=0), 0)
    start, stop = _split_range(nv, split, n_split, BLOCK)
    for c in range(start, stop, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        valid = offs < stop
        u = _radix_keys(tl.load(S + row.to(tl.int64) * s_row + offs, mask=valid, other=0.0))
        tie = (valid & (u == lo)).to(tl.int32)
        sel = valid & ((u > lo) | ((tie != 0) & (ties + tl.cumsum(tie, 0) - tie < need)))
        ties += tl.sum(tie, 0)
        slot = tl.atomic_add(H + 4 * BINS, tl.sum(sel.to(tl.int32), 0), sem="relaxed")
        key = (u.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.int64)   # signed key: the order of u
        packed = (key << 32) | (0xFFFFFFFF - offs.to(tl.int64))
        tl.store(OUT + row * k + slot + tl.cumsum(sel.to(tl.int32), 0) - 1, packed, mask=sel)


@triton.jit
def _topk_sort_kernel(NV, OUT, n_cols, k, KP: tl.constexpr):
    """OUT[row] = the indices of its n_sel packed keys in descending key order; -1 for -inf, NaN and padding."""
    row, nv, n_sel = _row(NV, n_cols, k)
    offs = tl.arange(0, KP)
    packed = tl.load(OUT + row * k + offs, mask=offs < n_sel, other=-9223372036854775808)
    packed = tl.sort(packed, descending=True)
    key = (packed >> 32).to(tl.int32)
    idx = 0xFFFFFFFF - (packed & 0xFFFFFFFF)
    finite = (key > -2139095041) & (key != 0x7FFFFFFF)    # above the key of -inf; not NaN
    tl.debug_barrier()
    tl.store(OUT + row * k + offs, tl.where(finite, idx, -1), mask=offs < k)


@functools.lru_cache(maxsize=None)
def _n_sm(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def topk_rows(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """scores: [T, N] (fp32; other float types are widened exactly); n_valid: [T] int or None (= N) ->
    [T, k] int64 indices (oracle semantics, see the module docstring). Reads row t over [0, n_valid[t]) only."""
    t, n_cols = scores.shape
    if n_cols >= 1 << 31 or k > MAX_K:
        raise NotImplementedError(f"topk_rows: {n_cols} columns / k = {k} past the kernel's int32 / MAX_K bounds")
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0:
        return out
    scores = scores.float()
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    if n_valid is None:
        n_valid = torch.full((t,), n_cols, dtype=torch.int32, device=scores.device)
    n_valid = n_valid.contiguous()
    n_split = max(1, min(triton.cdiv(n_cols, BLOCK), triton.cdiv(WAVES * _n_sm(scores.device), t)))
    state = torch.zeros(t, STATE, dtype=torch.int32, device=scores.device)
    cnt3 = torch.empty(t, n_split, BINS, dtype=torch.int32, device=scores.device)
    grid = (t, n_split)
    for p in range(4):
        _topk_hist_kernel[grid](scores, n_valid, state, cnt3, n_cols, scores.stride(0), n_split, k,
                                PASS=p, BLOCK=BLOCK, num_warps=WARPS)
    _topk_select_kernel[grid](scores, n_valid, state, cnt3, out, n_cols, scores.stride(0), n_split, k,
                              BLOCK=BLOCK, num_warps=WARPS)
    _topk_sort_kernel[(t,)](n_valid, out, n_cols, k, KP=max(16, triton.next_power_of_2(k)), num_warps=SORT_WARPS)
    return out
