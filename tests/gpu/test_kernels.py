"""kernels_nvidia against the torch oracle (vllm_deepinfer.ops.reference).

Every check draws fresh random inputs (the seed is printed), poisons the output memory with NaN
before the kernel runs (an `out=` buffer or the caching allocator's freed block), and bounds the
relative error ||out - ref|| / ||ref|| with the oracle evaluated on the same inputs in fp32 (on the
CPU for fp32 inputs). Bounds: fp32 inputs 2e-5 (fp32 IEEE dot products; only the summation order
differs); bf16 inputs 1.5e-2 (bf16 operands of the tensor-core dot products and a bf16 output).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from vllm_deepinfer.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

BOUND = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def _seed() -> int:
    """A fresh seed per test (printed); KERNEL_TEST_SEED=N replays a failing one."""
    s = int(os.environ.get("KERNEL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(s)
    print("seed", s)
    return s


def _poison(device: str, nbytes: int = 256 << 20) -> None:
    """Fill a large freed block with NaN so that the next torch.empty calls reuse poisoned memory."""
    if device == "cuda":
        junk = torch.full((nbytes // 4,), float("nan"), device=device)
        del junk


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double().cpu(), want.double().cpu()
    assert torch.isfinite(out).all(), "non-finite (unwritten or NaN) output"
    return float((out - want).norm() / want.norm().clamp_min(1e-30))


def _small(device):
    return device == "cpu"  # Triton interpreter: keep shapes small


def _skip_interp_bf16_dot(device, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly (seen with triton 3.9)")


def _attn_inputs(device, dtype, t, h, n, d=512, density=0.3):
    q = torch.randn(t, h, d, device=device).to(dtype)
    keys = (torch.randn(n, d, device=device) * 0.5).to(dtype)
    allowed = torch.rand(t, n, device=device) < density
    allowed[:, 0] = True
    if t > 2:
        allowed[t // 2] = False  # a query that sees nothing: output must be 0 (all mass on the sink)
    sink = torch.randn(h, device=device)
    return q, keys, allowed, sink


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_sparse_attention_dense_mask(device, dtype, shape):
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, dtype)
    _seed()
    if shape == "decode":
        t, n = 1, (160 if _small(device) else 640)
    else:
        t, n = (8, 96) if _small(device) else (256, 1200)
    h = 16 if _small(device) else 64
    q, keys, allowed, sink = _attn_inputs(device, dtype, t, h, n)
    scale = 512 ** -0.5
    out = torch.full_like(q, float("nan"))
    if shape == "prefill" and device == "cuda":
        # the gather path (the default from GATHER_FROM_T queries) and the mask kernel both
        from kernels_nvidia import attention as kattn
        o2 = torch.full_like(q, float("nan"))
        old, kattn.GATHER_FROM_T = kattn.GATHER_FROM_T, 1 << 30
        try:
            kn.sparse_attention(q, keys, allowed, sink, scale, out=o2)
        finally:
            kattn.GATHER_FROM_T = old
        want = ref.sparse_attention(q.cpu(), keys.cpu(), allowed.cpu(), sink.cpu(), scale)
        err = _rel(o2, want)
        print(f"sparse_attention prefill mask-kernel {dtype}: rel err {err:.2e}")
        assert err < BOUND[dtype]
    kn.sparse_attention(q, keys, allowed, sink, scale, out=out)
    want = ref.sparse_attention(q.cpu(), keys.cpu(), allowed.cpu(), sink.cpu(), scale)
    err = _rel(out, want)
    print(f"sparse_attention {shape} {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_indexed(device, dtype, split, monkeypatch):
    from kernels_nvidia import attention as kattn
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, dtype)
    monkeypatch.setattr(kattn, "SPLIT", split)
    _seed()
    small = _small(device)
    t, h, rows, k = (4, 16, 200, 48) if small else (64, 64, 8192, 640)
    q = torch.randn(t, h, 512, device=device).to(dtype)
    kv = (torch.randn(rows, 512, device=device) * 0.5).to(dtype)
    idx = torch.stack([torch.randperm(rows, device=device)[:k] for _ in range(t)]).int()
    idx[torch.rand(t, k, device=device) < 0.2] = -1
    idx[0] = -1
    sink = torch.randn(h, device=device)
    out = torch.full_like(q, float("nan"))
    kn.sparse_attention_indexed(q, kv, idx, sink, 0.044, out=out)
    # oracle: the dense form over all rows with the selected ones allowed
    allowed = torch.zeros(t, rows + 1, dtype=torch.bool)
    allowed.scatter_(1, torch.where(idx.cpu() >= 0, idx.cpu().long(), rows), True)
    want = ref.sparse_attention(q.cpu(), kv.cpu(), allowed[:, :rows], sink.cpu(), 0.044)
    err = _rel(out, want)
    print(f"sparse_attention_indexed split={split} {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_gathered(device, dtype):
    """Decode path: each query's own gathered rows; invalid rows hold NaN and must not leak."""
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, dtype)
    _seed()
    t, h, k = (3, 16, 40) if _small(device) else (256, 64, 640)
    q = torch.randn(t, h, 512, device=device).to(dtype)
    keys = (torch.randn(t, k, 512, device=device) * 0.5).to(dtype)
    valid = torch.rand(t, k, device=device) < 0.7
    valid[0] = False
    keys[~valid] = float("nan")
    sink = torch.randn(h, device=device)
    out = kn.sparse_attention_gathered(q, keys, valid, sink, 0.044)
    want = ref.sparse_attention_gathered(q.cpu(), keys.cpu(), valid.cpu(), sink.cpu(), 0.044)
    err = _rel(out, want)
    print(f"sparse_attention_gathered {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,weighted", [((7, 5120), True), ((3, 16, 512), False), ((0, 64), True),
                                            ((5, 1280), True)])
def test_rms_norm(device, dtype, shape, weighted):
    from kernels_nvidia import ops as kn
    _seed()
    x = (torch.randn(*shape, device=device) * 3).to(dtype)
    w = torch.randn(shape[-1], device=device) if weighted else None
    out = kn.rms_norm(x, w, 1e-6)
    want = ref.rms_norm(x.cpu(), None if w is None else w.cpu(), 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    err = _rel(out, want) if x.numel() else 0.0
    print(f"rms_norm {shape} {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,half", [((9, 4, 512), 32), ((9, 512), 32), ((6, 32, 128), 32), ((5, 64), 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope(device, dtype, shape, half, inverse):
    from kernels_nvidia import ops as kn
    _seed()
    x = torch.randn(*shape, device=device).to(dtype)
    ang = torch.rand(shape[0], half, device=device) * 100
    cos, sin = ang.cos(), ang.sin()
    out = kn.apply_rope(x, cos, sin, inverse)
    want = ref.apply_rope(x.cpu(), cos.cpu(), sin.cpu(), inverse)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out[..., : shape[-1] - 2 * half].cpu(), x[..., : shape[-1] - 2 * half].cpu())  # copied part
    err = _rel(out, want)
    print(f"apply_rope {shape} inverse={inverse} {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


@pytest.mark.parametrize("scale", [1, 4, 128])
def test_rope_cos_sin(device, scale):
    """The step's cos / sin tables: bitwise the oracle on the same device on CUDA (fp64 angles, the CUDA math
    library's cos / sin, rounded to fp32); in the interpreter (numpy's fp64 cos / sin) within one fp32 ulp."""
    from kernels_nvidia import ops as kn
    _seed()
    pos = torch.randint(0, 1 << 20, (37,), device=device)
    pos[:3] = torch.tensor([0, 1, (1 << 20) - 1])
    inv_freq = torch.logspace(0, -6, 32, dtype=torch.float64, device=device)
    cos, sin = kn.rope_cos_sin(pos, inv_freq, scale)
    want = ref.rope_cos_sin(pos, inv_freq, scale)
    for got, w in zip((cos, sin), want):
        assert got.dtype == torch.float32 and got.shape == (37, 32)
        if device == "cuda":
            assert torch.equal(got, w)
        else:
            assert float((got - w).abs().max()) <= 6e-8
    assert kn.rope_cos_sin(pos[:0], inv_freq)[0].shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,half", [((9, 4, 512), 32), ((9, 512), 32), ((6, 20, 128), 32), ((5, 64), 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_in_place(device, dtype, shape, half, inverse):
    """The in-place form: bitwise the copying kernel, on x itself (also a column slice of a wider buffer)."""
    from kernels_nvidia import ops as kn
    _seed()
    wide = torch.randn(*shape[:-1], shape[-1] + 32, device=device).to(dtype)
    for x in (torch.randn(*shape, device=device).to(dtype), wide[..., 16:16 + shape[-1]]):
        ang = torch.rand(shape[0], half, device=device) * 100
        cos, sin = ang.cos(), ang.sin()
        want = kn.apply_rope(x, cos, sin, inverse)
        before = wide.clone()
        out = kn.apply_rope_(x, cos, sin, inverse)
        assert out is x and torch.equal(x, want)
        if x.data_ptr() != wide[..., 16:].data_ptr():
            continue
        assert torch.equal(wide[..., :16], before[..., :16]) and torch.equal(wide[..., -16:], before[..., -16:])


def _paged_vs_oracle(q, kv_a, idx_a, kv_b, idx_b, sink, label: str) -> torch.Tensor:
    """`sparse_attention_paged` (scale 0.044) within BOUND of the oracle on the same inputs; returns the output."""
    from kernels_nvidia import ops as kn
    out = kn.sparse_attention_paged(q, kv_a, idx_a, kv_b, idx_b, sink, 0.044)
    want = ref.sparse_attention_paged(q.cpu(), kv_a.cpu(), idx_a.cpu(), kv_b.cpu(), idx_b.cpu(), sink.cpu(), 0.044)
    err = _rel(out, want)
    print(f"sparse_attention_paged {label}: rel err {err:.2e}")
    assert err < BOUND[q.dtype]
    return out


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_paged(device, dtype, split, monkeypatch):
    """Decode path: window rows from one paged buffer then compressed rows from another, read in place;
    rows of other requests hold NaN and must not leak."""
    from kernels_nvidia import attention as kattn
    _skip_interp_bf16_dot(device, dtype)
    monkeypatch.setattr(kattn, "SPLIT", split)
    _seed()
    t, h, (ra, ka), (rb, kb) = (3, 16, (64, 16), (96, 40)) if _small(device) else (64, 64, (9000, 128), (20000, 512))
    q = torch.randn(t, h, 512, device=device).to(dtype)
    kv_a = torch.full((ra, 512), float("nan"), device=device).to(dtype)
    kv_b = torch.full((rb, 512), float("nan"), device=device).to(dtype)
    idx_a = torch.stack([torch.randperm(ra, device=device)[:ka] for _ in range(t)])
    idx_b = torch.stack([torch.randperm(rb, device=device)[:kb] for _ in range(t)])
    idx_a[torch.rand(t, ka, device=device) < 0.2] = -1
    idx_b[torch.rand(t, kb, device=device) < 0.4] = -1
    idx_b[0] = -1
    for kv, idx in ((kv_a, idx_a), (kv_b, idx_b)):  # only the selected rows are finite
        used = idx[idx >= 0]
        kv[used] = (torch.randn(used.numel(), 512, device=device) * 0.5).to(dtype)
    sink = torch.randn(h, device=device)
    _paged_vs_oracle(q, kv_a, idx_a, kv_b, idx_b, sink, f"split={split} {dtype}")


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_paged_id_layout(device, dtype, split, monkeypatch):
    """The model's id layouts: window ids lead with -1 (a token near its request's start), selected ids trail
    with -1 (fewer rows than the top-k width). The kernel walks only the blocks between a token's first and last
    valid id; against the oracle, and bitwise unchanged when the id matrices are padded with more -1 columns."""
    from kernels_nvidia import attention as kattn
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, dtype)
    monkeypatch.setattr(kattn, "SPLIT", split)
    monkeypatch.setattr(kattn, "SPLIT_KEYS", 32 if _small(device) else 128)
    _seed()
    t, h, w, k, rows = (4, 16, 16, 40, 128) if _small(device) else (64, 64, 128, 512, 8192)
    q = torch.randn(t, h, 512, device=device).to(dtype)
    kv_a = (torch.randn(rows, 512, device=device) * 0.5).to(dtype)
    kv_b = (torch.randn(rows, 512, device=device) * 0.5).to(dtype)
    cols_a, cols_b = torch.arange(w, device=device), torch.arange(k, device=device)
    first = torch.randint(0, w + 1, (t,), device=device)          # window ids before `first` are -1
    count = torch.randint(0, k + 1, (t,), device=device)          # selected ids past `count` are -1
    count[0], first[0] = 0, w                                     # a token with no key: the sink only
    idx_a = torch.where(cols_a >= first[:, None], torch.randint(0, rows, (t, w), device=device), -1)
    idx_b = torch.where(cols_b < count[:, None], torch.randint(0, rows, (t, k), device=device), -1)
    sink = torch.randn(h, device=device)
    out = _paged_vs_oracle(q, kv_a, idx_a, kv_b, idx_b, sink, f"id layout split={split} {dtype}")
    pad = torch.full((t, 3 * w), -1, dtype=idx_b.dtype, device=device)
    again = kn.sparse_attention_paged(q, kv_a, idx_a, kv_b, torch.cat([idx_b, pad], 1), sink, 0.044)
    assert torch.equal(out, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_paged(device, dtype):
    """Decode indexer: each token scores its own request's rows through its block-table row, -inf past its
    visible count (blocks past it do no work); rows of other requests hold NaN and must not leak."""
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, dtype)
    _seed()
    t, hi, rpb, nb = (3, 16, 16, 6) if _small(device) else (64, 32, 128, 40)
    n_rows = nb * rpb + 1  # one past the table: clamped like the cache's own addressing
    keys = torch.full((t * nb * rpb + rpb, 128), float("nan"), device=device).to(dtype)
    table = (1 + torch.randperm(t * nb, device=device).view(t, nb)).int()  # block 0 = vLLM's null block
    n_valid = torch.randint(0, n_rows, (t,), device=device)
    n_valid[0] = 0
    for r in range(t):  # fill the visible rows of each token's own blocks
        rows = torch.arange(int(n_valid[r]), device=device)
        slots = table[r, rows // rpb].long() * rpb + rows % rpb
        keys[slots] = torch.randn(rows.numel(), 128, device=device).to(dtype)
    q = torch.randn(t, hi, 128, device=device).to(dtype)
    w = torch.randn(t, hi, device=device) * 0.1
    out = kn.indexer_scores_paged(q, w, keys, table, n_valid, n_rows, rpb)
    want = ref.indexer_scores_paged(q.cpu(), w.cpu(), keys.cpu(), table.cpu(), n_valid.cpu(), n_rows, rpb)
    assert torch.equal(torch.isinf(out.cpu()), torch.isinf(want)) and out.shape == (t, n_rows)
    fin = torch.isfinite(want)
    err = _rel(out.cpu()[fin], want[fin]) if fin.any() else 0.0
    print(f"indexer_scores_paged {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_as_rows", [True, False])
def test_indexer_scores(device, dtype, heads_as_rows, monkeypatch):
    from kernels_nvidia import indexer as kidx
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, dtype)
    monkeypatch.setattr(kidx, "HEADS_AS_ROWS", heads_as_rows)
    _seed()
    t, hi, n = (5, 8, 70) if _small(device) else (300, 64, 3000)
    q = torch.randn(t, hi, 128, device=device).to(dtype)
    w = torch.randn(t, hi, device=device) * 0.1
    keys = torch.randn(n, 128, device=device).to(dtype)
    out = torch.full((t, n), float("nan"), device=device)
    kn.indexer_scores(q, w, keys, out=out)
    want = ref.indexer_scores(q.cpu(), w.cpu(), keys.cpu())
    err = _rel(out, want)
    print(f"indexer_scores heads_as_rows={heads_as_rows} {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_ragged(device, dtype):
    """Varlen prefill scores: spans of a packed key buffer, tokens with 0..all visible rows, column
    blocks past a token's count (-inf, nothing loaded)."""
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, dtype)
    _seed()
    spans = [(3, 40), (6, 7), (4, 0)] if _small(device) else [(700, 900), (300, 200), (16, 3000), (5, 1)]
    hi = 16 if _small(device) else 64
    starts, counts, rows = [], [], 0
    for n_tok, n_rows in spans:
        starts += [rows] * n_tok
        counts += torch.randint(0, n_rows + 1, (n_tok,)).tolist()
        counts[-1] = n_rows
        rows += n_rows
    t, n_cols = len(starts), max(r for _, r in spans)
    q = torch.randn(t, hi, 128, device=device).to(dtype)
    w = torch.randn(t, hi, device=device) * 0.1
    keys = torch.randn(rows, 128, device=device).to(dtype)
    ks, nk = (torch.tensor(v, device=device) for v in (starts, counts))
    _poison(device)
    out = kn.indexer_scores_ragged(q, w, keys, ks, nk, n_cols)
    want = ref.indexer_scores_ragged(q.cpu().float(), w.cpu(), keys.cpu().float(), ks.cpu(), nk.cpu(), n_cols)
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(out.cpu()), inf) and (out.cpu()[inf] < 0).all()
    err = _rel(out.cpu()[~inf], want[~inf])
    print(f"indexer_scores_ragged {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


def test_topk_rows_matches_stable_sort(device):
    from kernels_nvidia import ops as kn
    _seed()
    t, n = (6, 50) if _small(device) else (200, 5000)
    s = torch.randn(t, n, device=device)
    s = torch.round(s * 4) / 4                      # many ties
    s[s.abs() < 0.1] = -0.0                         # signed zeros tie with +0.0
    s[torch.rand(t, n, device=device) < 0.3] = float("-inf")
    s[0, 3] = float("inf")
    s[1, 10:] = float("-inf")                       # fewer than k finite entries
    for k in (7, n // 2, n + 5):
        _poison(device)
        got = kn.topk_rows_packed(s, k)
        want = ref.topk_rows(s.cpu(), k)
        assert torch.equal(got.cpu(), want), f"k={k}"


def _split_rows(monkeypatch, device, split: bool) -> None:
    """split: cut every row into many small ranges (several programs per row, several steps per program)."""
    from kernels_nvidia import topk
    if split:
        monkeypatch.setattr(topk, "BLOCK", 32 if _small(device) else 256)
        monkeypatch.setattr(topk, "WAVES", 1 << 12)


def _check_topk(s: torch.Tensor, k: int, n_valid: torch.Tensor | None = None) -> None:
    """kernels_nvidia.topk_rows bitwise equal to the oracle (which reads the whole row; past n_valid the
    kernel must read nothing, so those entries are set to -inf for the oracle only)."""
    from kernels_nvidia import ops as kn
    want_in = s.cpu().clone()
    if n_valid is not None:
        want_in[torch.arange(s.shape[1]) >= n_valid.cpu().unsqueeze(1)] = float("-inf")
    _poison(s.device.type)
    got = kn.topk_rows(s, k, n_valid)
    assert got.shape == (s.shape[0], k) and got.dtype == torch.int64
    assert torch.equal(got.cpu(), ref.topk_rows(want_in, k)), f"N={s.shape[1]} k={k}"


@pytest.mark.parametrize("split", [False, True])
def test_topk_rows_radix_ties_and_specials(device, split, monkeypatch):
    """Ties (quantised scores, signed zeros), +inf forced entries, NaN, rows of fewer than k finite entries,
    k > N, with and without n_valid."""
    _split_rows(monkeypatch, device, split)
    _seed()
    t, n = (6, 120) if _small(device) else (64, 2000)
    s = torch.round(torch.randn(t, n, device=device) * 4) / 4          # many ties
    s[s.abs() < 0.1] = -0.0
    s[(s == 0) & (torch.rand(t, n, device=device) < 0.5)] = 0.0          # signed zeros: -0.0 ties with +0.0
    s[torch.rand(t, n, device=device) < 0.3] = float("-inf")
    s[0, 3] = s[0, n - 1] = s[2, 5] = float("inf")
    s[3, 7], s[3, 1] = float("nan"), -torch.tensor(float("nan"))       # NaN of both signs: first, -> -1
    s[1, 10:] = float("-inf")                                          # fewer than k finite entries
    n_valid = torch.randint(0, n + 1, (t,), device=device)
    n_valid[0], n_valid[1] = n, 0
    s[torch.arange(n, device=device) >= n_valid.unsqueeze(1)] = float("-inf")
    for k in (1, 7, 64, n // 2, n, n + 5):
        _check_topk(s, k, n_valid)
        _check_topk(s, k)


@pytest.mark.parametrize("split", [False, True])
def test_topk_rows_radix_equal_rows(device, split, monkeypatch):
    """Rows of one value (every key a tie): finite, +inf, -inf, zeros of both signs, NaN; a row differing
    from a constant one in its last bit."""
    _split_rows(monkeypatch, device, split)
    n = 60 if _small(device) else 2000
    s = torch.ones(6, n, device=device)
    s[1], s[2], s[4] = float("inf"), float("-inf"), float("nan")
    s[3] = torch.where(torch.arange(n, device=device) % 2 == 0, 0.0, -0.0)
    s[5, n // 3] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    n_valid = torch.tensor([n, n, n, n // 2, 3, n], device=device)
    for k in (1, 16, n // 2, n - 1, n, 2 * n):
        _check_topk(s, k)
        _check_topk(s, k, n_valid)


@pytest.mark.parametrize("split", [False, True])
def test_topk_rows_radix_random_widths(device, split, monkeypatch):
    """Random widths, lengths and k; continuous scores (the decode case) and int64 / int32 n_valid."""
    _split_rows(monkeypatch, device, split)
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4 if _small(device) else 12):
        n = int(torch.randint(1, 400 if _small(device) else 40000, (), generator=gen))
        t = int(torch.randint(1, 5 if _small(device) else 300, (), generator=gen))
        k = int(torch.randint(1, min(n + 8, 2048) + 1, (), generator=gen))
        n_valid = torch.randint(0, n + 1, (t,), generator=gen).to(device)
        s = torch.randn(t, n, device=device).relu_()                   # relu'd scores: many zeros
        s[torch.arange(n, device=device) >= n_valid.unsqueeze(1)] = float("-inf")
        _check_topk(s, k, n_valid.int() if n % 2 else n_valid)


def test_topk_rows_radix_long_rows_short_prefix(device):
    """The decode shape: a wide fixed row (max_model_len / ratio + 1 columns), short valid prefixes; the
    entries past n_valid hold NaN / +inf / finite junk that the kernel must never read. Also a strided view."""
    _seed()
    t, n, ks = (3, 20001, (16, 100)) if _small(device) else (64, 262145, (512, 1024, 2048, 4096))
    top = 300 if _small(device) else 4096
    s = torch.randn(t, n, device=device)
    s[:, 1::3] = float("nan")
    s[:, 2::5] = float("inf")
    n_valid = torch.randint(0, top, (t,), device=device)
    n_valid[0] = 0
    clean = s.masked_fill(torch.arange(n, device=device) >= n_valid.unsqueeze(1), float("-inf"))
    clean[clean.isnan()] = 1.5
    clean[torch.isinf(clean) & (clean > 0)] = -2.0
    padded = torch.full((t, n + 7), float("inf"), device=device)
    padded[:, :n] = torch.where(torch.arange(n, device=device) < n_valid.unsqueeze(1), clean, s)
    for k in ks:
        _check_topk(padded[:, :n], k, n_valid)
        _check_topk(clean, k, n_valid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wide", [False, True], ids=["decode-tiles", "prefill-tiles"])
def test_hc_coefficients(device, dtype, wide, monkeypatch):
    from kernels_nvidia import mhc
    from kernels_nvidia import ops as kn
    _seed()
    h, d = 4, (256 if _small(device) else 4096)
    t = 7 if _small(device) else 333
    monkeypatch.setattr(mhc, "WIDE_FROM_T", 1 if wide else t + 1)
    m = (2 + h) * h
    streams = torch.randn(t, h, d, device=device).to(dtype)
    fn = torch.randn(m, h * d, device=device) * 0.02
    base = torch.randn(m, device=device) * 0.1
    scale = torch.rand(3, device=device) + 0.5
    _poison(device)
    got = kn.hc_coefficients(streams, fn, base, scale, 1e-6, 1e-6, 20)
    want = ref.hc_coefficients(streams.cpu(), fn.cpu(), base.cpu(), scale.cpu(), 1e-6, 1e-6, 20)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        err = _rel(g, w)
        print(f"hc_coefficients {name} {dtype}: rel err {err:.2e}")
        assert err < 1e-4  # fp32 math on both sides; split-K changes the summation order only


def test_hc_coefficients_from_partials(device):
    """The finalize step on partials made elsewhere (DeepGEMM's layout: [S, T, (2+h)h] and [S, T], uneven splits)."""
    from kernels_nvidia import mhc
    _seed()
    h, d, t = 4, 256, 9
    m, k = (2 + h) * h, h * d
    streams = torch.randn(t, h, d, device=device).to(torch.bfloat16)
    fn = torch.randn(m, k, device=device) * 0.02
    base = torch.randn(m, device=device) * 0.1
    scale = torch.rand(3, device=device) + 0.5
    x = streams.reshape(t, k).float()
    cuts = [0, 100, 640, k]  # three splits of unequal width
    part = torch.stack([x[:, a:b] @ fn[:, a:b].t() for a, b in zip(cuts, cuts[1:])])
    sq = torch.stack([x[:, a:b].square().sum(-1) for a, b in zip(cuts, cuts[1:])])
    got = mhc.hc_coefficients_from_partials(part, sq, base, scale, k, 1e-6, 1e-6, 20, h)
    want = ref.hc_coefficients(streams.cpu(), fn.cpu(), base.cpu(), scale.cpu(), 1e-6, 1e-6, 20)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        assert _rel(g, w) < 1e-4, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_collapse_expand(device, dtype):
    from kernels_nvidia import ops as kn
    _seed()
    h, d = 4, (256 if _small(device) else 4096)
    t = 5 if _small(device) else 257
    streams = torch.randn(t, h, d, device=device).to(dtype)
    w = torch.rand(t, h, device=device)
    y = torch.randn(t, d, device=device).to(dtype)
    post = torch.rand(t, h, device=device) * 2
    comb = torch.rand(t, h, h, device=device)
    _poison(device)
    u = kn.hc_collapse(streams, w)
    err = _rel(u, ref.hc_collapse(streams.cpu(), w.cpu()))
    print(f"hc_collapse {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype] / 2
    _poison(device)
    x = kn.hc_expand(streams, y, post, comb)
    err = _rel(x, ref.hc_expand(streams.cpu(), y.cpu(), post.cpu(), comb.cpu()))
    print(f"hc_expand {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype] / 2


@pytest.mark.parametrize("slots,width", [(2, 512), (8, 1024), (128, 512)])
def test_softmax_pool(device, slots, width):
    from kernels_nvidia import ops as kn
    _seed()
    g = 3 if _small(device) else 517
    if _small(device):
        width = 64
    v = torch.randn(g, slots, width, device=device)
    lg = torch.randn(g, slots, width, device=device) * 3
    if slots == 8:
        lg[0, :4] = float("-inf")  # CSA group 0: no previous block
    _poison(device)
    got = kn.softmax_pool(v, lg)
    err = _rel(got, ref.softmax_pool(v.cpu(), lg.cpu()))
    print(f"softmax_pool S={slots}: rel err {err:.2e}")
    assert err < 2e-6


def test_batch_invariance(device, monkeypatch):
    """A token's result does not depend on the other tokens of the batch (bitwise), in the default
    mode for every kernel but the gather attention and the mHC coefficients' prefill tiles, and for those in
    KERNELS_NVIDIA_BATCH_INVARIANT mode."""
    from kernels_nvidia import attention as kattn
    from kernels_nvidia import mhc
    from kernels_nvidia import ops as kn
    _skip_interp_bf16_dot(device, torch.bfloat16)
    monkeypatch.setattr(kattn, "BATCH_INVARIANT", True)
    monkeypatch.setattr(mhc, "BATCH_INVARIANT", True)
    monkeypatch.setattr(mhc, "WIDE_FROM_T", 2)  # invariant mode keeps the decode tiles above the threshold too
    _seed()
    small = _small(device)
    h, n = (16, 96) if small else (64, 700)
    q, keys, allowed, sink = _attn_inputs(device, torch.bfloat16, 9 if small else 100, h, n)
    full = kn.sparse_attention(q, keys, allowed, sink, 0.05)
    one = kn.sparse_attention(q[3:4].clone(), keys, allowed[3:4].clone(), sink, 0.05)
    assert torch.equal(full[3:4], one)
    qi = torch.randn(q.shape[0], 16 if small else 64, 128, device=device).to(torch.bfloat16)
    wi = torch.randn(q.shape[0], qi.shape[1], device=device)
    si = kn.indexer_scores(qi, wi, keys[:, :128].contiguous())
    s1 = kn.indexer_scores(qi[5:6].clone(), wi[5:6].clone(), keys[:, :128].contiguous())
    assert torch.equal(si[5:6], s1)
    st = torch.randn(q.shape[0], 4, 256 if small else 4096, device=device).to(torch.bfloat16)
    fn = torch.randn(24, st.shape[1] * st.shape[2], device=device) * 0.02
    b, sc = torch.randn(24, device=device), torch.rand(3, device=device)
    pa = kn.hc_coefficients(st, fn, b, sc, 1e-6, 1e-6, 20)
    p1 = kn.hc_coefficients(st[2:3].clone(), fn, b, sc, 1e-6, 1e-6, 20)
    for a, c in zip(pa, p1):
        assert torch.equal(a[2:3], c)

    pool = torch.randn(5000, 512, device=device).to(torch.bfloat16)
    qq = torch.randn(300 if not small else 5, 64 if not small else 16, 512, device=device).to(torch.bfloat16)
    ii = torch.stack([torch.randperm(5000, device=device)[:640] for _ in range(qq.shape[0])]).int()
    sk = torch.randn(qq.shape[1], device=device)
    a = kn.sparse_attention_indexed(qq, pool, ii, sk, 0.05)
    b = kn.sparse_attention_indexed(qq[1:2].clone(), pool, ii[1:2].clone(), sk, 0.05)
    assert torch.equal(a[1:2], b)


def test_dispatch_uses_kernels(device):
    """vllm_deepinfer.ops routes CUDA tensors to kernels_nvidia and agrees with the oracle."""
    if device != "cuda":
        pytest.skip("dispatch selects kernels for CUDA tensors only")
    import vllm_deepinfer.ops as ops
    _seed()
    x = torch.randn(3, 4, 64, device=device)
    assert ops.backend_for(x) == "kernels_nvidia"
    assert ops.backend_for(x.cpu()) == "reference"
    w = torch.rand(3, 4, device=device)
    assert _rel(ops.hc_collapse(x, w), ref.hc_collapse(x.cpu(), w.cpu())) < 1e-6
    s = torch.randn(4, 100, device=device)
    assert torch.equal(ops.topk_rows(s, 10).cpu(), ref.topk_rows(s.cpu(), 10))
    n_valid = torch.tensor([0, 5, 50, 100], device=device)
    s = s.masked_fill(torch.arange(100, device=device) >= n_valid.unsqueeze(1), float("-inf"))
    assert torch.equal(ops.topk_rows(s, 10, n_valid).cpu(), ref.topk_rows(s.cpu(), 10))
    assert torch.equal(ops.topk_rows(s, 5000, n_valid).cpu(), ref.topk_rows(s.cpu(), 5000))  # k > MAX_K: oracle


@pytest.mark.parametrize("tokens_per_row,block_size", [(1, 64), (4, 256), (128, 2048)])
def test_row_and_range_slots(device, tokens_per_row, block_size):
    """Paged slots equal the oracle's exactly: explicit ids (plain, masked with -1s, negative ids unmasked,
    with `keep`), 1-D and 2-D, and id ranges with and without an upper bound; ids past the table clamp."""
    from kernels_nvidia import paging

    _seed()
    rpb = block_size // tokens_per_row
    n_req, n_blocks, t, k = 5, 7, 9, 37
    bt = torch.randint(1, 500, (n_req, n_blocks), dtype=torch.int32, device=device)
    req = torch.randint(0, n_req, (t,), device=device)
    hi = n_blocks * rpb + 3 * rpb  # some ids past the table
    ids = torch.randint(-3, hi, (t, k), device=device)
    keep = torch.rand(t, device=device) < 0.6
    args = (tokens_per_row, block_size, rpb)
    for masked in (False, True):
        for kp in (None, keep):
            want = ref.row_slots(bt, req.unsqueeze(1), ids, *args, masked=masked, keep=kp)
            assert torch.equal(paging.row_slots(bt, req.unsqueeze(1), ids, *args, masked=masked, keep=kp), want)
            want1 = ref.row_slots(bt, req, ids[:, 0], *args, masked=masked, keep=kp)
            assert torch.equal(paging.row_slots(bt, req, ids[:, 0], *args, masked=masked, keep=kp), want1)
    start = torch.randint(-40, hi, (t,), device=device)
    stop = torch.randint(0, hi, (t,), device=device)
    for s in (None, stop):
        assert torch.equal(paging.range_slots(bt, req, start, k, s, *args),
                           ref.range_slots(bt, req, start, k, s, *args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,inter", [(7, 2048), (3, 1000), (0, 64)])
def test_swiglu(device, dtype, t, inter):
    """Both halves of one [T, 2I] product (strided rows), values past the clamp limit included."""
    from kernels_nvidia import ops as kn
    _seed()
    h = (torch.randn(t, 2 * inter, device=device) * 6).to(dtype)
    a, b = h[:, :inter], h[:, inter:]
    out = kn.swiglu(a, b, 7.0)
    want = ref.swiglu(a.cpu(), b.cpu(), 7.0)
    assert out.dtype == dtype and out.shape == a.shape
    err = _rel(out, want) if a.numel() else 0.0
    print(f"swiglu {t}x{inter} {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]


def _route_check(logits, bias, k, scale, forced=None, exact_ids=True) -> float:
    """kernels_nvidia.sqrtsoftplus_route against the CPU oracle (bias None: a zero bias for the oracle, which needs
    one): ids equal (exact_ids; else rows that differ must hold near-equal biased scores, <= 1e-6 relative, in at
    most 1% of rows: continuous scores whose last bits differ between libraries), weights within 1e-6 relative,
    NaN where the oracle's are. On CUDA also against the oracle on the GPU (torch's CUDA softplus, sqrt and sum):
    ids and weights bitwise. Returns the largest relative weight difference to the CPU oracle."""
    from kernels_nvidia import ops as kn
    t, e = logits.shape
    _poison(logits.device.type)
    ids, w = kn.sqrtsoftplus_route(logits, bias, k, scale, forced)
    assert ids.shape == (t, k) and ids.dtype == torch.int64 and w.shape == (t, k) and w.dtype == torch.float32
    cpu_bias = torch.zeros(e) if bias is None else bias.cpu()
    # the oracle in batch-invariant mode: torch's CPU softplus rounds the vectorized loop and the scalar tail
    # differently, so equal logits would not give equal scores (ties) in the default mode
    invariant, ref.BATCH_INVARIANT = ref.BATCH_INVARIANT, True
    try:
        want_ids, want_w = ref.sqrtsoftplus_route(logits.cpu(), cpu_bias, k, scale,
                                                  None if forced is None else forced.cpu())
        biased = torch.sqrt(ref.elementwise(torch.nn.functional.softplus, logits.cpu().float())) + cpu_bias
    finally:
        ref.BATCH_INVARIANT = invariant
    got_ids, got_w = ids.cpu(), w.cpu()
    if exact_ids or forced is not None:
        assert torch.equal(got_ids, want_ids)
    else:
        bad = (got_ids != want_ids).any(-1)
        assert int(bad.sum()) <= max(1, t // 100), f"{int(bad.sum())} of {t} rows select other ids"
        assert torch.allclose(biased.gather(-1, got_ids[bad]), biased.gather(-1, want_ids[bad]), rtol=1e-6, atol=0)
        got_w, want_w = got_w[~bad], want_w[~bad]
    nan = want_w.isnan()
    assert torch.equal(got_w.isnan(), nan)
    err = float(((got_w - want_w).abs() / want_w.abs().clamp_min(1e-30))[~nan].max()) if (~nan).any() else 0.0
    assert err <= 1e-6, err
    if logits.device.type == "cuda":
        # the oracle on the GPU (same library functions: its scores are the kernel's bitwise): the same ids; the
        # weights bitwise torch's evaluation of the kernel's expression (the sum in id order), and within 1e-6 of
        # the oracle's (its sum order depends on T)
        g_bias = torch.zeros(e, device=logits.device) if bias is None else bias
        g_ids, g_w = ref.sqrtsoftplus_route(logits, g_bias, k, scale, forced)
        assert torch.equal(ids, g_ids)
        picked = torch.sqrt(torch.nn.functional.softplus(logits.float())).gather(-1, ids)
        total = picked[:, :1].clone()
        for i in range(1, k):
            total = total + picked[:, i:i + 1]
        same_w = scale * picked / (total + 1e-20)
        nan = same_w.isnan()
        assert torch.equal(w.isnan(), nan) and torch.equal(w[~nan], same_w[~nan])
        assert torch.equal(g_w.isnan(), nan)
        if (~nan).any():
            assert float(((w - g_w).abs() / g_w.abs().clamp_min(1e-30))[~nan].max()) <= 1e-6
    return err


@pytest.mark.parametrize("e,k", [(384, 6), (8, 2), (16, 6), (8, 8), (100, 7), (9, 1), (512, 8)])
def test_sqrtsoftplus_route_ties(device, e, k):
    """Logits and biases on coarse grids (exact ties of score + bias, scores well apart otherwise): rows of one
    value, pairs of equal experts, a bias that makes ties, per-token ([T, E]) and shared ([E]) bias and no bias,
    a strided logits view, T = 1 and T = 0."""
    _seed()
    t = 12 if _small(device) else 300
    wide = torch.randint(-24, 25, (t, e + 3), device=device).float() / 8      # 1/8 grid in [-3, 3]
    logits = wide[:, :e]                                                      # strided rows
    logits[0] = 0.0                                                           # every expert ties
    logits[1, 1::2] = logits[1, ::2][: e // 2]                                # pairs of equal experts
    logits[2, :] = 1.0
    logits[2, e // 2:] = 0.5
    bias = torch.randint(-3, 4, (e,), device=device).float() / 10              # ties of score + bias
    bias_t = torch.randint(-3, 4, (t, e), device=device).float() / 10
    bias_t[3] = 0.0
    logits[4] = 0.0
    bias_t[4, ::3] = 0.2                                                      # ties made by the bias alone
    errs = [_route_check(logits, b, k, 2.5) for b in (bias, bias_t, None)]
    errs.append(_route_check(logits[5:6], bias_t[5:6], k, 1.0))             # T = 1
    errs.append(_route_check(logits[:0], bias, k, 1.0))                       # T = 0
    print(f"sqrtsoftplus_route ties E={e} K={k}: max rel weight diff {max(errs):.2e}")


def test_sqrtsoftplus_route_specials(device):
    """-inf logits (score 0: ties with underflowing logits), logits past the softplus threshold 20 and huge ones,
    +inf, NaN of both signs in the logits and inf - inf in score + bias (NaN: picked first, lowest id first, as the
    oracle's sort; weights NaN), -inf and +inf bias entries, a row with fewer than K nonzero scores."""
    _seed()
    e, k = 40, 6
    logits = torch.randint(-16, 17, (9, e), device=device).float() / 4
    logits[0, :] = float("-inf")
    logits[0, [3, 7]] = -200.0                                                 # exp underflows: score 0, ties -inf
    logits[1, :] = -104.0                                                      # denormal softplus
    logits[1, 5] = -87.0
    logits[2, [1, 2, 30]] = torch.tensor([20.0, 21.0, 1e30], device=device)    # at / past the threshold
    logits[3, 9] = float("inf")
    logits[4, 11], logits[4, 3] = float("nan"), -torch.tensor(float("nan"))
    logits[5, 20] = float("inf")                                               # + bias -inf below: NaN
    logits[6, :] = -1000.0
    logits[6, [2, 33]] = 1.0                                                   # two nonzero scores, K = 6
    bias = torch.randint(-3, 4, (e,), device=device).float() / 10
    bias[[0, 20]] = float("-inf")
    bias[25] = float("inf")
    errs = [_route_check(logits, b, k, 1.5) for b in (bias, None)]
    print(f"sqrtsoftplus_route specials: max rel weight diff {max(errs):.2e}")


@pytest.mark.parametrize("e,k", [(384, 6), (16, 2), (8, 1)])
def test_sqrtsoftplus_route_random(device, e, k):
    """Continuous logits (the model's case) with a continuous per-token bias, and forced ids (hash layers:
    int32 and int64, a strided view); on CUDA the decode and prefill sizes. Row results do not depend on the
    batch (bitwise)."""
    _seed()
    from kernels_nvidia import ops as kn
    t = 16 if _small(device) else 4096
    logits = torch.randn(t, e, device=device) * 2
    bias = torch.randn(t, e, device=device) * 0.1
    errs = [_route_check(logits, bias, k, 2.5, exact_ids=False), _route_check(logits, bias[0], k, 2.5, exact_ids=False)]
    forced = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
    errs.append(_route_check(logits, None, k, 1.5, forced))
    errs.append(_route_check(logits, bias, k, 1.5, forced.int()))
    wide = torch.cat((forced, forced), dim=1)
    errs.append(_route_check(logits, None, k, 1.5, wide[:, k:]))
    print(f"sqrtsoftplus_route random E={e} K={k}: max rel weight diff {max(errs):.2e}")
    ids, w = kn.sqrtsoftplus_route(logits, bias, k, 2.5)
    one = kn.sqrtsoftplus_route(logits[3:4].clone(), bias[3:4].clone(), k, 2.5)
    assert torch.equal(ids[3:4], one[0]) and torch.equal(w[3:4], one[1])


def test_sqrtsoftplus_route_bias_vl(device):
    """V4.1 image tokens (lo <= id < hi) biased by bias_vl inside the kernel, ids written as int32: bitwise the
    kernel on the per-token bias rows that torch.where builds (the model's former per-layer path), and the ids
    the oracle's with the same `vl` argument."""
    from kernels_nvidia import ops as kn
    _seed()
    t, e, k, lo, hi = 37, 384, 6, 1000, 1100
    logits = torch.randn(t, e, device=device)
    bias, bias_vl = torch.randn(e, device=device) * 0.3, torch.randn(e, device=device) * 0.3
    token_ids = torch.randint(900, 1200, (t,), device=device)
    token_ids[:3] = torch.tensor([lo - 1, lo, hi - 1], device=device)
    token_ids[3] = hi
    rows = torch.where(((token_ids >= lo) & (token_ids < hi)).unsqueeze(-1), bias_vl, bias)
    want_ids, want_w = kn.sqrtsoftplus_route(logits, rows, k, 2.5)
    ids, w = kn.sqrtsoftplus_route(logits, bias, k, 2.5, vl=(bias_vl, token_ids, lo, hi), ids_dtype=torch.int32)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids) and torch.equal(w, want_w)
    ref_ids, _ = ref.sqrtsoftplus_route(logits.cpu(), bias.cpu(), k, 2.5, vl=(bias_vl.cpu(), token_ids.cpu(), lo, hi))
    assert torch.equal(ref_ids, ref.sqrtsoftplus_route(logits.cpu(), rows.cpu(), k, 2.5)[0])


@pytest.mark.parametrize("image", [None, (900, 905)])
def test_engram_hash(device, image):
    """The n-gram hash kernel bitwise the oracle: real multipliers (non-negative terms) and, to exercise the
    wrapping int64 products and Python's modulo sign, multipliers that overflow; missing and image tokens."""
    from kernels_nvidia import ops as kn
    from vllm_deepinfer.checkpoint import engram_hash
    _seed()
    k, heads, n = 4, 8, 70
    primes = torch.tensor(engram_hash.bucket_primes(5000, heads, k, 1)[0], device=device)
    offs = torch.tensor(engram_hash.bucket_offsets([primes.tolist()])[0], device=device)
    token_map = torch.randint(0, 700, (1000,), device=device)
    hist = torch.randint(0, 1200, (n, k), device=device)        # ids past the map clamp to its last entry
    hist[:10, :2] = torch.tensor([901, 904], device=device)
    valid = torch.rand(n, k, device=device) > 0.1
    for mult in (torch.tensor(engram_hash.hash_multipliers(2, 700, k), device=device),
                 torch.randint(1 << 60, 1 << 62, (k,), device=device) * 7 + 1):
        got = kn.engram_hash(hist, valid, token_map, mult, primes, offs, 5, image)
        want = ref.engram_hash(hist.cpu(), valid.cpu(), token_map.cpu(), mult.cpu(), primes.cpu(), offs.cpu(), 5,
                               image)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)


def test_fp8_rows(device):
    """Row-FP8 table rows decoded (gathered by id, and all rows in order): bitwise the oracle, including -0, the
    largest codes, subnormal codes and the smallest scale byte (2^-127)."""
    from kernels_nvidia import ops as kn
    _seed()
    codes = torch.randint(0, 256, (300, 256), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E                      # no NaN codes (tables are validated at load)
    codes[0, :4] = torch.tensor([0x80, 0x7E, 0xFE, 0x01], dtype=torch.uint8)
    scales = torch.randint(100, 150, (300, 8), dtype=torch.uint8)
    scales[1, 0], scales[2, 1] = 0, 254
    w = codes.view(torch.float8_e4m3fn).to(device)
    sc = scales.view(torch.float8_e8m0fnu).to(device)
    rows = torch.randint(0, 300, (1000,), device=device)
    rows[:3] = torch.tensor([0, 1, 2])
    for r in (rows, None):
        got = kn.fp8_rows(w, sc, r)
        want = ref.fp8_rows(w.cpu(), sc.cpu(), None if r is None else r.cpu())
        assert got.dtype == torch.float32 and torch.equal(got.cpu(), want)


def test_sqrtsoftplus_route_declines(device):
    """Shapes past the kernel's bounds raise NotImplementedError (the dispatcher then runs the oracle); on CUDA
    `vllm_deepinfer.ops.sqrtsoftplus_route` takes the kernel and falls back for them."""
    from kernels_nvidia import ops as kn
    from kernels_nvidia import router
    logits = torch.randn(2, 8, device=device)
    for e, k in ((8, 9), (router.MAX_E + 1, 2), (64, router.MAX_K + 1)):
        with pytest.raises(NotImplementedError):
            kn.sqrtsoftplus_route(torch.randn(2, e, device=device), None, k, 1.0)
    if device != "cuda":
        return
    import vllm_deepinfer.ops as ops
    bias = torch.randn(8, device=device)
    got, want = ops.sqrtsoftplus_route(logits, bias, 3, 1.0), kn.sqrtsoftplus_route(logits, bias, 3, 1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    big = torch.randn(3, router.MAX_E + 8, device=device)
    got = ops.sqrtsoftplus_route(big, torch.zeros(big.shape[1], device=device), 6, 1.0)
    assert torch.equal(got[0], ref.sqrtsoftplus_route(big, torch.zeros(big.shape[1], device=device), 6, 1.0)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d,mute", [(5, 4, 320, False), (3, 4, 1100, True), (0, 4, 64, False)])
def test_engram_inject(device, dtype, t, h, d, mute):
    """Engram gate + residual add, keys and value as strided views of one [T, h + 1, D] projection.
    The interpreter casts to bf16 by truncation (torch rounds to nearest), hence the bf16 bound."""
    from kernels_nvidia import ops as kn
    _seed()
    streams = (torch.randn(t, h, d, device=device) * 3).to(dtype)
    kv = torch.randn(t, h + 1, d, device=device).to(dtype)
    qw, kw = torch.rand(h, d, device=device) + 0.5, torch.rand(h, d, device=device) + 0.5
    m = (torch.arange(t, device=device) % 2 == 0) if mute else None
    out = kn.engram_inject(streams, kv[:, :h], kv[:, h], qw, kw, 1e-6, m)
    want = ref.engram_inject(*(x.cpu() for x in (streams, kv[:, :h], kv[:, h], qw, kw)), 1e-6,
                             None if m is None else m.cpu())
    assert out.dtype == dtype and out.shape == streams.shape
    err = _rel(out, want) if out.numel() else 0.0
    print(f"engram_inject {t}x{h}x{d} {dtype}: rel err {err:.2e}")
    assert err < BOUND[dtype]
    if mute and t:  # a muted token's streams pass through unchanged
        assert torch.equal(out[::2].cpu(), streams[::2].cpu())
