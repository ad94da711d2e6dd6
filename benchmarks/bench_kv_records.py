"""Decode attention over fp8_ds_mla records against exact bf16 rows, one kernel each, same keys (CUDA only).

`kernels_nvidia.attention.sparse_attention_records` (record pages, dequantised in registers) against
`sparse_attention_paged` (bf16 rows) for one layer's decode step: T tokens x H heads, each reading 128 window
keys + 512 selected compressed keys at random rows of a 4,096-block pool. Prints microseconds and records/rows.
Needs only torch + triton (the host's own, no vLLM):

    PYTHONPATH=$PWD python3 benchmarks/bench_kv_records.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from kernels_nvidia import attention, kv_records
from vllm_deepinfer.ops import quant

PAGE, BLOCKS, WINDOW, SELECTED = 65536, 4096, 128, 512
SHAPES = ((1, 64), (16, 64), (64, 64), (64, 16), (256, 64))  # (tokens, heads on this rank)


def main() -> None:
    torch.manual_seed(0)
    r = PAGE // quant.KV_RECORD_BYTES  # records a page
    rows = BLOCKS * 64                 # exact rows: 64 a page
    pages = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8, device="cuda")
    kv_records.kv_record_store(pages, torch.arange(rows, device="cuda"),
                               torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16) * 0.5, r)
    kv = kv_records.kv_record_gather(pages, torch.arange(rows, device="cuda"), r, torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: {BLOCKS} pages of {PAGE} B, keys {WINDOW} window + {SELECTED} compressed")
    for t, h in SHAPES:
        q = torch.randn(t, h, 512, device="cuda", dtype=torch.bfloat16)
        sink = torch.randn(h, device="cuda")
        ia = torch.randint(0, rows, (t, WINDOW), device="cuda", dtype=torch.int32)
        ib = torch.randint(0, rows, (t, SELECTED), device="cuda", dtype=torch.int32)
        exact = do_bench(lambda: attention.sparse_attention_paged(q, kv, ia, kv, ib, sink, 0.044))
        rec = do_bench(lambda: attention.sparse_attention_records(q, pages, ia, pages, ib, r, sink, 0.044))
        print(f"T={t:4d} H={h:3d}: rows {exact * 1e3:8.1f} us  records {rec * 1e3:8.1f} us  records/rows {rec / exact:5.2f}")


if __name__ == "__main__":
    main()
