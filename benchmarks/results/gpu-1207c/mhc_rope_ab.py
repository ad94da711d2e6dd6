"""mHC coefficients (decode tiles everywhere, b3628b8) vs prefill tiles from 256 tokens, and RoPE copy vs in place.

Run from the repository root with .gpuwork/ab/{mhc_old,rowwise_old}.py (git show b3628b8:kernels_nvidia/...)."""
import sys
import torch
from triton.testing import do_bench
sys.path.insert(0, ".gpuwork/ab")
import mhc_old
import rowwise_old
from kernels_nvidia import mhc as mhc_new
from kernels_nvidia import rowwise as rw_new

torch.manual_seed(0)
h, d = 4, 5120
fn = torch.randn(24, h * d, device="cuda") * 0.02
base, scale = torch.randn(24, device="cuda") * 0.1, torch.rand(3, device="cuda") + 0.5
for t in (1, 16, 64, 256, 1024, 4096, 16384):
    st = torch.randn(t, h, d, device="cuda").to(torch.bfloat16)
    old = mhc_old.hc_coefficients(st, fn, base, scale, 1e-6, 1e-6, 20)
    new = mhc_new.hc_coefficients(st, fn, base, scale, 1e-6, 1e-6, 20)
    diff = max(float((a - b).abs().max()) for a, b in zip(old, new))
    to = do_bench(lambda: mhc_old.hc_coefficients(st, fn, base, scale, 1e-6, 1e-6, 20), rep=200, return_mode="median")
    tn = do_bench(lambda: mhc_new.hc_coefficients(st, fn, base, scale, 1e-6, 1e-6, 20), rep=200, return_mode="median")
    print(f"hc_coefficients T={t}: max |old - new| {diff:.2e}; old {to * 1e3:.1f} us new {tn * 1e3:.1f} us "
          f"({to / tn:.2f}x)", flush=True)
for t in (1, 64, 256, 4096):
    ang = torch.rand(t, 32, device="cuda") * 100
    cos, sin = ang.cos(), ang.sin()
    for name, shape in (("q", (t, 64, 512)), ("kv", (t, 512)), ("index q", (t, 64, 128))):
        x = torch.randn(*shape, device="cuda").to(torch.bfloat16)
        same = torch.equal(rowwise_old.apply_rope(x, cos, sin), rw_new.apply_rope_(x.clone(), cos, sin))
        to = do_bench(lambda: rowwise_old.apply_rope(x, cos, sin), rep=100, return_mode="median")
        tn = do_bench(lambda: rw_new.apply_rope_(x, cos, sin), rep=100, return_mode="median")
        print(f"rope {name} {tuple(shape)}: bitwise {same}; copy {to * 1e3:.1f} us in place {tn * 1e3:.1f} us "
              f"({to / tn:.2f}x)", flush=True)
