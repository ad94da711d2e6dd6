"""FP8-packed dense linears (`DEEPINFER_FP8_LINEARS=packed`) on the CPU: the reference op on packed storage
equals the dequantised-at-load path bitwise, and a tiny checkpoint loads packed and generates the same."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import engine, model_runner, tiny_checkpoint
from vllm_deepinfer.checkpoint.formats import dequant_fp8_block, quant_fp8_block
from vllm_deepinfer.models.layers import Linear
from vllm_deepinfer.ops import marlin, quant


def _pair(n: int, k: int, block: int, dtype: torch.dtype) -> tuple[Linear, Linear]:
    """The same FP8 block weight as a dequantised Linear and as a packed one."""
    codes, scale = quant_fp8_block(torch.randn(n, k) / k ** 0.5, block)
    plain = Linear(k, n, dtype=dtype)
    plain.weight.data.copy_(dequant_fp8_block(codes, scale, block))
    packed = Linear(k, n, dtype=dtype)
    packed.pack_fp8(block)
    assert packed.scale.dtype == torch.uint8 and bool((packed.scale == 127).all())  # finite before loading
    packed.weight.data.copy_(codes)
    packed.scale.data.copy_(scale.view(torch.uint8))
    return plain, packed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_equals_dequantised(dtype):
    torch.manual_seed(0)
    plain, packed = _pair(96, 128, 32, dtype)
    x = torch.randn(7, 128)
    assert packed.act_dtype == dtype and packed.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(packed(x), plain(x))
    xg = torch.randn(7, 4 * 128, dtype=dtype)
    plain.groups = packed.groups = 4  # grouped wo_a: [G*R, K] rows, input [T, G*K]
    assert torch.equal(packed.matmul(xg), plain.matmul(xg))
    plain.groups = packed.groups = 1
    for lin in (plain, packed):  # parity numerics: the activation round trip runs before the product
        lin.act_block = 32
    assert torch.equal(packed(x), plain(x))
    assert torch.equal(packed(x), quant.act_roundtrip(x.to(dtype), 32) @ plain.weight.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stacked_group_equals_its_members(dtype):
    """`fuse_outputs` (wq_a|wkv, shared w1|w3): after loading, the packed group multiplies as one stacked
    matrix whose column slices equal each member's own product; a member called alone is refused."""
    torch.manual_seed(0)
    lead_plain, lead = _pair(96, 128, 32, dtype)
    other_plain, other = _pair(64, 128, 32, dtype)
    lead.fuse_outputs(other)
    lead.finish_loading()
    other.finish_loading()  # a member's own call is a no-op: the group is built at its first linear
    assert lead.fused_sizes == [96, 64] and lead.weight.shape == (160, 128) and other.weight is None
    x = torch.randn(7, 128)
    a, b = lead.forward_group(x)
    assert torch.equal(a, lead_plain(x)) and torch.equal(b, other_plain(x))
    for member in (lead, other):
        with pytest.raises(RuntimeError, match="stacked GEMM"):
            member(x)


@pytest.mark.parametrize("block,n,k", [(32, 96, 128), (128, 200, 384), (128, 64, 96)])
def test_mx_scales_dequantise_exactly(block, n, k):
    """The MXFP8 scales Marlin is fed (one byte per 1 x 32 group) dequantise to the block-FP8 weight bitwise,
    partial edge blocks included; and Marlin is never chosen off CUDA or for fp32 activations."""
    codes, scale = quant_fp8_block(torch.randn(n, k) * 3, block)
    mx = marlin.mx_scales(scale.view(torch.uint8), (block, block), n, k)
    assert mx.shape == (n, k // marlin.MX_GROUP) and mx.dtype == torch.uint8
    per_group = dequant_fp8_block(codes, mx.view(torch.float8_e8m0fnu), (1, marlin.MX_GROUP))
    assert torch.equal(per_group, dequant_fp8_block(codes, scale, block))
    assert not marlin.supported(torch.device("cpu"), torch.bfloat16, k, (block, block))
    with pytest.raises(NotImplementedError, match="multiples of 32"):
        marlin.mx_scales(scale.view(torch.uint8), (block, block), n, k + 8)


def test_tiny_checkpoint_packed_generates_the_same(ckpt_root, monkeypatch):
    """V4.1 tiny (grouped wo_a, shared experts, Engram wkv, indexer wq_b all FP8): packed storage loads the
    codes and scale bytes as stored and reproduces the dequantised path's greedy tokens and logprobs exactly."""
    from vllm import SamplingParams

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0)
    prompts = ["The quick brown fox", "1, 2, 3, 5, 8,"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    runs = {}
    for mode in ("bf16", "packed"):
        monkeypatch.setenv("DEEPINFER_FP8_LINEARS", mode)
        with engine(ckpt, max_model_len=256, max_num_batched_tokens=256) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            model = model_runner(llm).model
            fp8 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn)
        runs[mode] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                      for o in outs]
        if mode == "packed":
            for suffix in ("attn.wq_a.weight", "attn.wo_a.weight", "shared_experts.w2.weight", "engram.wkv.weight",
                           "indexer.wq_b.weight"):
                assert any(n.endswith(suffix) for n in fp8), suffix
            assert not any("compressor" in n or "weights_proj" in n for n in fp8)  # BF16 in the checkpoint
        else:
            assert not fp8
    assert runs["packed"] == runs["bf16"]
