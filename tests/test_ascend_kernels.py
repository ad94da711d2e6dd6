"""kernels_ascend against the torch oracle (vllm_deepinfer.ops.reference).

On an Ascend NPU (torch_npu + triton-ascend) the kernels run there; anywhere else in Triton's interpreter
on the CPU: in a child pytest with TRITON_INTERPRET=1 (`test_in_interpreter_child`; nothing else in the
session is affected), or directly under `TRITON_INTERPRET=1 pytest tests/test_ascend_kernels.py`.

Every check draws fresh random inputs (the seed is printed) and bounds the relative error
||out - ref|| / ||ref|| against the oracle on the CPU on the same inputs, in fp32 (the routed experts: in
the input dtype, whose GEMM-output roundings the kernels reproduce). Bounds: fp32 inputs 2e-5 (only the
summation order differs); bf16 inputs 1.5e-2 (bf16 operands and outputs), doubled in the interpreter,
whose fp32 -> bf16 casts truncate instead of rounding to nearest (triton 3.9): there one rounding gives
3-4e-3 and the experts' four 1-1.6e-2, and the expert kernels' bf16 output equals a truncating torch
emulation of the same pipeline bit for bit. (In the interpreter bf16 dot operands are also upcast to fp32,
`kernels_ascend.common.F32DOT`.) Shapes are small, so the file runs in under a minute in the interpreter;
odd sizes (heads, rows, columns that are not multiples of the tiles) exercise every mask.
"""

from __future__ import annotations

import importlib
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_ascend  # noqa: E402
from tests.conftest import interpreter_child  # noqa: E402
from vllm_deepinfer.checkpoint import formats  # noqa: E402
from vllm_deepinfer.ops import reference as ref  # noqa: E402

BOUND = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _direct_device() -> str | None:
    """Where the kernels run in this process: 'npu', 'cpu' (Triton imported under TRITON_INTERPRET=1, so
    its library functions are interpreted too), or None (then `test_in_interpreter_child` runs them)."""
    if kernels_ascend.npu_present() and kernels_ascend.triton_targets_npu():
        return "npu"
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction
    return "cpu" if isinstance(standard.sum, InterpretedFunction) else None


@pytest.fixture(scope="module")
def ka():
    """(kernels_ascend.ops, device)."""
    dev = _direct_device()
    if dev is None:
        pytest.skip("Triton was imported without TRITON_INTERPRET=1: test_in_interpreter_child runs these")
    return importlib.import_module("kernels_ascend.ops"), dev


def test_in_interpreter_child():
    """Without an NPU, the kernel tests run in a child pytest with TRITON_INTERPRET=1 set before Triton loads
    (Triton decides at import whether its own library functions are interpreted)."""
    if _direct_device() is not None:
        pytest.skip("the kernel tests run in this process")
    r = interpreter_child("-s", "--deselect", f"{__file__}::test_in_interpreter_child", __file__)
    print("\n".join(line for line in r.stdout.splitlines() if "rel err" in line or "passed" in line
                    or "failed" in line or "seed" in line))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def _seed() -> None:
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print("seed", s)


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double().cpu(), want.double().cpu()
    assert out.shape == want.shape, (out.shape, want.shape)
    assert torch.isfinite(out).all(), "non-finite (unwritten or NaN) output"
    return float((out - want).norm() / want.norm().clamp_min(1e-30))


def _cpu(*ts):
    return [t.cpu() if isinstance(t, torch.Tensor) else t for t in ts]


def _check(name: str, got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    err = _rel(got, want)
    bound = BOUND[dtype] * (2 if got.device.type == "cpu" and dtype == torch.bfloat16 else 1)  # interpreter
    print(f"{name} {dtype}: rel err {err:.2e}")
    assert err < bound, f"{name}: {err:.2e} >= {bound}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["dense", "indexed", "gathered"])
def test_sparse_attention(ka, dtype, form):
    ops, dev = ka
    _seed()
    t, h, d, n, k = 5, 20, 64, 70, 40
    q = torch.randn(t, h, d).to(dtype)
    sink = torch.randn(h)
    scale = d ** -0.5
    if form == "dense":
        keys = (torch.randn(n, d) * 0.5).to(dtype)
        allowed = torch.rand(t, n) < 0.4
        allowed[2] = False                     # sees nothing: all mass on the sink, output 0
        args = (q, keys, allowed, sink, scale)
    elif form == "indexed":
        keys = (torch.randn(n, d) * 0.5).to(dtype)
        idx = torch.stack([torch.randperm(n)[:k] for _ in range(t)]).int()
        idx[torch.rand(t, k) < 0.25] = -1
        idx[0] = -1
        args = (q, keys, idx, sink, scale)
    else:
        keys = (torch.randn(t, k, d) * 0.5).to(dtype)
        valid = torch.rand(t, k) < 0.7
        valid[1] = False
        keys[~valid] = float("nan")            # invalid rows must never be read
        args = (q, keys, valid, sink, scale)
    name = {"dense": "sparse_attention", "indexed": "sparse_attention_indexed",
            "gathered": "sparse_attention_gathered"}[form]
    got = getattr(ops, name)(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args])
    want = getattr(ref, name)(*_cpu(*args))
    _check(name, got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_attention_indexed_id_layout(ka, dtype):
    """Ids leading with -1 (window) and trailing with -1 (top-k padding): the kernel walks only the blocks between a
    token's first and last valid id; against the oracle, and bitwise unchanged with 96 more -1 columns."""
    ops, dev = ka
    _seed()
    t, h, d, n, k = 5, 20, 64, 300, 130
    q = torch.randn(t, h, d).to(dtype)
    keys = (torch.randn(n, d) * 0.5).to(dtype)
    cols = torch.arange(k)
    first, last = torch.randint(0, k // 2, (t,)), torch.randint(k // 2, k + 1, (t,))
    first[0], last[0] = k, 0                                                  # no key: the sink only
    rows = torch.stack([torch.randperm(n)[:k] for _ in range(t)])                  # distinct ids per token
    idx = torch.where((cols >= first[:, None]) & (cols < last[:, None]), rows, -1).int()
    sink = torch.randn(h)
    args = (q, keys, idx, sink, d ** -0.5)
    got = ops.sparse_attention_indexed(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args])
    _check("sparse_attention_indexed id layout", got, ref.sparse_attention_indexed(*_cpu(*args)), dtype)
    padded = torch.cat([idx, torch.full((t, 96), -1, dtype=idx.dtype)], 1)
    again = ops.sparse_attention_indexed(q.to(dev), keys.to(dev), padded.to(dev), sink.to(dev), d ** -0.5)
    assert torch.equal(got, again)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gathered", [False, True])
def test_indexer_scores(ka, dtype, gathered):
    ops, dev = ka
    _seed()
    t, hi, d, n = 4, 12, 32, 150
    q = torch.randn(t, hi, d).to(dtype)
    w = torch.randn(t, hi) * 0.1
    keys = torch.randn(*((t,) if gathered else ()), n, d).to(dtype)
    name = "indexer_scores_gathered" if gathered else "indexer_scores"
    got = getattr(ops, name)(q.to(dev), w.to(dev), keys.to(dev))
    want = getattr(ref, name)(q, w, keys)
    assert got.dtype == torch.float32
    _check(name, got, want, dtype)


def test_softmax_pool(ka):
    ops, dev = ka
    _seed()
    values, logits = torch.randn(7, 6, 100), torch.randn(7, 6, 100) * 3
    _check("softmax_pool", ops.softmax_pool(values.to(dev), logits.to(dev)), ref.softmax_pool(values, logits),
           torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_coefficients(ka, dtype):
    ops, dev = ka
    _seed()
    t, h, d = 3, 4, 300                       # h*D = 1200: two full reduction chunks and a partial one
    m = (2 + h) * h
    streams = torch.randn(t, h, d).to(dtype)
    fn, base, scale = torch.randn(m, h * d) * 0.02, torch.randn(m) * 0.1, torch.rand(3) + 0.5
    got = ops.hc_coefficients(streams.to(dev), fn.to(dev), base.to(dev), scale.to(dev), 1e-6, 1e-6, 20)
    want = ref.hc_coefficients(streams, fn, base, scale, 1e-6, 1e-6, 20)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        err = _rel(g, w)
        print(f"hc_coefficients {name} {dtype}: rel err {err:.2e}")
        assert err < 1e-4  # fp32 math on both sides; only the summation order differs


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_collapse_expand(ka, dtype):
    ops, dev = ka
    _seed()
    t, h, d = 3, 4, 300
    streams = torch.randn(t, h, d).to(dtype)
    w = torch.rand(t, h)
    y = torch.randn(t, d).to(dtype)
    post, comb = torch.rand(t, h) * 2, torch.softmax(torch.randn(t, h, h), -1)
    _check("hc_collapse", ops.hc_collapse(streams.to(dev), w.to(dev)), ref.hc_collapse(streams, w), dtype)
    _check("hc_expand", ops.hc_expand(streams.to(dev), y.to(dev), post.to(dev), comb.to(dev)),
           ref.hc_expand(streams, y, post, comb), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,block", [(1, 128), (2, 128), (1, 32)])   # V4: 128 x 128 blocks, V4.1: 32 x 32
def test_linear_fp8_block(ka, dtype, groups, block):
    ops, dev = ka
    _seed()
    t, n, k = 5, (192 if groups == 1 else 128), 320    # partial scale blocks in N and K at 128
    w, scale = formats.quant_fp8_block(torch.randn(n, k) * 0.05, block)
    x = torch.randn(t, groups * k).to(dtype)
    got = ops.linear_fp8_block(x.to(dev), w.to(dev), scale.to(dev), (block, block), groups)
    want = ref.linear_fp8_block(x.float(), w, scale, (block, block), groups)
    assert got.dtype == dtype
    _check(f"linear_fp8_block groups={groups} block={block}", got, want, dtype)


def _experts(e: int, d: int, inter: int):
    return torch.randn(e, 2 * inter, d) * 0.1, torch.randn(e, d, inter) * 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_routed_experts(ka, dtype, packed):
    ops, dev = ka
    _seed()
    t, ksel, e, d, inter, limit = 4, 3, 6, 96, 64, 0.8   # limit small enough that both clamps act
    x = torch.randn(t, d).to(dtype)
    ids = torch.stack([torch.randperm(e)[:ksel] for _ in range(t)])
    wts = torch.rand(t, ksel)
    w13, w2 = _experts(e, d, inter)
    if packed:
        p13, s13 = formats.quant_mxfp4(w13)
        p2, s2 = formats.quant_mxfp4(w2)
        got = ops.routed_experts_packed(*[a.to(dev) for a in (x, ids, wts, p13, s13, p2, s2)], limit)
        want = ref.routed_experts_packed(x, ids, wts, p13, s13, p2, s2, limit)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
        got = ops.routed_experts(*[a.to(dev) for a in (x, ids, wts, w13, w2)], limit)
        want = ref.routed_experts(x, ids, wts, w13, w2, limit)
    assert got.dtype == dtype
    _check(f"routed_experts packed={packed}", got, want, dtype)


def test_declines_unsupported_shapes(ka):
    """Shapes a kernel does not take raise NotImplementedError (the dispatcher then runs the oracle)."""
    ops, dev = ka
    q = torch.randn(2, 4, 96, device=dev)
    with pytest.raises(NotImplementedError):
        ops.sparse_attention(q, torch.randn(5, 96, device=dev), torch.ones(2, 5, dtype=torch.bool, device=dev),
                             torch.zeros(4, device=dev), 0.1)
    w, s = formats.quant_fp8_block(torch.randn(64, 96), (64, 96))   # a 96-wide scale block
    with pytest.raises(NotImplementedError):
        ops.linear_fp8_block(torch.randn(2, 96, device=dev), w.to(dev), s.to(dev), (64, 96))
