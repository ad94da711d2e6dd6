"""The A/B of h100_moe_ab_tiles2.log (run inline on the H100, host torch): fp16-trick dequantisation (T) vs
tl.dot_scaled (S, since removed from kernels_nvidia.moe) at (BM, BN) tiles, E=384 top-6, D 5120, I 2304.
Kept as the record of what ran; the S rows need the kernel of commit d047cf0. The same sweep for the current
kernel: `PYTHONPATH=$PWD python3 benchmarks/bench_kernels.py --moe-only --quick` (E=384 rows)."""
import torch
from triton.testing import do_bench
from kernels_nvidia import moe
E8, D, I, K, E = 8, 5120, 2304, 6, 384
DEV = "cuda"
w = [torch.randint(0, 256, s, device=DEV, dtype=torch.uint8) for s in ((E8, 2*I, D//2), (E8, 2*I, D//32), (E8, D, I//2), (E8, D, I//32))]
w[1].clamp_(118, 126); w[3].clamp_(118, 126)
w = [t.repeat(E // E8, *(1,) * (t.dim() - 1)) for t in w]
cfgs = [(False, (64, 64, 128, 4)), (False, (16, 64, 128, 4)), (False, (32, 64, 128, 4)), (False, (16, 128, 128, 8)), (True, (16, 32, 128, 4)), (True, (16, 64, 128, 4))]
for rnd in range(2):
  for t in (1, 16, 64, 256):
    ids = torch.rand(t, E, device=DEV).argsort(dim=1)[:, :K]; wts = torch.rand(t, K, device=DEV)
    x = torch.randn(t, D, device=DEV, dtype=torch.bfloat16)
    row = []
    for sc, tiles in cfgs:
        moe.BM, moe.BN, moe.BK, moe.WARPS = tiles; moe.SCALED_DOT = sc
        ms = do_bench(lambda: moe.routed_experts_packed(x, ids, wts, *w, 10.0), warmup=20, rep=150, return_mode="median")
        row.append(f"{'S' if sc else 'T'}{tiles[:2]}{'w8' if tiles[3] == 8 else ''} {ms * 1e3:.0f}")
    print(f"r{rnd} T={t}:", " | ".join(row), flush=True)
