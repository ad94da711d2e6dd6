"""Host memory shared by every rank of a deployment on one node (the V4.1 Engram tables).

Under tensor or data parallelism every rank needs the same Engram tables (about 189 GiB in the release
model): private copies would need that much host memory per rank. `NodeArena.create` is a collective over
vLLM's world group (all TP x PP x DP ranks): the node's lowest rank creates one file in /dev/shm sized for
every table, each rank on the node maps it (`MAP_SHARED`), and the file is unlinked as soon as all have
mapped it, so nothing is left behind however the processes end. The lowest rank's loader writes the
tables; a barrier of the same group after loading (the model's `load_weights`) keeps the other ranks from
serving before that is done. On CUDA each process registers the mapping with `cudaHostRegister`, so it is pinned memory the GPU
reads through UVA, exactly like a private pinned table. A node whose /dev/shm cannot hold the tables falls
back to private tables (one warning per rank).
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import socket
import uuid

import torch
import torch.distributed as dist

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)

SHM_DIR = "/dev/shm"
FILE_PREFIX = "vllm-deepinfer-engram-"
_ALIGN = 4096  # tensors start on page boundaries


def _place(offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(start, end) of a tensor placed at the first aligned offset at or after `offset`."""
    start = -(-offset // _ALIGN) * _ALIGN
    return start, start + math.prod(shape) * dtype.itemsize


def _node_key() -> tuple[str, str, int, int]:
    """Ranks with the same key can share a /dev/shm file: same host, same boot, same tmpfs mount."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    st = os.stat(SHM_DIR)
    return socket.gethostname(), boot, st.st_dev, st.st_ino


def _create_file(nbytes: int) -> str:
    """A new /dev/shm file of `nbytes` reserved bytes -> its path, or 'error: ...'."""
    free = shutil.disk_usage(SHM_DIR).free
    if free < nbytes:
        return f"error: {SHM_DIR} has {free / 2**30:.1f} GiB free, the tables need {nbytes / 2**30:.1f} GiB"
    path = os.path.join(SHM_DIR, f"{FILE_PREFIX}{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full tmpfs fails here, not with SIGBUS later
    except OSError as e:
        os.unlink(path)
        return f"error: reserving {nbytes} B in {path}: {e}"
    finally:
        os.close(fd)
    return path


class NodeArena:
    """One shared mapping of `nbytes`; `take` hands out tensors in it, in the same order on every rank."""

    def __init__(self, mapping: mmap.mmap, path: str, writer: bool, ranks: int):
        self.mapping, self.path, self.writer, self.ranks = mapping, path, writer, ranks
        self.nbytes, self._offset = len(mapping), 0
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self.pinned = False

    @classmethod
    def create(cls, nbytes: int, group: dist.ProcessGroup, pin: bool) -> "NodeArena | None":
        """Collective over `group` (a gloo group of all ranks). Returns None where this rank keeps private
        tables: it is alone on its node, or its node could not create the file."""
        rank = dist.get_rank(group)
        keys: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, _node_key(), group=group)
        node = [r for r, k in enumerate(keys) if k == keys[rank]]
        leader = node[0]
        made = _create_file(nbytes) if rank == leader and len(node) > 1 else None
        paths: list = [None] * len(keys)
        dist.all_gather_object(paths, made, group=group)
        path = paths[leader]
        arena = None
        if path is not None and path.startswith("error:"):
            logger.warning("vllm-deepinfer Engram tables: no node-shared copy, private tables per rank (%s)", path[7:])
        elif path is not None:
            with open(path, "r+b") as f:
                mapping = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
            arena = cls(mapping, path, writer=rank == leader, ranks=len(node))
        dist.barrier(group=group)  # every rank of the node has mapped the file
        if made is not None and not made.startswith("error:"):
            os.unlink(made)  # the memory lives until the last rank unmaps it
        if arena is not None and pin:
            arena._register()
        return arena

    def _register(self) -> None:
        """Pin the mapping for this process (cudaHostRegister), so UVA views of its tensors are legal."""
        err = torch.cuda.cudart().cudaHostRegister(self._bytes.data_ptr(), self.nbytes, 0)
        if int(err) != 0 or not self._bytes.is_pinned():
            raise RuntimeError(f"cudaHostRegister of the node-shared Engram tables failed ({err}); set "
                               "DEEPINFER_ENGRAM_SHARED=0 for private pinned tables")
        self.pinned = True

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next page-aligned tensor of `shape` and `dtype` in the mapping (zeros until written)."""
        start, self._offset = _place(self._offset, shape, dtype)
        if self._offset > self.nbytes:
            raise RuntimeError(f"node arena of {self.nbytes} B cannot hold a {list(shape)} {dtype} tensor at {start}")
        return self._bytes[start:self._offset].view(dtype).view(shape)

    @staticmethod
    def size(tensors: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Bytes of a mapping that `take` can carve these tensors from, in this order."""
        end = 0
        for shape, dtype in tensors:
            end = _place(end, shape, dtype)[1]
        return max(end, 1)
