"""GPU kernel tests: marked `gpu`, skipped without CUDA.

They also run on the CPU through Triton's interpreter when TRITON_INTERPRET=1 is set before pytest
starts (slow; small shapes only): `TRITON_INTERPRET=1 pytest -q tests/gpu`.
"""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (kernels_nvidia); skipped without one")


def gpu_device() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
        return "cpu"
    return None


@pytest.fixture
def device():
    dev = gpu_device()
    if dev is None:
        pytest.skip("no CUDA device (set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)")
    return dev
