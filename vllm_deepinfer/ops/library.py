"""A kernel of vLLM's CUDA build behind one of our ops (`ops.flashmla`, `ops.deepgemm`): off unless its switch is
set, loaded lazily (vLLM imported on first use), and disabled for the process by its first failure (logged once),
so the op falls back to our own kernel."""

from __future__ import annotations

import os
from collections.abc import Callable


class LibraryKernel:
    """`load()` -> the library function, or None where this GPU / build lacks it; `env`=1 switches it on."""

    def __init__(self, name: str, env: str, load: Callable[[], Callable | None]):
        self.name, self.env, self._load = name, env, load
        self.off = os.environ.get(env, "0") != "1"
        self._fn: Callable | None | bool = None

    def get(self) -> Callable | None:
        """The library function (loaded once), or None when unavailable."""
        if self._fn is None:
            self._fn = self._load() or False
        return self._fn or None

    def run(self, *args, **kwargs):
        """The function's result, or None when unavailable or failing (then off for the rest of the process)."""
        fn = self.get()
        if fn is None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure: warn once, our own kernel serves the op
            from vllm_deepinfer.log import get_logger

            get_logger(__name__).warning("vllm-deepinfer: %s failed (%s: %s); the op stays on our own kernel",
                                         self.name, type(e).__name__, e)
            self.off = True
            return None
