"""Is vLLM's Marlin W8A16 GEMM batch-invariant on this GPU for the model's FP8 linears? (issue 12)

Batch-invariant mode keeps the FP8 linears off Marlin because Marlin chooses its thread-block shape and
its K partition across thread blocks from the problem size, M included: a row's summation order may then
depend on how many other rows share the call. That costs the mode ~2x at decode batch 1 on the H200
(NOTES.md, 2026-12-01 third session). This test measures the question exhaustively instead of guessing:
for every V4.1 linear the model runs on Marlin (the stacked wq_a|wkv and shared w1|w3 included), every
M in 1..MAX_M gives rows bitwise equal to the same rows computed alone (M = 1). It prints the first M
that differs per matrix; `xfail`-free: the result decides whether Marlin may serve the invariant mode
(it would be invariant for these shapes on this GPU model only, which the README would have to say).

    PYTHONPATH=$PWD python3 -m pytest -q -s tests/gpu/test_marlin_invariance.py   (needs vLLM 0.32 on CUDA)
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

MAX_M = int(os.environ.get("DEEPINFER_MARLIN_MAX_M", "512"))
BLOCK = 32
#: name -> (N, K): the V4.1 release linears on Marlin (wo_a stays on the Triton grouped kernel)
SHAPES = {"wq_a|wkv": (1792, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192), "indexer.wq_b": (4096, 1280),
          "shared.w1|w3": (4608, 5120), "shared.w2": (5120, 2304)}
PROBE_ROWS = (0, 1, 15, 16, 63, 64, 255)  # rows compared (those below M), at tile boundaries of Marlin's configs


@pytest.mark.parametrize("name", list(SHAPES))
def test_marlin_rows_do_not_depend_on_m(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from vllm_deepinfer.checkpoint.formats import quant_fp8_block
    from vllm_deepinfer.ops import marlin

    n, k = SHAPES[name]
    torch.manual_seed(0)
    codes, scale = quant_fp8_block(torch.randn(n, k) / k ** 0.5, BLOCK)
    mat = marlin.MarlinFP8.from_packed(codes.cuda(), scale.view(torch.uint8).cuda(), (BLOCK, BLOCK), torch.bfloat16)
    x = torch.randn(MAX_M, k, device="cuda", dtype=torch.bfloat16)
    alone = {r: mat(x[r:r + 1].clone()) for r in PROBE_ROWS if r < MAX_M}
    differs = []
    for m in range(1, MAX_M + 1):
        y = mat(x[:m].clone())
        bad = [r for r in alone if r < m and not torch.equal(y[r:r + 1], alone[r])]
        if bad:
            differs.append((m, bad))
    print(f"\nMarlin {name} [{n} x {k}]: {len(differs)} of {MAX_M} batch sizes change a probed row"
          + (f"; first M={differs[0][0]} rows {differs[0][1]}" if differs else ""))
    assert not differs, f"{name}: rows depend on M (first {differs[:3]})"
