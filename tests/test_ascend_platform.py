"""The Ascend 950 platform plugin on a machine without NPU: selection logic and platform configuration.

The selection runs through the real entry point (`kernels_ascend.platform.detect`, and vLLM's own
plugin resolution) with the detection inputs substituted at their one function, `platform.probe()`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest

from kernels_ascend import platform as asc

QUAL = asc.PLATFORM_QUALNAME


def _probe(name: str | None = "Ascend950PR", count: int = 8, npu: str | None = "2.13.0", torch: str = "2.13.0+cpu",
           vllm_ascend: str | None = None) -> asc.Probe:
    return asc.Probe(torch_npu=npu, torch=torch, device_count=count if npu else 0, device_name=name,
                     vllm_ascend=vllm_ascend)


CASES = {
    "no torch_npu": (_probe(npu=None, name=None), None, None),
    "torch_npu, no device": (_probe(count=0, name=None), None, None),
    "950": (_probe(), QUAL, None),
    "950 pre-release name": (_probe(name="Ascend910_9591"), QUAL, None),
    "910B": (_probe(name="Ascend910B2"), None, ["Ascend910B2", "Ascend 950 only"]),
    "910_93 (A3)": (_probe(name="Ascend910_9392"), None, ["Ascend910_9392"]),
    "310P": (_probe(name="Ascend310P3"), None, ["Ascend310P3"]),
    "torch_npu for another torch": (_probe(npu="2.14.0"), None, ["torch_npu 2.14.0", "torch 2.13.0"]),
    "950 + vllm-ascend": (_probe(vllm_ascend="ascend -> vllm_ascend:register"), QUAL,
                          ["vllm-ascend", "ascend -> vllm_ascend:register", QUAL,
                           "VLLM_PLUGINS=deepinfer,deepinfer_ascend"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_detect(case, monkeypatch, caplog):
    p, want, words = CASES[case]
    monkeypatch.setattr(asc, "probe", lambda: p)
    with caplog.at_level(logging.ERROR, logger="kernels_ascend.platform"):
        assert asc.detect() == want
        assert asc.detect() == want  # vLLM calls it twice
    text = caplog.text
    if words is None:
        assert not text
    else:
        for w in words:
            assert w in text, (w, text)


def test_detect_never_raises(monkeypatch, caplog):
    def broken():
        raise OSError("libascendcl.so: cannot open shared object file")
    monkeypatch.setattr(asc, "probe", broken)
    with caplog.at_level(logging.ERROR, logger="kernels_ascend.platform"):
        assert asc.detect() is None
    assert "libascendcl.so" in caplog.text


def test_real_probe():
    """The real probe on this machine: without torch_npu nothing activates; on a 950 (validate.sh) ours does."""
    p = asc.probe()
    if p.torch_npu is None:
        assert p.device_count == 0 and asc.detect() is None
    elif p.device_count and (p.device_name or "").startswith(asc.ASCEND_950_PREFIXES):
        assert asc.detect() == QUAL or p.vllm_ascend is not None


def test_vllm_ascend_counts_only_when_vllm_would_load_it(monkeypatch):
    eps = [types.SimpleNamespace(name="deepinfer_ascend", value=f"{asc.__name__}:detect"),
           types.SimpleNamespace(name="ascend", value="vllm_ascend:register")]
    monkeypatch.setattr(asc.importlib.metadata, "entry_points", lambda group: eps)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert asc._vllm_ascend_plugin() == "ascend -> vllm_ascend:register"
    monkeypatch.setenv("VLLM_PLUGINS", "deepinfer,deepinfer_ascend")
    assert asc._vllm_ascend_plugin() is None
    monkeypatch.setenv("VLLM_PLUGINS", "deepinfer,ascend")
    assert asc._vllm_ascend_plugin() is not None


@pytest.mark.parametrize("case", ["950", "910B", "no torch_npu"])
def test_vllm_resolution(case, monkeypatch):
    """vLLM's own resolution over all installed platform plugins: an activated OOT plugin wins over the CPU
    platform; a refused one leaves vLLM's choice alone."""
    from vllm.platforms import resolve_current_platform_cls_qualname
    monkeypatch.setattr(asc, "probe", lambda: CASES[case][0])
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    got = resolve_current_platform_cls_qualname()
    if CASES[case][1] is None:
        assert got != QUAL
    else:
        assert got == QUAL


def test_entry_module_is_light():
    """Importing the entry point and running detect() without torch_npu loads neither torch nor vLLM."""
    code = ("import sys, kernels_ascend, kernels_ascend.platform as p; r = p.detect(); "
            "print(r, 'torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "False", "False"]


def test_platform_class_on_cpu(monkeypatch):
    """The class vLLM would instantiate: imports without torch_npu; interface answers and config updates."""
    from vllm.config import CompilationConfig, ParallelConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.platforms.interface import PlatformEnum
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu_worker import Worker

    cls = resolve_obj_by_qualname(QUAL)
    plat = cls()
    assert plat.is_out_of_tree() and cls._enum == PlatformEnum.OOT
    assert (plat.device_type, plat.dispatch_key, plat.dist_backend) == ("npu", "PrivateUse1", "hccl")
    assert plat.support_hybrid_kv_cache()
    assert not plat.is_cuda_alike()
    assert issubclass(resolve_obj_by_qualname(plat.get_device_communicator_cls()), DeviceCommunicatorBase)
    with pytest.raises(NotImplementedError, match="choose their own attention backend"):
        plat.get_attn_backend_cls("FLASH_ATTN", None)

    for env in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.setenv(env, "")   # recorded, so the teardown restores the original
        monkeypatch.delenv(env)
    plat.pre_register_and_update()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    plat.pre_register_and_update()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"   # the user's choice stands
    cfg = types.SimpleNamespace(
        parallel_config=ParallelConfig(),
        compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                             cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY))
    plat.check_and_update_config(cfg)
    assert issubclass(resolve_obj_by_qualname(cfg.parallel_config.worker_cls), Worker)
    assert cfg.compilation_config.mode == CompilationMode.NONE
    # graph capture stays on where torch_npu has NPUGraph (a 950 host), else it is switched off (CPU CI)
    from kernels_ascend.npu_platform import has_npu_graph
    want = CUDAGraphMode.FULL_DECODE_ONLY if has_npu_graph() else CUDAGraphMode.NONE
    assert cfg.compilation_config.cudagraph_mode == want
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_ops_dispatch_off_npu():
    import torch

    from vllm_deepinfer import ops
    assert ops.backend_for(torch.zeros(1)) == "reference"


def test_ops_off_switch(monkeypatch):
    """KERNELS_ASCEND_OPS_OFF hands single ops back to the torch reference; unknown names stop start-up."""
    pytest.importorskip("triton")
    import kernels_ascend
    monkeypatch.setattr(kernels_ascend, "_OPS", None)
    monkeypatch.setenv(kernels_ascend.OPS_OFF_ENV, "routed_experts, softmax_pool")
    ops = kernels_ascend.load_ops()
    assert not hasattr(ops, "routed_experts") and not hasattr(ops, "softmax_pool")
    assert hasattr(ops, "routed_experts_packed") and hasattr(ops, "sparse_attention_indexed")
    monkeypatch.setattr(kernels_ascend, "_OPS", None)
    monkeypatch.setenv(kernels_ascend.OPS_OFF_ENV, "routed_expert")
    with pytest.raises(ValueError, match="routed_expert"):
        kernels_ascend.load_ops()
    monkeypatch.setattr(kernels_ascend, "_OPS", None)


_COMM = """
import os, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import (destroy_model_parallel, ensure_model_parallel_initialized,
                                             get_tp_group, init_distributed_environment)
from kernels_ascend.npu_platform import NPUCommunicator
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(1, 0, "tcp://127.0.0.1:%d" % (29500 + os.getpid() % 1000), 0, "gloo")
    ensure_model_parallel_initialized(1, 1)
    g = get_tp_group().cpu_group
    c = NPUCommunicator(g, torch.device("cpu"), g, unique_name="tp:0")
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(c.all_reduce(x.clone()), x) and torch.equal(c.all_gather(x, dim=-1), x)
    assert c.all2all_manager is None
    e = NPUCommunicator(g, torch.device("cpu"), g, unique_name="ep:0", use_all2all=True)
    print(type(e.all2all_manager).__name__)
    destroy_model_parallel()
"""


def test_communicator_collectives_over_gloo():
    """NPUCommunicator's own code over a one-rank gloo group (HCCL needs the NPU): collectives and the EP
    all2all manager. In a child process: it initialises torch.distributed."""
    r = subprocess.run([sys.executable, "-c", _COMM], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "AgRsAll2AllManager"
