"""FP8 block GEMM direct kernel: per-element scale loads (fbaf8c4) vs one per block and row (HEAD), same host,
bitwise check and timing (not run yet: the device refused). On a GPU host with torch + triton:

    git show fbaf8c4:kernels_nvidia/gemm.py > /tmp/gemm_old.py
    PYTHONPATH=$PWD:/tmp python3 benchmarks/results/gpu-1207b/gemm_ab.py
"""
import torch
from triton.testing import do_bench
import gemm_old
from kernels_nvidia import gemm as gemm_new
from vllm_deepinfer.checkpoint.formats import quant_fp8_block

torch.manual_seed(0)
for name, (n, k, groups) in {"wq_a|wkv": (1792, 5120, 1), "wo_a": (8192, 4096, 8), "indexer.wq_b": (4096, 1280, 1),
                             "wq_b": (32768, 1280, 1)}.items():
    codes, scale = quant_fp8_block(torch.randn(n, k) / k ** 0.5, 32)
    w, s = codes.cuda(), scale.view(torch.uint8).cuda()
    for m in (1, 16, 64, 256):
        x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
        for mod in (gemm_old, gemm_new):
            mod.DIRECT_MAX_M = 1 << 30
        yo = gemm_old.linear_fp8_block(x, w, s, (32, 32), groups)
        yn = gemm_new.linear_fp8_block(x, w, s, (32, 32), groups)
        same = torch.equal(yo, yn)
        r = []
        for _ in range(2):
            to = do_bench(lambda: gemm_old.linear_fp8_block(x, w, s, (32, 32), groups), rep=100, return_mode="median")
            tn = do_bench(lambda: gemm_new.linear_fp8_block(x, w, s, (32, 32), groups), rep=100, return_mode="median")
            r.append(f"old {to * 1e3:.1f} new {tn * 1e3:.1f} us ({to / tn:.2f}x)")
        print(f"{name} M={m}: bitwise equal {same}; " + " ; ".join(r), flush=True)
