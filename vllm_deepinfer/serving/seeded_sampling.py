"""Deterministic sampling for batch-invariant mode (`DEEPINFER_BATCH_INVARIANT=1`, issue 12).

A request with a seed draws token `t` at sequence position `pos` by Gumbel-max over its processed
logits (temperature, then top-k / top-p) with noise that is a pure function of (seed, pos, t):

    u = (hash32(seed, pos, t) + 0.5) / 2**32,   token = argmax_t  logits[t] / T + (-log(-log u))

No generator state is carried between steps, so the draw does not depend on the batch, on the
request's place in it, on how its prefill was chunked, or on preemption and recompute (vLLM's V1
runner re-seeds a resumed request's generator from the start of its stream; its CPU generator
cannot rewind a discarded chunked-prefill draw and raises). Requests without a seed get a fresh
random seed per step (no guarantee is asked for). Greedy rows (temperature 0) stay argmax.

hash32 is boost's hash_combine over the 32-bit words (seed low, seed high, pos, t) followed by
murmur3's fmix32 finaliser, computed in int64 tensors (products wrap; only the low 32 bits are kept),
so it runs unchanged on CPU and CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _combine(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """boost::hash_combine of a 32-bit key into a 32-bit hash, then fmix32."""
    return _fmix32((h ^ ((k & _M32) + 0x9E3779B9 + ((h << 6) & _M32) + (h >> 2))) & _M32)


def gumbel_noise(seeds: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise keyed by (seed, position, token). seeds, pos: [B] int64 -> [B, vocab] float32."""
    t = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _combine(torch.zeros_like(seeds), seeds)
    h = _combine(h, seeds >> 32)
    h = _combine(h, pos.to(torch.int64))
    h = _combine(h.unsqueeze(1), t.unsqueeze(0))
    u = (h.to(torch.float64) + 0.5) * 2.0**-32
    return (-torch.log(-torch.log(u))).to(torch.float32)


class SeededSampler(nn.Module):
    """Replaces vLLM V1's `TopKTopPSampler` (`Sampler.topk_topp_sampler`) in batch-invariant mode.

    `keys` (seeds [B], positions [B] of the token being drawn) is set by the runner before each
    sampling call (`vllm_deepinfer/patches/seeded_sampler.py`).
    """

    def __init__(self, logprobs_mode: str):
        super().__init__()
        self.logprobs_mode = logprobs_mode
        self.keys: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, logits: torch.Tensor, generators: dict, k: torch.Tensor | None,
                p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits: [B, V] (temperature applied) -> (tokens [B], processed logits/logprobs or None)."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

        if self.keys is None:
            raise RuntimeError("SeededSampler called without per-request keys (seed, position)")
        seeds, pos = self.keys
        if k is not None or p is not None:
            logits = apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=logits.device.type == "cpu")
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        noisy = logits.float() + gumbel_noise(seeds.to(logits.device), pos.to(logits.device), logits.shape[-1])
        return noisy.argmax(dim=-1), processed


def seeded_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows to draw by Gumbel-max: logits [R, V] (processors applied); temperature, top_k, top_p, seeds, pos: [R]
    -> fp32 [R, V] whose argmax is the seeded draw, by the same ops as the non-speculative path
    (`Sampler.apply_temperature`, then `SeededSampler`). Used for the verified rows of a speculative step and
    for the MTP drafter's coupled drafts in batch-invariant mode (`patches/seeded_sampler.py`)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = logits.float().div_(temperature.unsqueeze(1))
    if top_k is not None or top_p is not None:
        x = apply_top_k_top_p_pytorch(x, top_k, top_p, allow_cpu_sync=x.device.type == "cpu")
    return x + gumbel_noise(seeds.to(x.device), pos.to(x.device), x.shape[-1])


def seeded_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> fp32 copy whose rows with temperature > 0 are `seeded_logits` (argmax = the seeded draw);
    greedy rows (temperature 0) unchanged. temperature, top_k, top_p, seeds, pos: [R]."""
    out = logits.float().clone()
    rows = torch.nonzero(temperature > 0).flatten()
    if rows.numel():
        k, p = (None if x is None else x[rows] for x in (top_k, top_p))
        out[rows] = seeded_logits(out[rows], temperature[rows], k, p, seeds[rows.to(seeds.device)],
                                  pos[rows.to(pos.device)])
    return out
