"""`vllm.platform_plugins` entry point of the Ascend 950 platform.

vLLM calls `detect()` (twice) in every process, on CUDA and CPU installs too, and swallows its
exceptions at DEBUG level (`vllm/platforms/__init__.py:256-267`). So it is cheap off Ascend (one
`find_spec`), it never raises, and it explains every refusal at WARNING/ERROR level itself.

Everything `detect()` looks at comes from one function, `probe()`; `decide()` is the whole policy:

| probe | decision |
|---|---|
| torch_npu not importable, or no NPU visible | None (silent: not an Ascend host) |
| NPU present, not an Ascend 950 (910B, 910_93, 310P, ...) | None, ERROR naming the chip |
| torch_npu built for another torch than the running one | None, ERROR naming both versions |
| Ascend 950, and vllm-ascend's platform plugin would load too | our qualname + ERROR naming both (vLLM refuses) |
| Ascend 950 | `kernels_ascend.npu_platform.Ascend950Platform` |

With vllm-ascend beside ours vLLM raises "Only one platform plugin can be activated, but got: ['ascend',
'deepinfer_ascend']" after our ERROR has said why and what to do.

vllm-ascend counts only when vLLM would load its plugin: its `vllm.platform_plugins` entry point is
installed and `VLLM_PLUGINS`, if set, names it. `VLLM_PLUGINS=deepinfer,deepinfer_ascend` therefore runs
ours beside an installed vllm-ascend. This module imports neither vLLM nor torch at import time.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("kernels_ascend.platform")

PLATFORM_QUALNAME = "kernels_ascend.npu_platform.Ascend950Platform"
OUR_PLUGIN = "deepinfer_ascend"
# Device names torch_npu reports for the Ascend 950 generation ("Ascend910_95" is its pre-release name,
# as in torchair's `is_arch35`).
ASCEND_950_PREFIXES = ("Ascend950", "Ascend910_95")


@dataclass(frozen=True)
class Probe:
    """Everything the platform decision depends on."""

    torch_npu: str | None          # torch_npu version, None when it does not import
    torch: str | None              # the running torch's version
    device_count: int              # visible NPUs
    device_name: str | None        # torch_npu's name of NPU 0 (the SoC name, e.g. "Ascend910B2")
    vllm_ascend: str | None        # "name -> value" of vllm-ascend's platform entry point, when vLLM would load it


def _vllm_ascend_plugin() -> str | None:
    """vllm-ascend's platform entry point if vLLM would load it (installed and allowed by VLLM_PLUGINS)."""
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else {p.strip() for p in allowed.split(",") if p.strip()}
    for ep in importlib.metadata.entry_points(group="vllm.platform_plugins"):
        if ep.name == OUR_PLUGIN or not ep.value.startswith("vllm_ascend"):
            continue
        if allowed is None or ep.name in allowed:
            return f"{ep.name} -> {ep.value}"
    return None


@functools.lru_cache(maxsize=1)
def _probe_npu() -> tuple[str | None, str | None, int, str | None]:
    """(torch_npu version, torch version, device count, name of device 0); cached: detect() runs twice."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, None, 0, None
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
        count = torch.npu.device_count()
        name = torch.npu.get_device_name(0) if count > 0 else None
        return getattr(torch_npu, "__version__", "?"), torch.__version__, count, name
    except Exception as e:  # noqa: BLE001 - a broken CANN install: say so, do not activate
        logger.error("deepinfer_ascend: torch_npu is installed but the NPU query failed: %s", e)
        return None, None, 0, None


def probe() -> Probe:
    """The detection inputs (the one function tests substitute)."""
    npu_version, torch_version, count, name = _probe_npu()
    return Probe(npu_version, torch_version, count, name, _vllm_ascend_plugin() if count else None)


def _base_version(v: str) -> str:
    return v.split("+")[0].split(".post")[0].rsplit(".", 1)[0] if v.count(".") >= 2 else v


def decide(p: Probe) -> tuple[str | None, str | None]:
    """(platform qualname or None, message to log at ERROR or None)."""
    if p.torch_npu is None or p.device_count == 0:
        return None, None
    name = p.device_name or "?"
    if not name.startswith(ASCEND_950_PREFIXES):
        return None, (f"deepinfer_ascend: found {p.device_count} NPU(s) of type {name!r}; this platform supports "
                      "the Ascend 950 only (other Ascend chips: use vllm-ascend with its own vLLM version). "
                      "Not activating.")
    if p.torch and _base_version(p.torch_npu) != _base_version(p.torch):
        return None, (f"deepinfer_ascend: torch_npu {p.torch_npu} does not match torch {p.torch}; install the "
                      f"torch_npu release for torch {_base_version(p.torch)}. Not activating.")
    if p.vllm_ascend is not None:
        return PLATFORM_QUALNAME, (
            f"deepinfer_ascend: both vllm-deepinfer's Ascend 950 platform ({OUR_PLUGIN} -> {PLATFORM_QUALNAME}) "
            f"and vllm-ascend's ({p.vllm_ascend}) claim this NPU; vLLM runs one platform plugin and will refuse "
            "to start. vllm-ascend targets an older vLLM and cannot host this model on vLLM 0.32: uninstall it, "
            f"or set VLLM_PLUGINS=deepinfer,{OUR_PLUGIN} to load ours only.")
    return PLATFORM_QUALNAME, None


def detect() -> str | None:
    """Platform class qualname when an Ascend 950 is usable, else None (never raises)."""
    try:
        qualname, message = decide(probe())
    except Exception as e:  # noqa: BLE001 - vLLM would hide it at DEBUG
        logger.error("deepinfer_ascend: platform detection failed: %r", e)
        return None
    if message:
        logger.error(message)
    return qualname
