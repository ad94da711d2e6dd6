"""Shared fixtures: tiny real-format checkpoints (generated once per session) and vLLM engines.

vLLM engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless a test needs the spawned
engine core; one engine serves a whole test module (start-up dominates CPU test time).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_CACHE: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def tiny_checkpoint(root: Path, arch: str, seed: int = 0, layers: int | None = None, drafter: str | None = None,
                    **config_overrides) -> Path:
    """A tiny checkpoint of `arch` ("v4-flash" / "v4.1-flash"), generated once per session.

    `layers` keeps the tiny layer pattern at another depth (`make_checkpoint`'s `layers`); `drafter`
    ("reproduce" / "noise") rewrites the speculative drafter (`make_checkpoint`'s `drafter`);
    `config_overrides` edit config.json (the text config for V4.1) of a copy of the base checkpoint.
    """
    from vllm_deepinfer.tools.make_checkpoint import make_checkpoint

    key = (arch, seed, layers, drafter, tuple(sorted(config_overrides.items())))
    if key in _CACHE:
        return _CACHE[key]
    base_key = (arch, seed, layers, drafter, ())
    name = f"{arch}-s{seed}" + (f"-l{layers}" if layers is not None else "") + (f"-{drafter}" if drafter else "")
    if base_key not in _CACHE:
        _CACHE[base_key] = Path(make_checkpoint(arch, "tiny", root / name, layers=layers, seed=seed, drafter=drafter))
    if not config_overrides:
        return _CACHE[base_key]
    out = root / (f"{name}-" + "-".join(f"{k}{v}" for k, v in sorted(config_overrides.items())))
    shutil.copytree(_CACHE[base_key], out)
    cfg = json.loads((out / "config.json").read_text())
    (cfg.get("text_config") or cfg).update(config_overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _CACHE[key] = out
    return out


@contextlib.contextmanager
def engine(model: Path, **overrides) -> Iterator:
    """A vLLM engine for tests (float32 for exact comparisons, eager, small KV budget), shut down
    explicitly on exit so the next engine of the process starts on a clean distributed state."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    kwargs = dict(model=str(model), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2,
                  max_model_len=4096, max_num_batched_tokens=4096, max_num_seqs=16, seed=0)
    kwargs.update(overrides)
    llm = None
    try:
        llm = LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()


@contextlib.contextmanager
def recorded_preemptions(llm) -> Iterator[list[str]]:
    """The request ids (as the engine spells them) that `llm`'s scheduler preempts inside the block, in order."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempted: list[str] = []
    original = scheduler._preempt_request

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = counting
    try:
        yield preempted
    finally:
        scheduler._preempt_request = original


def model_runner(llm):
    """The model runner of `llm`'s in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def draft_policy(llm):
    """The draft-length policy of `llm`'s DeepInfer drafter (MTP or DSpark) inside the in-process engine."""
    return model_runner(llm).drafter.model.draft_policy


def interpreter_child(*pytest_args: str) -> subprocess.CompletedProcess:
    """A child pytest (repo root, `-q -p no:cacheprovider` + `pytest_args`) with TRITON_INTERPRET=1, which must be set
    before Triton loads: how the CPU suite runs the Triton kernel tests written for CUDA."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args], cwd=root,
                          env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, n: int = 2, timeout: float = 300) -> None:
    """Run target(rank, port, failures) in n spawned processes (a process group on a free loopback port);
    each puts its failure text on `failures`. Asserts every rank exited 0 and reported nothing."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, failures)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    assert failures.empty(), failures.get()
    assert [p.exitcode for p in procs] == [0] * n


class Server:
    """`vllm serve MODEL` (through `vllm_deepinfer.serving.cli`) as a real process on loopback: float32, eager,
    small KV budget, plus `args`; `env` adds variables. Logs to `log`; `stop()` ends its process group."""

    def __init__(self, model: Path, port: int, log: Path, args: list[str], env: dict[str, str] | None = None):
        self.model, self.port, self.log = str(model), port, log
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="2",
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        cmd = [sys.executable, "-m", "vllm_deepinfer.serving.cli", "serve", self.model,
               "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
               "--gpu-memory-utilization", "0.2", "--enforce-eager", *args]
        self._logf = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 400) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log.read_text()[-4000:]}")

    def alive(self) -> bool:
        import httpx

        return self.proc.poll() is None and httpx.get(self.url + "/health", timeout=5).status_code == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._logf.close()
