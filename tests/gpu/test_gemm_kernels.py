"""kernels_nvidia.gemm (weight-only FP8 block GEMM) against the torch oracle `reference.linear_fp8_block`.

Fresh random inputs per run (seed printed), the allocator's free memory poisoned with NaN before each
kernel call, and the oracle evaluated in fp32 on the CPU. Bound: ||y - ref|| / ||ref|| < 4e-3. The
dequantised weights are exact in bf16 and bf16 x bf16 products are exact in fp32, so the error is the
bf16 rounding of the output (relative 2**-9 per element at most, ~1.2e-3 in norm) plus fp32 summation
order (~1e-6). Triton 3.6's interpreter truncates fp32 -> bf16 casts instead of rounding to nearest, which
doubles the output error there (measured 3.0-3.5e-3).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.test_kernels import _poison, _rel, _seed  # noqa: E402
from vllm_deepinfer.checkpoint.formats import quant_fp8_block  # noqa: E402
from vllm_deepinfer.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

BOUND = 4e-3
# Triton's interpreter (triton 3.6) casts fp32 to bf16 by truncation, not round-to-nearest: up to one bf16 ulp
# (2^-7 relative) per output instead of half of one, which a 100-column output can show (seed 1426561962: 4.4e-3)
BOUND_INTERP = 8e-3


def _bound(device: str) -> float:
    return BOUND_INTERP if device == "cpu" else BOUND


def _weights(n: int, k: int, block: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 weight [N, K] whose blocks span 2**-6 .. 2**5 in magnitude (many scale bytes)."""
    master = torch.randn(n, k) / k ** 0.5
    spread = torch.exp2(torch.randint(-6, 6, (-(-n // block), -(-k // block))).float())
    master *= spread.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    codes, scale = quant_fp8_block(master, block)
    return codes.to(device), scale.view(torch.uint8).to(device)


def _oracle(x, w, s, block, groups=1) -> torch.Tensor:
    return ref.linear_fp8_block(x.float().cpu(), w.cpu(), s.cpu(), (block, block), groups)


def _run(x, w, s, block, groups=1):
    from kernels_nvidia import gemm
    _poison(x.device.type)
    return gemm.linear_fp8_block(x, w, s, (block, block), groups)


@pytest.fixture(params=[False, True], ids=["direct", "swap-ab"])
def swap_ab(request, monkeypatch):
    """Each direct-kernel test for both operand orders (`gemm.SWAP_AB`)."""
    from kernels_nvidia import gemm
    monkeypatch.setattr(gemm, "SWAP_AB", request.param)
    return request.param


@pytest.mark.parametrize("block,n,k", [(32, 100, 96), (128, 192, 256), (32, 256, 160), (32, 96, 1056)])
def test_linear_fp8_block(device, block, n, k, swap_ab):
    """Partial edge blocks along N and K (100 x 96 with 32 x 32 blocks), the release's 128 x 128 blocks,
    a K that is not a multiple of the kernel's K tile, and a thin matrix whose K is split (96 x 1056:
    2 N tiles, 9 K tiles -> 2 splits, the last one partial); M spans one partial and several token tiles."""
    from kernels_nvidia import gemm
    _seed()
    w, s = _weights(n, k, block, device)
    for m in (1, 5, 70):
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        y = _run(x, w, s, block)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        err = _rel(y, _oracle(x, w, s, block))
        print(f"fp8 block GEMM block={block} M={m} N={n} K={k} split={gemm.split_k(n, k, w.device)}: "
              f"rel err {err:.2e}")
        assert err < _bound(device)


@pytest.mark.parametrize("direct,k", [(True, 96), (True, 1024), (False, 96)])
def test_linear_fp8_block_grouped(device, direct, k, monkeypatch, swap_ab):
    """groups > 1 (the grouped wo_a: output group g reads input columns g*K..): direct kernel (K = 1024:
    split in 2) and the dequantise + bmm path of large M."""
    from kernels_nvidia import gemm
    monkeypatch.setattr(gemm, "DIRECT_MAX_M", 1 << 30 if direct else 4)
    _seed()
    groups, r, block = 4, 64, 32
    w, s = _weights(groups * r, k, block, device)
    x = torch.randn(9, groups * k, device=device).to(torch.bfloat16)
    err = _rel(_run(x, w, s, block, groups), _oracle(x, w, s, block, groups))
    print(f"grouped fp8 block GEMM direct={direct}: rel err {err:.2e}")
    assert err < _bound(device)


def test_linear_fp8_block_dequant_path(device, monkeypatch):
    """Large M (above DIRECT_MAX_M): dequantise to a bf16 scratch, then torch.matmul."""
    from kernels_nvidia import gemm
    monkeypatch.setattr(gemm, "DIRECT_MAX_M", 4)
    _seed()
    w, s = _weights(100, 96, 32, device)
    x = torch.randn(9, 96, device=device).to(torch.bfloat16)
    err = _rel(_run(x, w, s, 32), _oracle(x, w, s, 32))
    print(f"fp8 block dequant + matmul: rel err {err:.2e}")
    assert err < _bound(device)
    assert torch.equal(gemm.dequant_to_bf16(w, s, (32, 32)).cpu(),
                       ref.linear_fp8_block(torch.eye(96, dtype=torch.bfloat16), w.cpu(), s.cpu(), (32, 32)).t())


@pytest.mark.parametrize("thin", [False, True], ids=["one-split", "split-k"])
def test_linear_fp8_block_batch_invariant(device, thin, monkeypatch, swap_ab):
    """Row i is bitwise the same for M = 1, 64 and 256 (fixed tiles, fixed K splits in a fixed order;
    SPLIT_ROWS = 64: the 256 rows of a split matrix take four launches)."""
    from kernels_nvidia import gemm
    monkeypatch.setattr(gemm, "SPLIT_ROWS", 64)
    _seed()
    small = device == "cpu"
    n, k, block = ((64, 1024, 32) if thin else (64, 64, 32)) if small else ((1280, 5120, 32) if thin else (32768, 1280, 32))
    assert (gemm.split_k(n, k, torch.device(device)) > 1) == thin
    w, s = _weights(n, k, block, device)
    x = torch.randn(256, k, device=device).to(torch.bfloat16)
    y256 = _run(x, w, s, block)
    y64 = _run(x[:64].clone(), w, s, block)
    assert torch.equal(y64, y256[:64])
    for i in (0, 37, 63):
        assert torch.equal(_run(x[i:i + 1].clone(), w, s, block), y256[i:i + 1])


def test_linear_fp8_block_cuda_graph(device):
    """Capturable: no host sync, no allocation outside the graph pool; replays follow new inputs."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    _seed()
    w, s = _weights(4096, 1280, 32, device)
    x = torch.randn(16, 1280, device=device).to(torch.bfloat16)
    _run(x, w, s, 32)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _run(x, w, s, 32)
    x.copy_(torch.randn_like(x))
    g.replay()
    assert _rel(y, _oracle(x, w, s, 32)) < _bound(device)


def test_dispatch_uses_gemm_kernel(device):
    """ops.linear_fp8_block runs the kernel for CUDA bf16 inputs and the oracle otherwise."""
    if device != "cuda":
        pytest.skip("dispatch selects kernels for CUDA tensors only")
    import vllm_deepinfer.ops as ops
    _seed()
    w, s = _weights(256, 512, 128, device)
    x = torch.randn(3, 512, device=device).to(torch.bfloat16)
    assert ops.backend_for(x) == "kernels_nvidia"
    assert _rel(ops.linear_fp8_block(x, w, s, (128, 128)), _oracle(x, w, s, 128)) < _bound(device)


def test_linear_fp32_out_batch_invariant(device, monkeypatch):
    """Batch-invariant mode's fp32-output GEMM (fixed tiles, K split by the matrix): against the fp32 product of the
    same values, and row i bitwise the same for M = 1, 37 and 130 (three M tiles)."""
    from kernels_nvidia import gemm
    monkeypatch.setattr(gemm, "BATCH_INVARIANT", True)
    _seed()
    small = device == "cpu"
    k, n = (1100, 72) if small else (5120, 384)  # a ragged last K chunk in the interpreter
    x = torch.randn(130, k, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device) / 70).to(torch.bfloat16)
    assert gemm.split_k(n, k, x.device) > 1
    y = gemm.linear_fp32_out(x, w)
    assert y.dtype == torch.float32 and y.shape == (130, n)
    err = _rel(y, ref.linear_fp32_out(x.cpu(), w.cpu()))
    print(f"linear_fp32_out (batch-invariant kernel): rel err {err:.2e}")
    assert err < 1e-5
    assert torch.equal(gemm.linear_fp32_out(x[:37].clone(), w), y[:37])
    for i in (0, 36, 129):
        assert torch.equal(gemm.linear_fp32_out(x[i:i + 1].clone(), w), y[i:i + 1])


def test_linear_fp32_out(device):
    """bf16 x bf16 -> fp32 epilogue GEMM (router logits, compressor projections) against the fp32 product of
    the same values: only the fp32 summation order differs."""
    if device != "cuda":
        pytest.skip("cuBLAS epilogue: CUDA only")
    from kernels_nvidia import gemm
    _seed()
    x = torch.randn(37, 5120, device=device).to(torch.bfloat16)
    w = (torch.randn(384, 5120, device=device) / 70).to(torch.bfloat16)
    try:
        y = gemm.linear_fp32_out(x, w)
    except NotImplementedError as e:
        pytest.skip(f"this torch has no out_dtype GEMM: {e}")
    assert y.dtype == torch.float32
    err = _rel(y, ref.linear_fp32_out(x.cpu(), w.cpu()))
    print(f"linear_fp32_out: rel err {err:.2e}")
    assert err < 1e-5
