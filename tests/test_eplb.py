"""What the model hands to vLLM's EPLB: NCCL-movable views of the real expert parameters; redundant slots.

EPLB itself cannot run on CPU: vLLM 0.32 refuses it in `ParallelConfig` ("Expert parallelism load balancing
is only supported on CUDA devices or ROCm devices or XPU devices now."), and off CUDA its logical-to-physical
mapping is the identity (`eplb_map_to_physical_and_record` returns the ids), so a migration would not even be
consistent with routing. What CPU can check is the model's side of the protocol: after
`MixtureOfExperts.set_eplb_state` every tensor in `model.expert_weights` (what `rearrange_expert_weights_inplace`
all-gathers and sends) has a dtype in vLLM's NCCL table, is one local-expert-major [E_local, n] view of a routed
expert parameter of its layer (same storage: a migration writes the weights the layer computes with), and the
MXFP4 scale bytes, which vLLM's CUDA MXFP4 method holds as `float8_e8m0fnu` (what failed on 2 x H200), come out
as uint8 views of the same bytes.
"""

from __future__ import annotations

import pytest

from tests.conftest import engine, tiny_checkpoint


def _eplb_report(model):
    """Register EPLB state as vLLM's EplbState.add_model does (identity map), then describe model.expert_weights:
    per tensor (dtype name, NCCL ok, rows, owning parameter name, write-through ok), plus the E8M0 view check."""
    import torch
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclDataTypeEnum

    from vllm_deepinfer.moe.layer import eplb_transfer_view

    layers, experts = model.num_moe_layers, model.num_logical_experts
    model.set_eplb_state(torch.zeros(layers, experts, dtype=torch.int32),
                         torch.arange(experts).view(1, experts, 1).repeat(layers, 1, 1),
                         torch.ones(layers, experts, dtype=torch.long))
    rows, e8m0 = [], []
    for runner, tensors in zip(model.moe_layers, model.expert_weights, strict=True):
        routed = runner.routed_experts
        params = dict(routed.named_parameters())
        for t in tensors:
            owner = [n for n, p in params.items() if p.data_ptr() == t.data_ptr()
                     and p.numel() * p.element_size() == t.numel() * t.element_size()]
            byte = t.view(torch.uint8).view(-1)[:1]
            before = params[owner[0]].data.view(torch.uint8).reshape(-1)[0].item() if owner else None
            byte.add_(1)
            through = owner and params[owner[0]].data.view(torch.uint8).reshape(-1)[0].item() == (before + 1) % 256
            byte.sub_(1)
            rows.append((str(t.dtype), ncclDataTypeEnum.supports_torch_dtype(t.dtype), t.shape[0], owner,
                         bool(through)))
        for name, p in params.items():
            if name.endswith("_scale"):
                v = eplb_transfer_view(p.data.view(torch.float8_e8m0fnu).view(routed.local_num_experts, -1))
                e8m0.append((str(v.dtype), v.data_ptr() == p.data_ptr(), v.numel() == p.numel()))
    return rows, e8m0, routed.local_num_experts


@pytest.mark.parametrize("arch", ["v4-flash", "v4.1-flash"])
def test_eplb_expert_weights_nccl_views(ckpt_root, arch, monkeypatch):
    monkeypatch.setenv("DEEPINFER_EXPERT_STORAGE", "packed")  # the MXFP4 bytes + E8M0 scales, as on CUDA
    with engine(tiny_checkpoint(ckpt_root, arch), max_model_len=512, max_num_batched_tokens=512) as llm:
        rows, e8m0, local = llm.apply_model(_eplb_report)[0]
    names = {name for _, _, _, owner, _ in rows for name in owner}
    assert names == {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"}
    for dtype, nccl_ok, n_rows, owner, through in rows:
        assert nccl_ok and n_rows == local and len(owner) == 1 and through, (dtype, owner)
    assert e8m0 and all(r == ("torch.uint8", True, True) for r in e8m0)


def test_redundant_expert_slots():
    """The loader fills every physical slot of a logical expert (vLLM's initial map: [0..E) then i % E)."""
    from vllm_deepinfer.models.loader import physical_slots

    assert [physical_slots(8, 8, e) for e in (0, 7)] == [[0], [7]]
    assert [physical_slots(8, 11, e) for e in (0, 2, 3, 7)] == [[0, 8], [2, 10], [3], [7]]
    assert physical_slots(4, 10, 1) == [1, 5, 9]
