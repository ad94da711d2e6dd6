"""Loggers of the plugin, placed under vLLM's `vllm` logger so vLLM's handler and level apply."""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    """`vllm.deepinfer.<module path>` for a module named `vllm_deepinfer.<module path>`."""
    return logging.getLogger("vllm.deepinfer." + module.removeprefix("vllm_deepinfer.").removeprefix("vllm_deepinfer"))
