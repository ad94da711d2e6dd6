"""Prefill sparse attention on FlashMLA's sparse prefill kernel, as bundled in vLLM's CUDA wheel (SM90/SM100).

`ops.sparse_attention_indexed` (every prefill token attends to its own packed key rows kv[idx[t, j]], a sink
absorbing mass) is exactly what `flash_mla_sparse_fwd` computes: q [T, H, 512] bf16, kv [R, 1, 512] bf16, indices
[T, 1, K] int32 with -1 for no row, the sink per head in the scores' units (output scaled by
exp(lse) / (exp(lse) + exp(sink))). vLLM's in-tree V4.1 prefill runs it (2026-12-03 H200 profile, 4 x 1024 tokens:
1.9 ms for 8 layers against 7.1 ms for our Triton kernel).

Off by default until measured end to end on the H200 (`VLLM_DEEPINFER_FLASHMLA=1` turns it on); batch-invariant
mode keeps the Triton kernel. Shapes it does not take (other head counts or widths, other dtypes) and a failing
call fall back to the Triton kernel (`ops.library.LibraryKernel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_deepinfer.ops.library import LibraryKernel

HEADS = (64, 128)  # query heads the sparse prefill kernel takes
WIDTH = 512        # d_qk = d_v of DeepSeek V4 / V4.1
TOPK_MULTIPLE = 128


def _load():
    from vllm.v1.attention.ops.flashmla import flash_mla_sparse_fwd, is_flashmla_sparse_supported

    return flash_mla_sparse_fwd if is_flashmla_sparse_supported()[0] else None


KERNEL = LibraryKernel("FlashMLA sparse prefill", "VLLM_DEEPINFER_FLASHMLA", _load)


def takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether this path serves a call with these shapes (and is switched on)."""
    return (not KERNEL.off and q.is_cuda and q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16
            and q.shape[1] in HEADS and q.shape[2] == WIDTH and kv.shape[-1] == WIDTH and q.shape[0] > 0)


def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                             scale: float) -> torch.Tensor | None:
    """q: [T, H, 512]; kv: [R, 512]; idx: [T, K] (-1 = none); sink: [H] -> [T, H, 512], or None (not served)."""
    pad = -idx.shape[1] % TOPK_MULTIPLE
    ids = F.pad(idx, (0, pad), value=-1) if pad else idx
    res = KERNEL.run(q=q.contiguous(), kv=kv.contiguous().view(-1, 1, WIDTH), indices=ids.to(torch.int32).unsqueeze(1),
                     sm_scale=scale, attn_sink=sink.float().contiguous())
    if res is None:
        return None
    return (res[0] if isinstance(res, (list, tuple)) else res).to(q.dtype)  # (out, max_logits, lse)
