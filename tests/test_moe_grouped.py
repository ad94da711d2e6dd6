"""The routed-experts op (`ops.reference.routed_experts`): sort + torch._grouped_mm, fixed shapes.

Checked against a per-token float64 reference (each token through its K experts in turn), on the
grouped-GEMM path and on the fallback loop (operands torch._grouped_mm refuses), for several T
(0 and 1 included), E = 8 and K = 2..6. Tolerances, relative to the largest reference output:
float32 1e-5 (float32 rounding of two GEMMs and the SwiGLU); bfloat16 2e-2 (the GEMM outputs, the
SwiGLU product and the result are each rounded to bf16, 2^-8 relative apiece). Also: a token's
bf16 row is bitwise the same alone or among 37 tokens (fp32: see that test); hash routing (ids from a table) is handled like
any other ids; and the grouped path has fixed output shapes and no data-dependent host read
(it runs under FakeTensorMode, where .tolist()/.item()/nonzero raise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_deepinfer.ops import reference as ref

E = 8
LIMIT = 1.0  # small enough that the clamps bite on these inputs
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dense_reference(x, ids, weights, w13, w2, limit):
    """Per-token loop in float64: out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            w1, w3 = w13[e, :inter].double(), w13[e, inter:].double()
            a = (w1 @ x[t].double()).clamp(max=limit)
            b = (w3 @ x[t].double()).clamp(-limit, limit)
            out[t] += float(weights[t, k]) * (w2[e].double() @ (F.silu(a) * b))
    return out


def make(T: int, K: int, D: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    weights = torch.rand(T, K, generator=g) * 2
    w13 = (torch.randn(E, 2 * inter, D, generator=g) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, inter, generator=g) * inter ** -0.5).to(dtype)
    return x, ids, weights, w13, w2


def assert_matches_reference(x, ids, weights, w13, w2):
    got = ref.routed_experts(x, ids, weights, w13, w2, LIMIT)
    want = dense_reference(x, ids, weights, w13, w2, LIMIT)
    assert got.dtype == x.dtype and got.shape == want.shape
    if x.shape[0]:
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < TOL[x.dtype], float(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 5, 37])
@pytest.mark.parametrize("K", [2, 4, 6])
def test_grouped_path_matches_dense_reference(dtype, T, K):
    x, ids, weights, w13, w2 = make(T, K, D=32, inter=16, dtype=dtype, seed=T * 10 + K)
    assert ref._grouped_mm_takes(x, w13, w2)
    assert_matches_reference(x, ids, weights, w13, w2)


@pytest.mark.parametrize("dtype, D, inter", [(torch.float32, 20, 6), (torch.bfloat16, 24, 12)])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_fallback_loop_matches_dense_reference(dtype, D, inter, T):
    """Rows that are not a multiple of 16 bytes: torch._grouped_mm refuses them, the loop runs."""
    x, ids, weights, w13, w2 = make(T, 3, D, inter, dtype, seed=T)
    assert not ref._grouped_mm_takes(x, w13, w2)
    assert_matches_reference(x, ids, weights, w13, w2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D, inter", [(32, 16), (24, 12)])  # grouped path, fallback loop
def test_token_row_is_batch_invariant(dtype, D, inter):
    """bf16: bitwise. fp32: the CPU fp32 GEMM (MKL sgemm) rounds a row differently with the number
    of rows M of its expert's GEMM (seen: M = 1, 2-3 and >= 4 differ), so a lone token (M = 1 per
    expert) matches its row in the batch only to float32 rounding."""
    x, ids, weights, w13, w2 = make(37, 6, D, inter, dtype, seed=1)
    batch = ref.routed_experts(x, ids, weights, w13, w2, LIMIT)
    for t in (0, 17, 36):
        alone = ref.routed_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], w13, w2, LIMIT)[0]
        if dtype == torch.bfloat16:
            assert torch.equal(alone, batch[t]), t
        else:
            torch.testing.assert_close(alone, batch[t], rtol=1e-6, atol=1e-6 * float(batch[t].abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hash_routed_ids(dtype):
    """V4 hash layers: ids are the token's row of tid2eid (repeated tokens, repeated rows)."""
    x, _, _, w13, w2 = make(37, 6, 32, 16, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    tid2eid = torch.rand(50, E, generator=g).argsort(dim=1)[:, :6]
    token_ids = torch.randint(0, 10, (37,), generator=g)
    logits = torch.randn(37, E, generator=g)
    ids, weights = ref.sqrtsoftplus_route(logits, None, 6, 1.5, forced=tid2eid[token_ids])
    assert torch.equal(ids, tid2eid[token_ids])
    assert_matches_reference(x, ids, weights, w13, w2)


def test_grouped_path_has_no_data_dependent_shapes():
    """Under FakeTensorMode any read of tensor data on the host (.tolist, .item, nonzero, unique)
    raises; the bf16 grouped path (the CUDA-graph path on SM90) must run and give [T, D]."""
    x, ids, weights, w13, w2 = make(5, 6, 32, 16, torch.bfloat16)
    with FakeTensorMode() as mode:
        out = ref.routed_experts(*(mode.from_tensor(t) for t in (x, ids, weights, w13, w2)), LIMIT)
    assert out.shape == (5, 32) and out.dtype == torch.bfloat16
