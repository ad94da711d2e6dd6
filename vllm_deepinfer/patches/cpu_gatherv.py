"""Give vLLM's CPU communicator the uneven-size collectives that data-parallel MoE dispatch needs.

Reason: with data parallel + expert parallel, vLLM 0.32.0's CPU communicator uses the
allgather/reduce-scatter all2all manager (`AgRsAll2AllManager`, device_communicators/all2all.py),
whose dispatch calls `GroupCoordinator.all_gatherv` and whose combine calls `reduce_scatterv`, with
the per-DP-rank token counts as `sizes`. `CpuCommunicator` (device_communicators/cpu_communicator.py)
inherits both from `DeviceCommunicatorBase`, where they `raise NotImplementedError`, so the first MoE
layer of every DP+EP step on CPU dies (only the CUDA/XPU communicators implement them).

Both are implemented here on the communicator's torch.distributed (gloo) device group: every rank pads
its rows to the largest size, one `all_gather_into_tensor` / `reduce_scatter_tensor` moves the padded
blocks, and the padding is cut off again. Exact: the gathered rows are the inputs bit for bit, and each
reduced row is the plain sum of the ranks' rows (padding rows are never read). Pinned to vLLM 0.32.0
(`patches.check_vllm_version`); the patch refuses to apply if the class already defines them itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_PATCHED = "_deepinfer_gatherv"


def _sizes(comm, rows: int, sizes: list[int] | None) -> list[int]:
    """Per-rank row counts (all `rows` when not given); checks this rank's entry."""
    sizes = list(sizes) if sizes is not None else [rows] * comm.world_size
    if len(sizes) != comm.world_size or sizes[comm.rank_in_group] != rows:
        raise ValueError(f"gatherv sizes {sizes} do not match world size {comm.world_size} "
                         f"and this rank's {rows} rows")
    return sizes


def _all_gatherv_one(comm, x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """x: [sizes[rank], ...] -> [sum(sizes), ...], rank blocks in rank order."""
    sizes = _sizes(comm, x.shape[0], sizes)
    pad = max(sizes)
    if not pad:  # every rank has no rows (the same sizes everywhere: all skip)
        return x
    block = x.new_zeros((pad, *x.shape[1:]))
    block[: x.shape[0]] = x
    out = x.new_empty((comm.world_size * pad, *x.shape[1:]))
    dist.all_gather_into_tensor(out, block, group=comm.device_group)
    return torch.cat([out[r * pad: r * pad + n] for r, n in enumerate(sizes)])


def all_gatherv(self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """Concatenate every rank's rows along dim 0 (rank r contributes sizes[r] rows); a list gathers each."""
    if dim != 0:
        raise NotImplementedError("only dim 0 all_gatherv is supported (as on CUDA)")
    if isinstance(input_, torch.Tensor):
        return _all_gatherv_one(self, input_, sizes)
    return [_all_gatherv_one(self, t, sizes) for t in input_]


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """input_: [sum(sizes), ...] along `dim` on every rank -> this rank's sizes[rank] rows of the sum over ranks."""
    dim = dim % input_.dim()
    x = input_.movedim(dim, 0)
    world = self.world_size
    if sizes is None:
        if x.shape[0] % world:
            raise ValueError(f"reduce_scatterv: {x.shape[0]} rows do not split over {world} ranks")
        sizes = [x.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != x.shape[0]:
        raise ValueError(f"reduce_scatterv sizes {sizes} do not cover {x.shape[0]} rows on {world} ranks")
    pad = max(sizes)
    if not pad:
        return input_
    blocks = x.new_zeros((world * pad, *x.shape[1:]))
    start = 0
    for r, n in enumerate(sizes):
        blocks[r * pad: r * pad + n] = x[start: start + n]
        start += n
    out = x.new_empty((pad, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, blocks, group=self.device_group)
    return out[: sizes[self.rank_in_group]].movedim(0, dim).contiguous()


def apply() -> None:
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if getattr(CpuCommunicator.all_gatherv, _PATCHED, False):
        return
    for name in ("all_gatherv", "reduce_scatterv"):
        if getattr(CpuCommunicator, name) is not getattr(DeviceCommunicatorBase, name):
            raise RuntimeError(f"vLLM's CpuCommunicator now defines {name} itself: drop patches/cpu_gatherv.py")
    for fn in (all_gatherv, reduce_scatterv):
        setattr(fn, _PATCHED, True)
        setattr(CpuCommunicator, fn.__name__, fn)
