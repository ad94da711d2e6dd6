"""FlashMLA's sparse prefill kernel (vLLM's CUDA wheel) as `ops.sparse_attention_indexed` against the oracle.

`ops.flashmla` is off by default until measured end to end (`VLLM_DEEPINFER_FLASHMLA=1`); this test switches it
on in-process and checks, at V4.1 widths (64 heads x 512) in bf16: rows of -1 (padding and a query with no key),
K not a multiple of the kernel's 128 (padded), the sink, and that the call really ran FlashMLA (not the fallback).

    PYTHONPATH=$PWD python3 -m pytest -q -s tests/gpu/test_flashmla_prefill.py   (needs vLLM 0.32 on CUDA)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("t,k,rows", [(300, 640, 4096), (37, 130, 200)])
def test_flashmla_prefill_matches_oracle(t, k, rows, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    from vllm_deepinfer import ops
    from vllm_deepinfer.ops import flashmla
    from vllm_deepinfer.ops import reference as ref

    if flashmla._kernel() is None:
        pytest.skip("FlashMLA sparse kernels unavailable on this GPU / build")
    monkeypatch.setitem(flashmla._state, "off", False)
    torch.manual_seed(0)
    q = torch.randn(t, 64, 512, device="cuda", dtype=torch.bfloat16)
    kv = (torch.randn(rows, 512, device="cuda") * 0.5).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(rows, device="cuda")[:k] for _ in range(t)])
    idx[:, k // 2:] = torch.where(torch.rand(t, k - k // 2, device="cuda") < 0.3, -1, idx[:, k // 2:])
    idx[0] = -1  # a query with no key: the sink takes all mass, output 0
    sink = torch.randn(64, device="cuda")
    scale = 512 ** -0.5
    assert flashmla.takes(q, kv)
    out = ops.sparse_attention_indexed(q, kv, idx, sink, scale)
    assert not flashmla._state["off"], "FlashMLA failed and fell back"
    want = ref.sparse_attention_indexed(q.float().cpu(), kv.float().cpu(), idx.cpu(), sink.cpu(), scale)
    err = (out.float().cpu() - want).norm() / want.norm()
    print(f"T={t} K={k}: rel err {err:.2e}")
    assert err < 1.5e-2
    assert out[0].abs().max() == 0
