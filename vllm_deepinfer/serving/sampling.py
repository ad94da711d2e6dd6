"""`SamplingParams` that also takes DeepInfer's `so_args={...}` and `seq_seed` (offline API).

Why a subclass and not a patch: vLLM's `SamplingParams` is a `msgspec.Struct`; its constructor is
generated in C, so an unknown keyword cannot be intercepted by patching `__init__`. A subclass
with one extra field is a real `vllm.SamplingParams` (`isinstance` holds, `LLM.generate` and
`clone()` accept it); `__post_init__` moves `so_args` into `structured_outputs` and clears it,
so what crosses to the engine core (msgspec, `omit_defaults`) is byte-for-byte a plain
`SamplingParams`. Unknown keys raise `ValueError` at construction. `seq_seed` (DeepInfer's per-request
seed) is moved into vLLM's `seed` the same way; with `DEEPINFER_BATCH_INVARIANT=1` it keys the draws by
(seed, position) (`serving/seeded_sampling.py`).

    from vllm_deepinfer.serving import SamplingParams
    SamplingParams(max_tokens=64, so_args={"json": schema}, seq_seed=7)
"""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import SamplingParams as _VllmSamplingParams

from vllm_deepinfer.serving.so_args import to_structured_outputs


class SamplingParams(_VllmSamplingParams, omit_defaults=True):  # type: ignore[call-arg]
    so_args: dict[str, Any] | None = None
    seq_seed: int | None = None

    def __post_init__(self) -> None:
        if self.seq_seed is not None:
            if self.seed is not None and self.seed != self.seq_seed:
                raise ValueError("give either seq_seed or seed, not both")
            self.seed, self.seq_seed = self.seq_seed, None
        if self.so_args is not None:
            if self.structured_outputs is not None:
                raise ValueError("give either so_args or structured_outputs, not both")
            self.structured_outputs = to_structured_outputs(self.so_args)
            self.so_args = None
        super().__post_init__()
