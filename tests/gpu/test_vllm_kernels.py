"""Kernels of vLLM's CUDA build behind our ops, against the oracle: FlashMLA's sparse prefill as
`ops.sparse_attention_indexed` (`ops.flashmla`) and DeepGEMM's tf32 prenorm GEMM as the partials of
`ops.hc_coefficients` (`ops.deepgemm`).

Both paths are off by default until measured end to end (`VLLM_DEEPINFER_FLASHMLA=1`,
`VLLM_DEEPINFER_DEEPGEMM_HC=1`); these tests switch them on in-process. FlashMLA at V4.1 widths (64 heads x 512)
in bf16: rows of -1 (padding and a query with no key), K not a multiple of the kernel's 128 (padded), the sink.
DeepGEMM at V4.1 widths (hc 4 x 5120) for decode and prefill token counts. Each checks that the call really ran
the library kernel (not the fallback).

    PYTHONPATH=$PWD python3 -m pytest -q -s tests/gpu/test_vllm_kernels.py   (needs vLLM 0.32 on CUDA)
"""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def _switched_on(name: str, monkeypatch):
    """`vllm_deepinfer.ops.<name>` with its library path on (skips without CUDA, vLLM or the library kernel)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    mod = importlib.import_module(f"vllm_deepinfer.ops.{name}")
    if mod.KERNEL.get() is None:
        pytest.skip(f"{name}: the library kernel is unavailable on this GPU / build")
    monkeypatch.setattr(mod.KERNEL, "off", False)
    torch.manual_seed(0)
    return mod


@pytest.mark.parametrize("t,k,rows", [(300, 640, 4096), (37, 130, 200)])
def test_flashmla_prefill_matches_oracle(t, k, rows, monkeypatch):
    flashmla = _switched_on("flashmla", monkeypatch)
    from vllm_deepinfer import ops
    from vllm_deepinfer.ops import reference as ref

    q = torch.randn(t, 64, 512, device="cuda", dtype=torch.bfloat16)
    kv = (torch.randn(rows, 512, device="cuda") * 0.5).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(rows, device="cuda")[:k] for _ in range(t)])
    idx[:, k // 2:] = torch.where(torch.rand(t, k - k // 2, device="cuda") < 0.3, -1, idx[:, k // 2:])
    idx[0] = -1  # a query with no key: the sink takes all mass, output 0
    sink = torch.randn(64, device="cuda")
    scale = 512 ** -0.5
    assert flashmla.takes(q, kv)
    out = ops.sparse_attention_indexed(q, kv, idx, sink, scale)
    assert not flashmla.KERNEL.off, "FlashMLA failed and fell back"
    want = ref.sparse_attention_indexed(q.float().cpu(), kv.float().cpu(), idx.cpu(), sink.cpu(), scale)
    err = (out.float().cpu() - want).norm() / want.norm()
    print(f"T={t} K={k}: rel err {err:.2e}")
    assert err < 1.5e-2
    assert out[0].abs().max() == 0


@pytest.mark.parametrize("t", [1, 64, 4096])
def test_deepgemm_hc_coefficients_match_oracle(t, monkeypatch):
    deepgemm = _switched_on("deepgemm", monkeypatch)
    from vllm_deepinfer import ops
    from vllm_deepinfer.ops import reference as ref

    h, d = 4, 5120
    m = (2 + h) * h
    streams = torch.randn(t, h, d, device="cuda").to(torch.bfloat16)
    fn = torch.randn(m, h * d, device="cuda") * 0.02
    base = torch.randn(m, device="cuda") * 0.1
    scale = torch.rand(3, device="cuda") + 0.5
    assert deepgemm.takes(streams)
    got = ops.hc_coefficients(streams, fn, base, scale, 1e-6, 1e-6, 20)
    assert not deepgemm.KERNEL.off, "DeepGEMM failed and fell back"
    want = ref.hc_coefficients(streams.cpu(), fn.cpu(), base.cpu(), scale.cpu(), 1e-6, 1e-6, 20)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        err = ((g.cpu().double() - w.double()).norm() / w.double().norm()).item()
        print(f"T={t} {name}: rel err {err:.2e}")
        assert err < 1e-3  # tf32 products (DeepGEMM) against fp32
