"""Checkpoint formats, tensor inventory, Engram hash layout and the synthetic tokenizer / checkpoint generator.

Submodules (import them directly; this package imports nothing heavy at import time):

* `formats`      — FP8 E4M3 / UE8M0 / block-FP8 / MXFP4 / row-FP8 encode and decode (model-spec §4).
* `inventory`    — `expected_tensors(arch, include_vision)`, the exact tensor inventory (§5.2, §5.3).
* `engram_hash`  — Engram token normalisation map, bucket primes / offsets, hash multipliers (§3.9).
* `tokenizer`    — deterministic synthetic byte-level BPE tokenizer with the DeepSeek special tokens (§5.5, §8.4).
* `vllm_deepinfer.tools.make_checkpoint` — the generator CLI / API that uses all of the above.
"""
