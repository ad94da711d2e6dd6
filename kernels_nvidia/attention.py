"""Sparse attention with a learned sink over one shared latent (K = V): Triton kernels.

Two entry points with the oracle's semantics (model-spec §3.4):

* `sparse_attention(q, keys, allowed, sink, scale)`: queries [T, H, d] over a shared key set [N, d]
  with a per-query mask [T, N] (the interface the model calls today). Key blocks with no allowed
  entry for the query are skipped, so the cost follows the allowed count, not N.
* `sparse_attention_indexed(q, kv, idx, sink, scale)`: queries [T, H, d] over rows `kv[idx[t, j]]`
  (idx [T, K] int32, -1 = none): the gather form for the cache-level path (window rows plus
  top-k compressed rows per token, FlashMLA-sparse style), where every token has its own key set.
* `sparse_attention_paged(q, kv_a, idx_a, kv_b, idx_b, sink, scale)`: the same over rows of two buffers
  (decode: the window cache's slots, then the compressed cache's), read in place with no gathered copy.
* `sparse_attention_records(q, pages_a, idx_a, pages_b, idx_b, rows_per_block, sink, scale)`: the same over
  two ``fp8_ds_mla`` record caches (`kv_records.py`), each key block dequantised in registers as it is loaded.

One program handles one token and a fixed block of BH heads; it walks its keys in fixed BN blocks in
order, with an online softmax that starts from the sink (a virtual key of logit sink_h and value 0).
Nothing depends on T: the result of a token is bitwise independent of the batch (batch-invariant).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels_nvidia.kv_records import _record_rows


@triton.jit
def _attn_block(q, k, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, k.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return m_new, l_i, acc


@triton.jit
def _sparse_attn_dense_kernel(Q, K, MASK, SINK, O, N, H, scale,
                              sq_t, sq_h, sk_n, sm_t, so_t, so_h,
                              D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, D)
    hmask = offs_h < H
    q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
    l_i = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        valid = tl.load(MASK + t * sm_t + offs_n, mask=offs_n < N, other=0) != 0
        if tl.max(valid.to(tl.int32), 0) > 0:
            k = tl.load(K + offs_n[:, None] * sk_n + offs_d[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attn_block(q, k, valid, m_i, l_i, acc, scale, IEEE)
    o = acc / l_i[:, None]
    tl.store(O + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _key_ids(IDX, IDX2, t, si_t, si2_t, n0, KSEL, KSEL2, BN: tl.constexpr):
    """Key ids n0 .. n0 + BN - 1 of token t: IDX[t, :KSEL] then IDX2[t, :KSEL2], -1 past both."""
    offs_n = n0 + tl.arange(0, BN)
    first = offs_n < KSEL
    return tl.where(first, tl.load(IDX + t * si_t + offs_n, mask=first, other=-1),
                    tl.load(IDX2 + t * si2_t + (offs_n - KSEL), mask=~first & (offs_n < KSEL + KSEL2), other=-1))


@triton.jit
def _sparse_attn_indexed_kernel(Q, KV, IDX, KV2, IDX2, SINK, O, PO, PML, KSEL, KSEL2, H, scale,
                                sq_t, sq_h, skv_n, si_t, skv2_n, si2_t, so_t, so_h, NSPLIT, RPB,
                                D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                                PARTIAL: tl.constexpr, IEEE: tl.constexpr, RECORDS: tl.constexpr):
    """One token x BH heads x one range of SPLIT keys (PARTIAL: unnormalised partials, no sink).

    The token's keys are rows KV[IDX[t, :KSEL]] followed by rows KV2[IDX2[t, :KSEL2]] (KSEL2 = 0: one
    source); -1 ids are skipped. RECORDS: KV / KV2 are record pages (block stride skv_n / skv2_n bytes,
    RPB records a block) and the ids flat record slots."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    sp = tl.program_id(2)
    offs_d = tl.arange(0, D)
    hmask = offs_h < H
    q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None], other=0.0)
    if PARTIAL:
        m_i = tl.full([BH], -1.0e30, tl.float32)   # finite sentinel: an all-masked block stays NaN-free
        l_i = tl.zeros([BH], tl.float32)
    else:
        m_i = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
        l_i = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    # only the key blocks from the first to the last with a valid id (window ids lead with -1, selected ids
    # trail with -1): a block of -1 ids leaves (m, l, acc) exactly as they were, so skipping it changes no bit
    lo = SPLIT
    hi = 0
    for n0 in range(0, SPLIT, BN):
        valid = _key_ids(IDX, IDX2, t, si_t, si2_t, sp * SPLIT + n0, KSEL, KSEL2, BN) >= 0
        cols = n0 + tl.arange(0, BN)
        lo = tl.minimum(lo, tl.min(tl.where(valid, cols, SPLIT), 0))
        hi = tl.maximum(hi, tl.max(tl.where(valid, cols + 1, 0), 0))
    for n0 in range(lo // BN * BN, hi, BN):
        offs_n = sp * SPLIT + n0 + tl.arange(0, BN)
        first = offs_n < KSEL
        idx = _key_ids(IDX, IDX2, t, si_t, si2_t, sp * SPLIT + n0, KSEL, KSEL2, BN)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        if RECORDS:
            blk = rows // RPB
            base = tl.where(first, KV + blk * skv_n, KV2 + blk * skv2_n)
            k = _record_rows(base, rows % RPB, valid, offs_d, RPB).to(Q.dtype.element_ty)
        else:
            ptrs = tl.where(first[:, None], KV + rows[:, None] * skv_n + offs_d[None, :],
                            KV2 + rows[:, None] * skv2_n + offs_d[None, :])
            k = tl.load(ptrs, mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _attn_block(q, k, valid, m_i, l_i, acc, scale, IEEE)
    if PARTIAL:
        base = (t * NSPLIT + sp) * H + offs_h
        tl.store(PO + base[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None])
        tl.store(PML + base * 2, m_i, mask=hmask)
        tl.store(PML + base * 2 + 1, l_i, mask=hmask)
    else:
        o = acc / l_i[:, None]
        tl.store(O + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=hmask[:, None])


@triton.jit
def _combine_splits_kernel(PO, PML, SINK, O, H, NSPLIT, so_t, so_h, D: tl.constexpr, BH: tl.constexpr):
    """Merge the key-range partials of one token in split order, starting from the sink."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, D)
    hmask = offs_h < H
    m = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
    l = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for sp in range(0, NSPLIT):
        base = (t * NSPLIT + sp) * H + offs_h
        mp = tl.load(PML + base * 2, mask=hmask, other=-1.0e30)
        lp = tl.load(PML + base * 2 + 1, mask=hmask, other=0.0)
        ap = tl.load(PO + base[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
        m_new = tl.maximum(m, mp)
        a = tl.exp(m - m_new)
        b = tl.exp(mp - m_new)
        l = l * a + lp * b
        acc = acc * a[:, None] + ap * b[:, None]
        m = m_new
    tl.store(O + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], (acc / l[:, None]).to(O.dtype.element_ty),
             mask=hmask[:, None])


TILES: tuple[int, int, int] | None = None  # (BH, BN, num_warps) override, for tuning runs only
# Batch-invariant mode: one program walks all keys of a token (no split of the key reduction). The
# default splits the keys of the gather form into fixed ranges of SPLIT_KEYS when the batch alone
# would leave most SMs idle (decode), which makes the summation order depend on the batch size.
BATCH_INVARIANT = os.environ.get("KERNELS_NVIDIA_BATCH_INVARIANT", "0") == "1"
SPLIT_KEYS = 128
SPLIT: bool | None = None  # force (True/False) the split decision, for tests and tuning runs
_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def _tiles(h: int, d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """Fixed (BH, BN, num_warps) for a head count / head dim: never depends on the token count."""
    if TILES is not None:
        return TILES
    if dtype == torch.float32:
        return max(16, min(32, triton.next_power_of_2(h))), 16, 8
    # H200 sweep (benchmarks/results/h200_kernels_v2.log): all 64 heads in one program (M = 64 for the
    # tensor cores, each gathered row read once per token) is best from T = 64 up; 108 us at T = 256.
    return max(16, min(64, triton.next_power_of_2(h))), 64, 8


_SPLIT_TILES = (16, 64, 4)  # split-KV decode: many small programs (13.9 us at T = 1 vs 31.8 unsplit)
# Pipeline depth of the indexed kernel's key loop, rows and records alike. Each stage buffers a key block in shared
# memory: for records 512 + 8 + 128 bytes a key (`_record_rows`), 172,544 B unsplit and 189,440 B split under
# triton 3.6 for sm_90 (limit 232,448; tests/test_kernel_compile.py). Wider record loads took 246,272 B and failed
# on the H100 / H200 (2026-12-07).
STAGES = 2


def _check(q: torch.Tensor, d: int) -> None:
    if d & (d - 1) or d < 16:
        raise NotImplementedError(f"head dim {d} must be a power of two >= 16")
    if q.stride(-1) != 1:
        raise NotImplementedError("q must be contiguous in its last dim")


GATHER_FROM_T = 64  # mask form with at least this many queries: convert to the gather form


def mask_to_indices(allowed: torch.Tensor) -> torch.Tensor:
    """[T, N] bool -> [T, K] int32 column ids in increasing order, -1 padded (K = max row count; syncs)."""
    t, n = allowed.shape
    counts = allowed.sum(1)
    k = int(counts.max()) if t else 0
    idx = torch.full((t, max(k, 1)), -1, dtype=torch.int32, device=allowed.device)
    rows, cols = allowed.nonzero(as_tuple=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.numel(), device=allowed.device) - starts[rows]
    idx[rows, slot] = cols.to(torch.int32)
    return idx


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                     scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, d]; keys: [N, d]; allowed: [T, N] bool; sink: [H] -> [T, H, d] (q.dtype).

    From GATHER_FROM_T queries on (prefill) and always in batch-invariant mode, the mask is turned
    into per-query row ids and the gather kernel runs (only allowed keys are loaded and multiplied;
    measured 8.4 ms -> see NOTES-gpu.md at T = 4096); below, the mask kernel skips empty key blocks.
    """
    t, h, d = q.shape
    _check(q, d)
    if (t >= GATHER_FROM_T or BATCH_INVARIANT) and q.is_cuda:
        return sparse_attention_indexed(q, keys, mask_to_indices(allowed), sink, scale, out=out)
    keys = keys.to(q.dtype).contiguous()
    allowed = allowed.contiguous().view(torch.uint8)
    sink = sink.float().contiguous()
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    bh, bn, warps = _tiles(h, d, q.dtype)
    _sparse_attn_dense_kernel[(t, triton.cdiv(h, bh))](
        q, keys, allowed, sink, out, keys.shape[0], h, float(scale),
        q.stride(0), q.stride(1), keys.stride(0), allowed.stride(0), out.stride(0), out.stride(1),
        D=d, BH=bh, BN=bn, IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=2)
    return out


def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                             scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, d]; kv: [R, d] (K = V rows); idx: [T, K] distinct row ids (-1 = none); sink: [H] -> [T, H, d]."""
    return sparse_attention_paged(q, kv, idx, kv, idx[:, :0], sink, scale, out=out)


def _rows(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    kv = kv.to(dtype)
    return kv if kv.stride(-1) == 1 else kv.contiguous()


def sparse_attention_paged(q: torch.Tensor, kv_a: torch.Tensor, idx_a: torch.Tensor, kv_b: torch.Tensor,
                           idx_b: torch.Tensor, sink: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, d]; query t's keys are rows kv_a[idx_a[t]] then kv_b[idx_b[t]] (kv_*: [R_*, d] row buffers,
    e.g. two paged caches; idx_*: [T, K_*] row ids, -1 = none) -> [T, H, d]. Nothing is gathered."""
    _check(q, q.shape[-1])
    return _launch(q, _rows(kv_a, q.dtype), idx_a, _rows(kv_b, q.dtype), idx_b, sink, scale, out, 0)


def sparse_attention_records(q: torch.Tensor, pages_a: torch.Tensor, idx_a: torch.Tensor, pages_b: torch.Tensor,
                             idx_b: torch.Tensor, rows_per_block: int, sink: torch.Tensor, scale: float,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_attention_paged` over two ``fp8_ds_mla`` record caches: q [T, H, 512]; pages_*: [B_*, P] uint8,
    `rows_per_block` records a block; idx_*: [T, K_*] flat record slots (-1 = none) -> [T, H, 512]. Each key
    block is dequantised in registers (the same values as the oracle's `kv_record_gather`); nothing is gathered."""
    _check(q, q.shape[-1])
    if q.shape[-1] != 512 or pages_a.dtype != torch.uint8 or pages_a.stride(1) != 1 or pages_b.stride(1) != 1:
        raise NotImplementedError("records: 512-wide queries over uint8 pages with contiguous bytes")
    return _launch(q, pages_a, idx_a, pages_b, idx_b, sink, scale, out, rows_per_block)


def _launch(q: torch.Tensor, kv_a: torch.Tensor, idx_a: torch.Tensor, kv_b: torch.Tensor, idx_b: torch.Tensor,
            sink: torch.Tensor, scale: float, out: torch.Tensor | None, rpb: int) -> torch.Tensor:
    """The indexed kernel over rows (rpb = 0) or records (rpb = records a block) of two buffers."""
    t, h, d = q.shape
    idx, idx2 = idx_a.to(torch.int32).contiguous(), idx_b.to(torch.int32).contiguous()
    sink = sink.float().contiguous()
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    bh, bn, warps = _tiles(h, d, q.dtype)
    ka, kb = idx.shape[1], idx2.shape[1]
    ksel = ka + kb
    split = SPLIT
    if split is None:  # split only while the unsplit grid would fill under a quarter of the SMs
        split = (not BATCH_INVARIANT and q.is_cuda and ksel > SPLIT_KEYS
                 and t * triton.cdiv(h, bh) < _num_sms(q.device) // 4)
    ieee = q.dtype == torch.float32
    if split and not ieee and TILES is None:
        bh, bn, warps = _SPLIT_TILES
    hb = triton.cdiv(h, bh)
    if not split:
        _sparse_attn_indexed_kernel[(t, hb, 1)](
            q, kv_a, idx, kv_b, idx2, sink, out, out, out, ka, kb, h, float(scale),
            q.stride(0), q.stride(1), kv_a.stride(0), idx.stride(0), kv_b.stride(0), max(idx2.stride(0), 1),
            out.stride(0), out.stride(1), 1, rpb,
            D=d, BH=bh, BN=bn, SPLIT=triton.cdiv(ksel, bn) * bn, PARTIAL=False, IEEE=ieee, RECORDS=rpb > 0,
            num_warps=warps, num_stages=STAGES)
        return out
    sk = max(SPLIT_KEYS, bn)
    ns = triton.cdiv(ksel, sk)
    po = torch.empty(t, ns, h, d, dtype=torch.float32, device=q.device)
    pml = torch.empty(t, ns, h, 2, dtype=torch.float32, device=q.device)
    _sparse_attn_indexed_kernel[(t, hb, ns)](
        q, kv_a, idx, kv_b, idx2, sink, out, po, pml, ka, kb, h, float(scale),
        q.stride(0), q.stride(1), kv_a.stride(0), idx.stride(0), kv_b.stride(0), max(idx2.stride(0), 1),
        out.stride(0), out.stride(1), ns, rpb,
        D=d, BH=bh, BN=bn, SPLIT=sk, PARTIAL=True, IEEE=ieee, RECORDS=rpb > 0, num_warps=warps,
        num_stages=STAGES)
    _combine_splits_kernel[(t, hb)](po, pml, sink, out, h, ns, out.stride(0), out.stride(1), D=d, BH=bh,
                                    num_warps=8)
    return out


def sparse_attention_gathered(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q: [T, H, d]; keys: [T, K, d] each query's own rows (K = V); valid: [T, K] -> [T, H, d].

    The indexed kernel over the flattened rows, query t reading rows t*K .. t*K+K-1; no host sync.
    """
    t, k = valid.shape
    own = torch.arange(t, device=q.device).unsqueeze(1) * k + torch.arange(k, device=q.device)
    idx = torch.where(valid, own, -1)
    return sparse_attention_indexed(q, keys.reshape(t * k, -1), idx, sink, scale)
