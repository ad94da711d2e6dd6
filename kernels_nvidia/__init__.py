"""NVIDIA (Hopper, SM100) kernels for vllm-deepinfer; a leaf package: imports torch/triton only.

Importing this package never touches a GPU or Triton: `available()` says whether the kernels can run
(CUDA device present and Triton importable), and `load_ops()` returns the kernel module (imported lazily).

Every kernel takes plain tensors and has the same signature and semantics as the torch oracle
`vllm_deepinfer.ops.reference` (this package does not import it). Kernels are written so that a
batch-invariant variant is the default: tiles are fixed (never chosen from the number of tokens),
there is no batch-dependent split of a reduction, and every reduction runs in a fixed order.
Split-K, where used (mHC coefficients), splits the reduction dimension into fixed-size chunks that
depend on the model width only, and the partial results are summed in a fixed order.

SM100: the same Triton kernels compile for SM100 (untested there); library kernels for SM100
(FlashMLA sparse, DeepGEMM) are not wired yet.
"""

from __future__ import annotations

import os

_OPS = None
_AVAILABLE: bool | None = None


def available() -> bool:
    """True when a CUDA device is visible and Triton imports (or TRITON_INTERPRET=1 for CPU testing)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import torch
            import triton  # noqa: F401
            _AVAILABLE = bool(torch.cuda.is_available()) or os.environ.get("TRITON_INTERPRET") == "1"
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            _AVAILABLE = False
    return _AVAILABLE


def load_ops():
    """The kernel module (`kernels_nvidia.ops`); raises ImportError when Triton is missing."""
    global _OPS
    if _OPS is None:
        from kernels_nvidia import ops as _mod
        _OPS = _mod
    return _OPS


def sm_version() -> tuple[int, int] | None:
    """(major, minor) compute capability of the current CUDA device, None without one."""
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()
