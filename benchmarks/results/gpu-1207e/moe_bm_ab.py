"""Row tile BM of the invariant MXFP4 experts at prefill sizes (E=384 top-6, D 5120, I 2304, bf16), do_bench median
us, and whether a row's bits change with BM. PYTHONPATH=$PWD python3 moe_bm_ab.py (host torch)."""
import torch
from triton.testing import do_bench
from kernels_nvidia import moe
E8, D, I, K, E = 8, 5120, 2304, 6, 384
DEV = "cuda"
torch.manual_seed(0)
w = [torch.randint(0, 256, s, device=DEV, dtype=torch.uint8) for s in ((E8, 2*I, D//2), (E8, 2*I, D//32), (E8, D, I//2), (E8, D, I//32))]
w[1].clamp_(118, 126); w[3].clamp_(118, 126)
w = [t.repeat(E // E8, *(1,) * (t.dim() - 1)) for t in w]
for t in (256, 1024, 4096):
    ids = torch.rand(t, E, device=DEV).argsort(dim=1)[:, :K]; wts = torch.rand(t, K, device=DEV)
    x = torch.randn(t, D, device=DEV, dtype=torch.bfloat16)
    row, base = [], None
    for bm, bn, warps in ((16, 64, 4), (32, 64, 4), (64, 64, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8)):
        moe.BM, moe.BN, moe.WARPS = bm, bn, warps
        o = moe.routed_experts_packed(x, ids, wts, *w, 10.0)
        base = o if base is None else base
        us = do_bench(lambda: moe.routed_experts_packed(x, ids, wts, *w, 10.0), warmup=5, rep=60, return_mode="median") * 1e3
        row.append(f"({bm},{bn},w{warps}) {us:.0f}{'' if torch.equal(o, base) else ' DIFF'}")
    print(f"T={t}:", " | ".join(row), flush=True)
