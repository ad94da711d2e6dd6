"""kernels_nvidia.moe (MXFP4 routed experts) against the oracle `ops.reference.routed_experts_packed`.

Fresh random MXFP4 experts (quant_mxfp4 of N(0, 1/K) masters) and routing every run (the seed is
printed); the caching allocator's freed memory is poisoned with NaN before each call (the kernel
allocates its intermediates and output); rel. error ||out - ref|| / ||ref|| against the oracle in
fp32 on the CPU (on the same bf16 inputs). Bounds: fp32 activations 1e-5 (IEEE dots; only the
summation order differs); bf16 2e-2 (as `routed_experts` in bf16: the two GEMM outputs, the SwiGLU
product and the result are each rounded to bf16, 2^-8 relative apiece). Shapes cover several row tiles
per expert, empty experts, and D, I that are not multiples of the 128-wide reduction chunk or the
64-wide column tile. Batch invariance: a token's row is bitwise the same alone and in a batch of 64, and
with every row tile.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.test_kernels import _poison, _rel, _seed, _skip_interp_bf16_dot, _small  # noqa: E402
from vllm_deepinfer.checkpoint.formats import quant_mxfp4  # noqa: E402
from vllm_deepinfer.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LIMIT = 1.0  # the clamps bite on these inputs


def _experts(device, E, D, inter):
    w13, s13 = quant_mxfp4(torch.randn(E, 2 * inter, D) * D ** -0.5)
    w2, s2 = quant_mxfp4(torch.randn(E, D, inter) * inter ** -0.5)
    return [t.view(torch.uint8).to(device) for t in (w13, s13, w2, s2)]


def _routing(device, T, E, K):
    ids = torch.rand(T, E).argsort(dim=1)[:, :K].to(device)
    return ids, (torch.rand(T, K) * 1.5).to(device)


def _shapes(device):
    if _small(device):  # interpreter; (3, .., 80, 3): 80 rows (several row tiles) on every expert
        return [(3, 160, 96, 80, 3), (8, 128, 64, 1, 6), (8, 96, 160, 5, 2)]
    return [(8, 5120, 2304, 1, 6), (8, 5120, 2304, 64, 6), (8, 1184, 736, 300, 6), (64, 2048, 512, 200, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_packed(device, dtype):
    from kernels_nvidia import moe
    _skip_interp_bf16_dot(device, dtype)
    _seed()
    for E, D, inter, T, K in _shapes(device):
        w = _experts(device, E, D, inter)
        ids, weights = _routing(device, T, E, K)
        x = torch.randn(T, D, device=device).to(dtype)
        _poison(device)
        out = moe.routed_experts_packed(x, ids, weights, *w, LIMIT)
        want = ref.routed_experts_packed(x.float().cpu(), ids.cpu(), weights.cpu(), *(t.cpu() for t in w), LIMIT)
        err = _rel(out, want)
        print(f"E={E} D={D} I={inter} T={T} K={K} {dtype}: rel err {err:.2e}")
        assert out.dtype == dtype and err < BOUND[dtype]


def test_routed_experts_packed_batch_invariant(device):
    """Token 5's row alone == its row in a batch of 64 (bitwise); bf16 on the GPU, fp32 in the interpreter."""
    from kernels_nvidia import moe
    dtype = torch.float32 if _small(device) else torch.bfloat16
    _seed()
    E, D, inter = (4, 128, 64) if _small(device) else (8, 5120, 2304)
    w = _experts(device, E, D, inter)
    ids, weights = _routing(device, 64, E, 6 if E > 6 else 3)
    x = torch.randn(64, D, device=device).to(dtype)
    full = moe.routed_experts_packed(x, ids, weights, *w, LIMIT)
    one = moe.routed_experts_packed(x[5:6].clone(), ids[5:6].clone(), weights[5:6].clone(), *w, LIMIT)
    assert torch.equal(full[5:6], one)


def test_routed_experts_packed_row_tiles_bitwise(device, monkeypatch):
    """Every row tile `row_tile` may pick (the MMA's N dimension) gives bitwise the same rows on one batch: what lets
    the tile follow the batch in batch-invariant mode."""
    from kernels_nvidia import moe
    dtype = torch.float32 if _small(device) else torch.bfloat16
    _seed()
    E, D, inter, T = (4, 128, 64, 24) if _small(device) else (16, 5120, 2304, 96)
    w = _experts(device, E, D, inter)
    ids, weights = _routing(device, T, E, 3)
    x = torch.randn(T, D, device=device).to(dtype)
    tiles = sorted({bm for _, bm in moe.ROW_TILES} | {moe.BM_LARGE})
    outs = []
    for bm in tiles:
        monkeypatch.setattr(moe, "BM", bm)
        outs.append(moe.routed_experts_packed(x, ids, weights, *w, LIMIT))
    for bm, out in zip(tiles, outs):
        assert torch.equal(out, outs[0]), f"row tile {bm}: {(out != outs[0]).any(dim=1).sum().item()} rows differ"


@pytest.mark.parametrize("E,K", [(384, 6), (8, 3)])
def test_pairs_kernel_matches_torch(device, E, K, monkeypatch):
    """The one-program routing glue (`_pairs_kernel`) gives the torch path's outputs exactly: T 1-85 (85 x 6 = 510
    pairs, the kernel's limit being 512), int32 and int64 ids, and repeated experts within a token (stable)."""
    from kernels_nvidia import moe
    _seed()
    for T, dup in ((1, False), (7, True), (64, False), (85, True), (85, False)):
        ids = torch.randint(0, E, (T, K)) if dup else torch.rand(T, E).argsort(dim=1)[:, :K]
        ids = ids.to(torch.int32 if T % 2 else torch.int64).to(device)
        w = torch.rand(T, K, device=device)
        bm = moe.row_tile(T * K, E)
        got = moe._pairs(ids, w, E, bm)
        with monkeypatch.context() as m:
            m.setattr(moe, "PAIRS_KERNEL_MAX", -1)
            want = moe._pairs(ids, w, E, bm)
        for name, g, h in zip(("weights", "order", "ends", "tile_ends", "pos"), got, want):
            assert g.dtype == h.dtype and torch.equal(g, h), (T, dup, name)


def test_routed_experts_packed_dispatch(device):
    """vllm_deepinfer.ops routes CUDA tensors to the kernel; a format it lacks falls back to the oracle's error."""
    if device != "cuda":
        pytest.skip("dispatch selects kernels for CUDA tensors only")
    import vllm_deepinfer.ops as ops
    _seed()
    w = _experts(device, 8, 256, 128)
    ids, weights = _routing(device, 9, 8, 6)
    x = torch.randn(9, 256, device=device).to(torch.bfloat16)
    got = ops.routed_experts_packed(x, ids, weights, *w, LIMIT)
    want = ref.routed_experts_packed(x.float().cpu(), ids.cpu(), weights.cpu(), *(t.cpu() for t in w), LIMIT)
    assert _rel(got, want) < BOUND[torch.bfloat16]
    with pytest.raises(ValueError):
        ops.routed_experts_packed(x, ids, weights, *w, LIMIT, "nvfp4")
