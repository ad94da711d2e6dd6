"""Ascend 950 kernels and platform for vllm-deepinfer; a leaf package: imports torch/triton(-ascend)/torch_npu.

Import-safe without CANN, torch_npu or triton: `available()` says whether the kernels can run (an NPU
with torch_npu and a Triton with the Ascend driver, or TRITON_INTERPRET=1 for CPU testing), and
`load_ops()` returns the kernel module (imported lazily). The platform entry (`platform.py`) and the
platform class module it names (`npu_platform.py`, the only module here that imports vLLM) are separate.

Every kernel takes plain tensors and has the oracle's signature and semantics
(`vllm_deepinfer.ops.reference`, not imported here). Kernel source is our own, written for the
Ascend Triton dialect (triton-ascend 3.2) within the subset the stock interpreter also runs:

* persistent 1-D grids: `grid = (min(tasks, num_cores()),)` and each program loops over its tasks
  (`for task in range(pid, tasks, num_programs)`): on the NPU a program is bound to a physical AI core;
  the grid must not exceed the core count, and 2-D grids are merged into 1-D;
* power-of-two, 1-D-friendly tiles small enough for the unified buffer (at most 64 x 512 elements of a
  matrix operand); `tl.dot` on bf16/fp16 operands with fp32 accumulation (the cube unit), everything else
  on the vector unit in fp32;
* no tl.dot_scaled, inline asm, fp8 Triton dtypes, atomics or warp-level options: FP8 (E4M3) and MXFP4
  (E2M1) codes are decoded from their bytes with integer/float arithmetic in-kernel, E8M0 scales by
  building the fp32 exponent bits, so one source runs on the 950, on other Triton backends and in the
  interpreter;
* fixed tiles and a fixed reduction order (never chosen from the batch): batch-invariant, as kernels_nvidia.

kernels_nvidia is not imported (leaf-to-leaf sharing was possible but its kernels use 2-/3-D logical
grids far larger than the core count and CUDA-specific launch options).
"""

from __future__ import annotations

import os

_OPS = None
_AVAILABLE: bool | None = None
_CORES: tuple[int, int] | None = None

#: Programs a kernel launches when no NPU reports its core count (the Triton interpreter): small, so
#: the tests exercise programs that loop over several tasks.
INTERPRETER_CORES = 3


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def npu_present() -> bool:
    """torch_npu imports and sees an NPU."""
    try:
        import torch
        import torch_npu  # noqa: F401
        return torch.npu.is_available() and torch.npu.device_count() > 0
    except Exception:  # noqa: BLE001 - missing or broken CANN: no NPU
        return False


def triton_targets_npu() -> bool:
    """Whether the installed Triton has an Ascend backend (triton-ascend), not only CUDA/ROCm ones."""
    from triton.backends import backends
    return any(name in backends for name in ("ascend", "npu", "cann"))


def available() -> bool:
    """True when the kernels can run: an NPU with triton-ascend, or TRITON_INTERPRET=1 on CPU."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            _AVAILABLE = interpreting() or (npu_present() and triton_targets_npu())
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            _AVAILABLE = False
    return _AVAILABLE


#: Comma-separated op names whose kernel is not used (the torch reference, i.e. torch_npu's library ops, runs
#: instead), e.g. ops that `benchmarks/ascend/validate.sh` measured slower than torch_npu on the 950.
OPS_OFF_ENV = "KERNELS_ASCEND_OPS_OFF"


def load_ops():
    """The enabled kernels of `kernels_ascend.ops` as a namespace (`OPS` minus $KERNELS_ASCEND_OPS_OFF);
    raises ImportError when Triton is missing and ValueError for an unknown op name."""
    global _OPS
    if _OPS is None:
        import types

        from kernels_ascend import ops as mod
        off = {n.strip() for n in os.environ.get(OPS_OFF_ENV, "").split(",") if n.strip()}
        if off - set(mod.OPS):
            raise ValueError(f"{OPS_OFF_ENV}: unknown ops {sorted(off - set(mod.OPS))}; known: {', '.join(mod.OPS)}")
        _OPS = types.SimpleNamespace(**{n: getattr(mod, n) for n in mod.OPS if n not in off})
    return _OPS


def num_cores(vector: bool = False) -> int:
    """Programs per launch on the current NPU: its AI cores (kernels using the cube unit), or its vector
    cores (`vector`: kernels without `tl.dot`); INTERPRETER_CORES without an NPU."""
    global _CORES
    if _CORES is None:
        _CORES = (INTERPRETER_CORES, INTERPRETER_CORES)
        if not interpreting() and npu_present():
            import torch
            import triton
            props = triton.runtime.driver.active.utils.get_device_properties(torch.npu.current_device())
            _CORES = (int(props.get("num_aicore", -1)), int(props.get("num_vectorcore", -1)))
            if min(_CORES) <= 0:
                raise RuntimeError(f"triton-ascend reported no AI/vector cores: {props}")
    return _CORES[1] if vector else _CORES[0]
