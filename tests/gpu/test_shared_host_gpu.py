"""Node-shared host memory on CUDA (`models/shared_host.py`, the V4.1 Engram tables under TP / DP).

Two processes on one GPU form a gloo group, as two ranks of one node do: rank 0 creates and fills the shared
mapping, both pin it with cudaHostRegister and read it on the GPU through a UVA view (what the Engram host
path does), and the file is gone from /dev/shm once both have mapped it. The CPU suite runs the same code in
TP=2 and DP=2 engines (tests/test_tensor_parallel.py, tests/test_data_parallel.py) without the pinning.

    PYTHONPATH=$PWD python3 -m pytest -q -s tests/gpu/test_shared_host_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [((1000, 64), torch.float8_e4m3fn), ((1000, 2), torch.float8_e8m0fnu), ((3, 5), torch.int32)]


def _rank(rank: int, port: int, failures) -> None:
    """One rank: map, pin, fill (rank 0), read on the GPU through UVA, compare."""
    import torch.distributed as dist
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    from vllm_deepinfer.models.shared_host import FILE_PREFIX, SHM_DIR, NodeArena

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.cuda.set_device(0)
        arena = NodeArena.create(NodeArena.size(SHAPES), dist.group.WORLD, pin=True)
        assert arena is not None and arena.ranks == 2 and arena.writer == (rank == 0) and arena.pinned
        tensors = [arena.take(shape, dtype) for shape, dtype in SHAPES]
        assert all(t.is_pinned() for t in tensors)
        assert not any(f.startswith(FILE_PREFIX) for f in os.listdir(SHM_DIR)), "the file outlived the mapping"
        g = torch.Generator().manual_seed(0)
        want = [torch.randint(0, 120, shape, generator=g, dtype=torch.uint8).view(torch.int8)
                if dtype.itemsize == 1 else torch.randint(-9, 9, shape, generator=g, dtype=dtype)
                for shape, dtype in SHAPES]
        if arena.writer:
            for t, w in zip(tensors, want):
                t.view(w.dtype).copy_(w)
        dist.barrier()
        for t, w in zip(tensors, want):
            on_gpu = get_accelerator_view_from_cpu_tensor(t)
            assert on_gpu.is_cuda and on_gpu.data_ptr() != 0
            got = on_gpu.view(w.dtype)[torch.arange(t.shape[0], device="cuda").flip(0)].cpu()  # a gather, as Engram's
            assert torch.equal(got, w.flip(0)), f"rank {rank}: {t.dtype} rows differ"
        dist.barrier()
    except Exception as e:  # reported to the parent, which fails the test
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def test_node_arena_pinned_and_read_through_uva():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    from tests.conftest import run_ranks

    run_ranks(_rank)
