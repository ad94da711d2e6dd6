"""Prefill sparse attention on FlashMLA's sparse prefill kernel, as bundled in vLLM's CUDA wheel (SM90/SM100).

`ops.sparse_attention_indexed` (every prefill token attends to its own packed key rows kv[idx[t, j]], a sink
absorbing mass) is exactly what `flash_mla_sparse_fwd` computes: q [T, H, 512] bf16, kv [R, 1, 512] bf16, indices
[T, 1, K] int32 with -1 for no row, the sink per head in the scores' units (output scaled by
exp(lse) / (exp(lse) + exp(sink))). vLLM's in-tree V4.1 prefill runs it (2026-12-03 H200 profile, 4 x 1024 tokens:
1.9 ms for 8 layers against 7.1 ms for our Triton kernel), with each token's valid ids first and their count as
`topk_length`; so do we (`compact_indices`): a 1024-token prompt fills about half of a CSA token's 128 + 512 ids
and a fifth of an HCA token's, and without the lengths the kernel walks the -1 padding too.

Off by default until measured end to end on the H200 (`VLLM_DEEPINFER_FLASHMLA=1` turns it on); batch-invariant
mode keeps the Triton kernel. Shapes it does not take (other head counts or widths, other dtypes) and a failing
call fall back to the Triton kernel (`ops.library.LibraryKernel`).
"""

from __future__ import annotations

import torch

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


def compact_indices(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """idx: [T, K] (-1 = none) -> (ids [T, K'] int32 with each row's valid ids first in their order, then -1,
    K' = K rounded up to TOPK_MULTIPLE; lens [T] int32 = valid ids per row). FlashMLA's `topk_length` then stops each
    query at its last valid key instead of walking the padding (vLLM's in-tree V4.1 passes it the same way)."""
    t, k = idx.shape
    width = k + (-k % TOPK_MULTIPLE)
    valid = idx >= 0
    slot = torch.where(valid, valid.cumsum(1) - 1, width)         # invalid ids go to a dump column
    out = torch.full((t, width + 1), -1, dtype=torch.int32, device=idx.device)
    out.scatter_(1, slot, idx.to(torch.int32))
    return out[:, :width], valid.sum(1, dtype=torch.int32)


def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                             scale: float) -> torch.Tensor | None:
    """q: [T, H, 512]; kv: [R, 512]; idx: [T, K] (-1 = none); sink: [H] -> [T, H, 512], or None (not served)."""
    ids, lens = compact_indices(idx)
    res = KERNEL.run(q=q.contiguous(), kv=kv.contiguous().view(-1, 1, WIDTH), indices=ids.unsqueeze(1),
                     sm_scale=scale, attn_sink=sink.float().contiguous(), topk_length=lens)
    if res is None:
        return None
    return (res[0] if isinstance(res, (list, tuple)) else res).to(q.dtype)  # (out, max_logits, lse)
