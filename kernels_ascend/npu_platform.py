"""The Ascend 950 as a vLLM 0.32 out-of-tree platform: platform class, HCCL communicator, NPU worker.

The one module of `kernels_ascend` that imports vLLM (named by `kernels_ascend.platform.PLATFORM_QUALNAME`;
vLLM imports it only after `detect()` found a 950). Importing it needs no torch_npu: every NPU call
sits inside a method, so CPU CI imports the class and checks its configuration logic.

* `Ascend950Platform` (`PlatformEnum.OOT`, device type `npu`, dispatch key `PrivateUse1`): device and
  memory queries through `torch.npu`; `check_and_update_config` selects `NPUWorker`, forces the `spawn`
  start method (a forked child cannot use an NPU the parent touched), turns compilation off (stock
  Inductor has no NPU backend) and keeps vLLM's graph mode (our model asks for FULL_DECODE_ONLY) when
  torch_npu has `NPUGraph`, else NONE. `support_hybrid_kv_cache()` is True: the model's window,
  compressed and state caches are vLLM hybrid specs. Attention backends: the model's cache layers pick
  their own (`CUSTOM`); a generic attention layer gets a clear error.
* `NPUCommunicator`: vLLM's torch.distributed communicator over the `hccl` backend (torch_npu registers
  it), with the all-gather/reduce-scatter all2all manager for expert parallelism.
* `NPUWorker`: vLLM's GPU worker with its own model runner (V1 by default, see `pre_register_and_update`;
  V2 with VLLM_USE_V2_MODEL_RUNNER=1), the device set up as
  `npu:N` and `torch.cuda`'s stream/event/graph names pointed at `torch.npu` (`_alias_cuda_to_npu`, the
  same approach as vLLM's own XPU worker), so vLLM's CUDAGraphWrapper captures ACL graphs.

EPLB: vLLM gates it on `is_cuda_alike()` (`vllm/config/parallel.py:559`); the model has no EPLB yet, so
the gate stays and `--enable-eplb` fails with vLLM's own message on this platform.
"""

from __future__ import annotations

import gc
import os
from functools import partial

import torch
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

logger = init_logger(__name__)

QUALNAME = "kernels_ascend.npu_platform"


def has_npu_graph() -> bool:
    """Whether this torch_npu captures graphs (`torch.npu.NPUGraph`)."""
    return hasattr(getattr(torch, "npu", None), "NPUGraph")


class Ascend950Platform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "npu"
    device_type: str = "npu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "NPU"
    dist_backend: str = "hccl"
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = ["deepinfer_fp8"]
    additional_env_vars: list[str] = ["ASCEND_RT_VISIBLE_DEVICES", "PYTORCH_NPU_ALLOC_CONF", "HCCL_BUFFSIZE",
                                      "HCCL_CONNECT_TIMEOUT"]

    @classmethod
    def import_kernels(cls) -> None:
        import torch_npu  # noqa: F401  (registers the npu device, its allocator and the hccl backend)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.npu.get_device_name(device_id)

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        return None  # no CUDA-style compute capability

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.npu.get_device_properties(device_id).total_memory

    @classmethod
    def device_count(cls) -> int:
        return torch.npu.device_count()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.npu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.npu.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def is_sleep_mode_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        torch.npu.empty_cache()
        torch.npu.reset_peak_memory_stats(device)
        return torch.npu.max_memory_allocated(device)

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        from kernels_ascend import num_cores
        return num_cores()

    @classmethod
    def supports_fp8(cls) -> bool:
        return True

    @classmethod
    def supports_mx(cls) -> bool:
        return True

    @classmethod
    def fp8_dtype(cls) -> torch.dtype:
        return torch.float8_e4m3fn

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return has_npu_graph()

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return "vllm.compilation.cuda_graph.CUDAGraphWrapper"  # over torch.npu.NPUGraph (see NPUWorker)

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return f"{QUALNAME}.NPUCommunicator"

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("LoRA is not supported on the Ascend 950 platform")

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        raise NotImplementedError(
            "The Ascend 950 platform serves vllm-deepinfer's DeepSeek V4/V4.1 models only; their cache layers "
            f"choose their own attention backend (requested: {selected_backend})")

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Before the engine config exists: vLLM's V1 model runner unless VLLM_USE_V2_MODEL_RUNNER says otherwise
        (the V2 runner compiles vLLM's own Triton kernels, untested under triton-ascend; V1 is the runner the
        CPU suite verifies this model with)."""
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = f"{QUALNAME}.NPUWorker"
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

        cc = vllm_config.compilation_config
        if cc.mode != CompilationMode.NONE:
            logger.info("Ascend 950: torch.compile has no NPU backend in stock Inductor; compilation mode NONE")
            cc.mode = CompilationMode.NONE
        if cc.compile_sizes is None:
            cc.compile_sizes = []
        if cc.cudagraph_mode != CUDAGraphMode.NONE and not has_npu_graph():
            logger.warning("Ascend 950: this torch_npu has no NPUGraph; graph capture off")
            cc.cudagraph_mode = CUDAGraphMode.NONE


class NPUCommunicator(DeviceCommunicatorBase):
    """torch.distributed collectives over HCCL (the `device_group`); EP all2all by all-gather/reduce-scatter."""

    def __init__(self, cpu_group, device=None, device_group=None, unique_name: str = "", use_all2all: bool = False):
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        if self.use_all2all:
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager
            if self.all2all_backend not in ("naive", "allgather_reducescatter"):
                logger.warning("all2all backend %r is not available on Ascend; using allgather_reducescatter",
                               self.all2all_backend)
            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)


def _alias_cuda_to_npu() -> None:
    """Point the torch.cuda stream/event/graph names vLLM's runner and graph wrapper use at torch.npu.

    Process-wide and permanent in the worker process (which owns one NPU and no CUDA device); each alias
    is a fresh callable so Dynamo's handler table sees no duplicate."""
    npu = torch.npu
    torch.cuda.Stream = npu.Stream
    torch.cuda.Event = lambda *args, blocking=None, **kwargs: npu.Event(*args, **kwargs)
    torch.cuda.current_stream = partial(npu.current_stream)
    torch.cuda.default_stream = partial(npu.current_stream)
    torch.cuda.stream = partial(npu.stream)
    torch.cuda.set_stream = partial(npu.set_stream)
    torch.cuda.synchronize = partial(npu.synchronize)
    if has_npu_graph():
        torch.cuda.CUDAGraph = npu.NPUGraph
        torch.cuda.graph = partial(npu.graph)
        torch.cuda.graph_pool_handle = partial(npu.graph_pool_handle)
        torch.cuda.is_current_stream_capturing = partial(npu.is_current_stream_capturing)


class NPUWorker(Worker):
    """vLLM's GPU worker on `npu:<local rank>` with HCCL and the torch.cuda -> torch.npu aliases."""

    def init_device(self):
        from vllm.platforms import current_platform
        from vllm.utils.mem_utils import MemorySnapshot
        from vllm.utils.torch_utils import set_random_seed
        from vllm.v1.worker.utils import request_memory

        parallel = self.parallel_config
        if parallel.distributed_executor_backend not in ("ray", "external_launcher") and parallel.nnodes_within_dp == 1:
            dp_local = parallel.data_parallel_rank_local
            if dp_local is None:
                dp_local = parallel.data_parallel_index
            self.local_rank += dp_local * parallel.world_size
        if self.local_rank >= torch.npu.device_count():
            raise RuntimeError(f"local rank {self.local_rank} needs more NPUs than the "
                               f"{torch.npu.device_count()} visible (ASCEND_RT_VISIBLE_DEVICES)")
        self.device = torch.device(f"npu:{self.local_rank}")
        torch.npu.set_device(self.device)
        _alias_cuda_to_npu()
        current_platform.check_if_supports_dtype(self.model_config.dtype)

        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        gc.collect()
        torch.npu.empty_cache()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        self._init_workspace_and_model_runner()
