"""Correctness and speed of kernels_ascend on an Ascend 950, in one table.

    python benchmarks/ascend/bench_ascend.py [--quick] [--json OUT.json] [--reps N]

Each case draws fresh random inputs (seed printed) at V4.1-Flash full-width shapes (H=64, d=512, index
heads 32 x 128, hc=4, D=5120, 8 experts of I=2304, top-6; decode batch 64), runs the kernel on the NPU and
checks it against the torch oracle (`vllm_deepinfer.ops.reference`) evaluated on the CPU in fp32 (the
experts: in the input dtype, whose roundings the kernels reproduce), with the test suite's bounds: rel err
||out - ref|| / ||ref|| < 2e-5 (fp32) / 1.5e-2 (bf16). Speed: median wall time of eager calls with a device
sync (launch overhead included), next to the same oracle on the NPU (torch_npu's library ops): the
"torch_npu" column and the speedup kernel/torch_npu. Without an NPU (`--quick` under TRITON_INTERPRET=1)
it runs the same cases at small shapes on the CPU: a check of this script, timings meaningless (and bf16
bounds doubled: the interpreter rounds to bf16 by truncation).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import kernels_ascend  # noqa: E402
from vllm_deepinfer.checkpoint import formats  # noqa: E402
from vllm_deepinfer.ops import reference as ref  # noqa: E402

BF = torch.bfloat16
BOUND = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def cases(quick: bool):
    """(label, op, args on the CPU, dtype, oracle in fp32?) at full-width (or --quick) shapes."""
    t = 4 if quick else 64                                   # decode batch
    h, d = (16, 64) if quick else (64, 512)
    rows, ksel = (300, 48) if quick else (8192, 640)          # 128 window rows + 512 top-k compressed rows
    hi, di, nidx = (8, 32, 200) if quick else (32, 128, 4096)
    dm = 256 if quick else 5120
    e, top, inter = (4, 2, 64) if quick else (8, 6, 2304)
    sink = torch.randn(h)

    idx = torch.stack([torch.randperm(rows)[:ksel] for _ in range(t)]).int()
    idx[torch.rand(t, ksel) < 0.1] = -1
    yield ("attention indexed (decode)", "sparse_attention_indexed",
           (torch.randn(t, h, d).to(BF), (torch.randn(rows, d) * 0.5).to(BF), idx, sink, d ** -0.5), BF, True)
    yield ("attention gathered (decode)", "sparse_attention_gathered",
           (torch.randn(t, h, d).to(BF), (torch.randn(t, ksel, d) * 0.5).to(BF), torch.rand(t, ksel) < 0.9, sink,
            d ** -0.5), BF, True)
    tp, n = (8, 96) if quick else (256, 1280)
    yield ("attention masked (prefill)", "sparse_attention",
           (torch.randn(tp, h, d).to(BF), (torch.randn(n, d) * 0.5).to(BF), torch.rand(tp, n) < 0.3, sink, d ** -0.5),
           BF, True)
    yield ("indexer scores", "indexer_scores",
           (torch.randn(t, hi, di).to(BF), torch.randn(t, hi) * 0.1, torch.randn(nidx, di).to(BF)), BF, True)
    yield ("compressor softmax pool", "softmax_pool",
           (torch.randn(4 * t, 8, d), torch.randn(4 * t, 8, d)), torch.float32, True)
    hc = 4
    m = (2 + hc) * hc
    yield ("mHC coefficients", "hc_coefficients",
           (torch.randn(t, hc, dm).to(BF), torch.randn(m, hc * dm) * 0.02, torch.randn(m) * 0.1, torch.rand(3) + 0.5,
            1e-6, 1e-6, 20), torch.float32, True)
    yield ("mHC collapse", "hc_collapse", (torch.randn(t, hc, dm).to(BF), torch.rand(t, hc)), BF, True)
    yield ("mHC expand", "hc_expand", (torch.randn(t, hc, dm).to(BF), torch.randn(t, dm).to(BF), torch.rand(t, hc),
                                       torch.softmax(torch.randn(t, hc, hc), -1)), BF, True)
    nq, kq = (128, 256) if quick else (1024, dm)
    w, s = formats.quant_fp8_block(torch.randn(nq, kq) * 0.05, 32)           # V4.1: 32 x 32 scale blocks
    yield ("FP8 block linear (wq_a)", "linear_fp8_block", (torch.randn(t, kq).to(BF), w, s, (32, 32), 1), BF, True)
    g, r, kg = (2, 64, 128) if quick else (8, 1024, h * d // 8)
    w, s = formats.quant_fp8_block(torch.randn(g * r, kg) * 0.05, 32)
    yield ("FP8 block linear grouped (wo_a)", "linear_fp8_block", (torch.randn(t, g * kg).to(BF), w, s, (32, 32), g),
           BF, True)
    x = torch.randn(t, dm).to(BF)
    ids = torch.stack([torch.randperm(e)[:top] for _ in range(t)])
    wts = torch.rand(t, top)
    w13, w2 = torch.randn(e, 2 * inter, dm) * 0.02, torch.randn(e, dm, inter) * 0.02
    yield ("routed experts bf16", "routed_experts", (x, ids, wts, w13.to(BF), w2.to(BF), 10.0), BF, False)
    p13, s13 = formats.quant_mxfp4(w13)
    p2, s2 = formats.quant_mxfp4(w2)
    yield ("routed experts MXFP4", "routed_experts_packed", (x, ids, wts, p13, s13, p2, s2, 10.0), BF, False)


def _to(args, dev, fp32=False):
    def conv(a):
        if not isinstance(a, torch.Tensor):
            return a
        if fp32 and a.dtype in (torch.bfloat16, torch.float16):
            a = a.float()
        return a.to(dev)
    return tuple(conv(a) for a in args)


def _rel(out, want) -> float:
    if isinstance(out, tuple):
        return max(_rel(o, w) for o, w in zip(out, want))
    out, want = out.double().cpu(), want.double().cpu()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - want).norm() / want.norm().clamp_min(1e-30))


def timed(fn, dev: str, reps: int) -> float:
    """Median milliseconds of one eager call, device-synchronised."""
    sync = torch.npu.synchronize if dev == "npu" else (lambda: None)
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (also what runs without an NPU)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    dev = "npu" if kernels_ascend.npu_present() and kernels_ascend.triton_targets_npu() else "cpu"
    if dev == "cpu" and not kernels_ascend.interpreting():
        sys.exit("no NPU with triton-ascend: run with TRITON_INTERPRET=1 (and --quick) to check the script on the CPU")
    ops = importlib.import_module("kernels_ascend.ops")   # every kernel, whatever KERNELS_ASCEND_OPS_OFF says
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"device {dev} ({torch.npu.get_device_name(0) if dev == 'npu' else 'Triton interpreter'}), "
          f"AI cores {kernels_ascend.num_cores()}, seed {seed}")
    rows, failed = [], 0
    reps = 1 if dev == "cpu" else a.reps
    for label, op, args, dtype, ref_fp32 in cases(a.quick):
        kern, oracle = getattr(ops, op), getattr(ref, op)
        dargs = _to(args, dev)
        err = _rel(kern(*dargs), oracle(*_to(args, "cpu", fp32=ref_fp32)))
        bound = BOUND[dtype] * (2 if dev == "cpu" and dtype == BF else 1)  # the interpreter truncates to bf16
        ok = err < bound
        failed += not ok
        ms = timed(lambda: kern(*dargs), dev, reps)
        try:
            ms_ref = timed(lambda: oracle(*dargs), dev, reps)
        except Exception as e:  # noqa: BLE001 - an oracle op torch_npu lacks: report, keep going
            ms_ref = float("nan")
            print(f"  {label}: oracle on {dev} failed: {type(e).__name__}: {str(e)[:120]}")
        rows.append(dict(case=label, op=op, dtype=str(dtype).replace("torch.", ""), rel_err=err,
                         bound=bound, ok=ok, kernel_ms=ms, torch_ms=ms_ref, speedup=ms_ref / ms))
    print(f"\n| case | dtype | rel err | bound | ok | kernel ms | torch_{dev} ms | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['dtype']} | {r['rel_err']:.2e} | {r['bound']:.1e} | {'PASS' if r['ok'] else 'FAIL'} "
              f"| {r['kernel_ms']:.3f} | {r['torch_ms']:.3f} | {r['speedup']:.2f}x |")
    print(f"\n{len(rows) - failed}/{len(rows)} cases within bounds")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=dev, seed=seed, quick=a.quick, rows=rows), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
