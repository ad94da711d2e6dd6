"""`vllm.platform_plugins` entry point of the Ascend 950 platform.

`detect()` is called (twice) in every vLLM process; it must be cheap and return None off Ascend so
CUDA and CPU installs never activate it. The Ascend platform class itself is future work.
"""

from __future__ import annotations

import importlib.util


def detect() -> str | None:
    """Platform class qualname when an Ascend NPU is usable, else None."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    return None  # the Ascend 950 platform class is not implemented yet
