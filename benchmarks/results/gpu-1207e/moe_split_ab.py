"""Fixed reduction splits of the invariant MXFP4 experts (kernels_nvidia.moe SPLIT_GATE_UP / SPLIT_DOWN):
E=384 top-6, D 5120, I 2304 (release widths), bf16, triton.testing.do_bench median us, two rounds.
PYTHONPATH=$PWD python3 moe_split_ab.py (host torch, no vLLM). The split kernels it timed were an uncommitted
experiment, reverted after this run (no gain): at any commit the SPLIT_* assignments below do nothing. The tile
check at the end still runs as it ran."""
import torch
from triton.testing import do_bench
from kernels_nvidia import moe
E8, D, I, K, E = 8, 5120, 2304, 6, 384
DEV = "cuda"
torch.manual_seed(0)
w = [torch.randint(0, 256, s, device=DEV, dtype=torch.uint8) for s in ((E8, 2*I, D//2), (E8, 2*I, D//32), (E8, D, I//2), (E8, D, I//32))]
w[1].clamp_(118, 126); w[3].clamp_(118, 126)
w = [t.repeat(E // E8, *(1,) * (t.dim() - 1)) for t in w]
cfgs = [(1, 1), (2, 2), (4, 4), (8, 4), (4, 2), (8, 8), (2, 1)]
for rnd in range(2):
    for t in (1, 4, 16, 64, 256):
        ids = torch.rand(t, E, device=DEV).argsort(dim=1)[:, :K]; wts = torch.rand(t, K, device=DEV)
        x = torch.randn(t, D, device=DEV, dtype=torch.bfloat16)
        row, ref = [], None
        for gu, dn in cfgs:
            moe.SPLIT_GATE_UP, moe.SPLIT_DOWN = gu, dn
            out = moe.routed_experts_packed(x, ids, wts, *w, 10.0)
            ref = out if ref is None else ref
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us = do_bench(lambda: moe.routed_experts_packed(x, ids, wts, *w, 10.0), warmup=20, rep=150,
                          return_mode="median") * 1e3
            row.append(f"({gu},{dn}) {us:.0f}" + (f" e{err:.0e}" if rnd == 0 else ""))
        print(f"r{rnd} T={t}:", " | ".join(row), flush=True)
# Do tile shapes change a row's bits? (BM = the MMA's N; BN = its M: 64 -> wgmma, 16/32 -> mma.sync)
moe.SPLIT_GATE_UP, moe.SPLIT_DOWN = 1, 1
t = 64
ids = torch.rand(t, E, device=DEV).argsort(dim=1)[:, :K]; wts = torch.rand(t, K, device=DEV)
x = torch.randn(t, D, device=DEV, dtype=torch.bfloat16)
outs = {}
for bm, bn, warps in ((16, 64, 4), (64, 64, 4), (128, 64, 4), (16, 128, 8), (16, 32, 4), (64, 128, 8)):
    moe.BM, moe.BN, moe.WARPS = bm, bn, warps
    outs[(bm, bn, warps)] = o = moe.routed_experts_packed(x, ids, wts, *w, 10.0)
    base = outs[(16, 64, 4)]
    print(f"tiles BM {bm} BN {bn} warps {warps}: bitwise == (16,64,4): {torch.equal(o, base)}, "
          f"rows differing {(o != base).any(dim=1).sum().item()}", flush=True)
