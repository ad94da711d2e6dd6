"""`fp8_ds_mla` record kernels (`kernels_nvidia.kv_records`, the record path of `kernels_nvidia.attention`) against
the oracle (`vllm_deepinfer.ops.reference`), and vLLM's own insert kernel against ours, byte for byte.

Store and gather must equal the oracle exactly (same bytes, same values). Triton's interpreter rounds fp32 -> E4M3
wrongly (e.g. 31.5 -> 16, ties away from even; seen with the bundled Triton), so on the CPU the stores are checked
on rows whose scaled NoPE values are E4M3 numbers (no rounding); on CUDA on random rows too. The attention over
records must equal, bitwise, the paged-rows kernel over the same rows dequantised.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from vllm_deepinfer.ops import quant  # noqa: E402
from vllm_deepinfer.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

PAGE, BLOCKS = 65536, 3
R = PAGE // quant.KV_RECORD_BYTES   # 112 records in a 64-token bf16 page


def _exact_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose 64-dim NoPE groups are E4M3 codes times 2**e with amax 448 * 2**e and BF16 RoPE dims: stored
    without rounding (the interpreter also rounds fp32 -> BF16 wrongly)."""
    b = torch.randint(0, 256, (n, 7, 64), dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0                                             # no NaN codes
    codes = b.view(torch.float8_e4m3fn).float()
    codes[..., 0] = torch.where(torch.rand(n, 7) < 0.5, 448.0, -448.0)
    nope = codes * torch.ldexp(torch.ones(n, 7, 1), torch.randint(-12, 6, (n, 7, 1)))
    rope = torch.randn(n, 64).to(torch.bfloat16).float()     # no BF16 rounding either
    return torch.cat((nope.flatten(1), rope), dim=1).to(dtype)


def _random_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    rows = torch.randn(n, 512) * torch.logspace(-6, 3, n).unsqueeze(1)
    rows[0] = 0.0
    return rows.to(dtype)


def _rows(device: str, n: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    if kind == "random" and device == "cpu":
        pytest.skip("Triton's interpreter rounds fp32 -> E4M3 wrongly")
    return (_exact_rows if kind == "exact" else _random_rows)(n, dtype)


def _slots(n: int) -> torch.Tensor:
    return torch.randperm(BLOCKS * R)[:n]


@pytest.mark.parametrize("kind", ["exact", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_matches_oracle(device, dtype, kind):
    from kernels_nvidia import kv_records
    torch.manual_seed(0)
    rows, slots = _rows(device, 24, dtype, kind), _slots(24)
    want = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    ref.kv_record_store(want, slots, rows, R)
    pages = torch.full((BLOCKS, PAGE), 0, dtype=torch.uint8, device=device)
    kv_records.kv_record_store(pages, slots.to(device), rows.to(device), R)
    assert torch.equal(pages.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_oracle(device, dtype):
    from kernels_nvidia import kv_records
    torch.manual_seed(1)
    pages = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    slots = _slots(30)
    ref.kv_record_store(pages, slots, _random_rows(30, torch.float32), R)
    read = torch.cat((slots[:20], torch.tensor([-1, -1]))).view(2, 11)
    got = kv_records.kv_record_gather(pages.to(device), read.to(device), R, dtype)
    want = ref.kv_record_gather(pages, read, R, dtype)
    assert got.shape == (2, 11, 512)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_records(device, dtype, split, monkeypatch):
    """Window records then compressed records, dequantised in the kernel: the paged-rows kernel over the oracle's
    dequantised rows (bitwise unsplit, to the last bit split), and within the usual bound of the oracle's attention."""
    from kernels_nvidia import attention as kattn
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly (seen with triton 3.9)")
    monkeypatch.setattr(kattn, "SPLIT", split)
    torch.manual_seed(2)
    t, h, ka, kb = 3, 16, 16, 40
    pages_a = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    pages_b = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    ref.kv_record_store(pages_a, torch.arange(BLOCKS * R), torch.randn(BLOCKS * R, 512) * 0.5, R)
    ref.kv_record_store(pages_b, torch.arange(BLOCKS * R), torch.randn(BLOCKS * R, 512) * 0.5, R)
    idx_a = torch.stack([torch.randperm(BLOCKS * R)[:ka] for _ in range(t)])
    idx_b = torch.stack([torch.randperm(BLOCKS * R)[:kb] for _ in range(t)])
    idx_a[torch.rand(t, ka) < 0.2] = -1
    idx_b[torch.rand(t, kb) < 0.4] = -1
    idx_b[0] = -1
    q = torch.randn(t, h, 512).to(dtype)
    sink = torch.randn(h)
    on = {n: x.to(device) for n, x in dict(q=q, pa=pages_a, pb=pages_b, ia=idx_a, ib=idx_b, s=sink).items()}
    out = kattn.sparse_attention_records(on["q"], on["pa"], on["ia"], on["pb"], on["ib"], R, on["s"], 0.044)
    rows_a = ref.kv_record_gather(pages_a, torch.arange(BLOCKS * R), R, dtype).to(device)
    rows_b = ref.kv_record_gather(pages_b, torch.arange(BLOCKS * R), R, dtype).to(device)
    same = kattn.sparse_attention_paged(on["q"], rows_a, on["ia"], rows_b, on["ib"], on["s"], 0.044)
    if split:  # split: last-bit differences seen while records ran unpipelined (H200: 1 of 24,576, 1 ulp)
        torch.testing.assert_close(out, same, rtol={torch.float32: 1e-6, torch.bfloat16: 2 ** -7}[dtype], atol=0)
    else:
        assert torch.equal(out, same)
    want = ref.sparse_attention_records(q, pages_a, idx_a, pages_b, idx_b, R, sink, 0.044)
    err = float((out.double().cpu() - want.double()).norm() / want.double().norm())
    assert err < {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}[dtype], err


@pytest.mark.parametrize("kind", ["exact", "random"])
def test_vllm_insert_kernel_writes_the_same_bytes(device, kind):
    """vLLM 0.32's `quantize_and_insert_k_kernel` (models/deepseek_v4/common/ops/cache_utils.py, its Triton
    reference of the fp8_ds_mla insert; bf16 input) run here (re-jitted with this Triton, so it also runs in the
    interpreter) on a block of R records and our page's stride: the same bytes as our store."""
    cache_utils = pytest.importorskip("vllm.models.deepseek_v4.common.ops.cache_utils")
    fn = cache_utils.quantize_and_insert_k_kernel
    fn = getattr(fn, "fn", fn)
    kernel = triton.jit(types.FunctionType(fn.__code__, {**fn.__globals__, "tl": triton.language, "triton": triton},
                                           fn.__name__))
    torch.manual_seed(3)
    rows, slots = _rows(device, 24, torch.bfloat16, kind), _slots(24)
    theirs = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8, device=device)
    kernel[(24,)](rows.to(device), slots.to(device), theirs, 24, input_dim=512, fp8_dim=448, bf16_dim=64,
                  scale_dim=8, quant_block=64, cache_block_size=R, token_data_size=576, block_stride=PAGE,
                  fp8_max=448.0, n_quant_blocks=8)
    ours = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    ref.kv_record_store(ours, slots, rows, R)
    assert torch.equal(theirs.cpu(), ours)
