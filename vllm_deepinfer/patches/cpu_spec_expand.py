"""Patch: per-token temperatures (and top-k / top-p) of vLLM's rejection sampler on CPU.

Reason: vLLM 0.32's rejection sampler expands per-request sampling parameters to the draft tokens with
`expand_batch_to_tokens` (`vllm/v1/sample/rejection_sampler.py`), which writes into `x.new_empty(n)`
through the `expand_kernel`. Without Triton-CPU the kernel is the C++ fallback
`cpu_triton_utils._expand_kernel_impl`, which calls the op on `_ensure_int64(output)`: for the float32
temperature tensor (or an int32 top-k tensor) that is a converted *copy*, so the op's writes are lost and
the rejection sampler divides the target logits by uninitialised memory. Observed on the tiny V4
checkpoints: p(draft) of 1/V, 0, 1.0 and NaN after `apply_sampling_constraints` for logits that are finite
before it, and sampled outputs far more concentrated than without speculation (tests/test_spec_decode.py
`test_seeded_sampling_distribution` fails without this patch). Greedy requests never reach it.

Fix: on CPU, replace the module-level `expand_batch_to_tokens` (looked up at call time by
`apply_sampling_constraints`) with the same map in torch ops: x[r] repeated over request r's draft
tokens, `replace_from` -> `replace_to`. Applied on CPU by the DeepInfer drafters' constructors
(`spec_decode.proposer.policy_for`).
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """x [B] -> [num_tokens]: x[r] for each of request r's tokens (cu_num_tokens [B] cumulative counts)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def apply() -> None:
    from vllm.v1.sample import rejection_sampler

    if getattr(rejection_sampler.expand_batch_to_tokens, "_deepinfer", False):
        return
    expand_batch_to_tokens._deepinfer = True
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
