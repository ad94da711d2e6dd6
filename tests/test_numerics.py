"""Parity numerics (`vllm_deepinfer/ops/quant.py`): the quantise-dequantise recipes against hand-computed
values, and that the default (exact) mode leaves the model's Linear unchanged."""

from __future__ import annotations

import pytest
import torch

from vllm_deepinfer.models.layers import Linear, enable_activation_quant
from vllm_deepinfer.ops import quant


def test_parse_mode():
    assert quant.parse_mode(None) == frozenset()
    assert quant.parse_mode("exact") == frozenset()
    assert quant.parse_mode("") == frozenset()
    assert quant.parse_mode("parity") == frozenset(quant.COMPONENTS)
    assert quant.parse_mode("kv, index_k") == {"kv", "index_k"}
    with pytest.raises(ValueError, match="unknown component"):
        quant.parse_mode("kv,bogus")


def test_pow2_scale_exact_powers_and_floor():
    amax = torch.tensor([448.0, 449.0, 224.0, 1.0, 0.0, 1e-6])
    s = quant.pow2_scale(amax, floor=1e-4)
    # 448/448 = 1 -> 2^0; 449/448 -> 2^1; 224/448 = 0.5 -> 2^-1; 1/448 -> 2^-8 (1/448 = 0.00223 in (2^-9, 2^-8]);
    # 0 and 1e-6 hit the floor: 1e-4/448 = 2.23e-7 in (2^-23, 2^-22] -> 2^-22
    assert s.tolist() == [1.0, 2.0, 0.5, 2.0 ** -8, 2.0 ** -22, 2.0 ** -22]


def test_e4m3_round_hand_values():
    x = torch.tensor([1.0, 1.0625, 1.125, 1.1875, 17.0, 500.0, -500.0, 0.001953125])
    # E4M3 has 3 mantissa bits: 1.0625 is halfway between 1.0 and 1.125 -> even (1.0);
    # 1.1875 halfway between 1.125 and 1.25 -> even (1.25); 17 -> 16 (step 2, tie to even 16);
    # saturates at 448; 2^-9 is the smallest subnormal
    assert quant.e4m3_round(x).tolist() == [1.0, 1.0, 1.125, 1.25, 16.0, 448.0, -448.0, 0.001953125]


def test_fp8_block_roundtrip_hand_values():
    # block of 4: amax 3.0 -> s = 2^ceil(log2(3/448)) = 2^-7; 3.0/s = 384 (exact in E4M3: 1.5 * 2^8)
    # 0.1/s = 12.8 -> E4M3 step 1 in [8,16) -> 13 -> 13 * 2^-7 = 0.1015625
    x = torch.tensor([[3.0, 0.1, -1.0, 0.0]])
    y = quant.fp8_block_roundtrip(x, block=4, floor=1e-4, bf16_first=False)
    assert y.tolist() == [[3.0, 0.1015625, -1.0, 0.0]]
    assert y.dtype == x.dtype


def test_kv_record_roundtrip_layout():
    torch.manual_seed(0)
    rows = torch.randn(5, 512, dtype=torch.float32)
    out = quant.kv_record_roundtrip(rows, rope_dim=64)
    # RoPE dims: BF16 only
    assert torch.equal(out[:, 448:], rows[:, 448:].to(torch.bfloat16).float())
    # NoPE dims: every 64-block is q * 2^e with q an E4M3 value
    nope = out[:, :448].view(5, 7, 64)
    amax = rows[:, :448].to(torch.bfloat16).float().view(5, 7, 64).abs().amax(-1, keepdim=True)
    s = quant.pow2_scale(amax, 1e-4)
    q = nope / s
    assert torch.equal(q, q.to(torch.float8_e4m3fn).float())
    assert q.abs().max() <= 448
    # relative error of E4M3 (3 mantissa bits) on the large entries
    big = rows[:, :448].abs() > 0.5
    assert ((out[:, :448] - rows[:, :448]).abs()[big] / rows[:, :448].abs()[big]).max() <= 2 ** -4 + 1e-3


def test_index_roundtrips_one_scale_per_row_and_head():
    q = torch.zeros(2, 3, 128)
    q[0, 1, 5] = 7.0      # amax 7 -> s = 2^ceil(log2(7/448)) = 2^-6; 7/s = 448 exactly
    q[0, 1, 6] = 0.01     # 0.01 * 64 = 0.64 -> E4M3 subnormal step 2^-9 / normal [0.5,1) step 2^-4 -> 0.625
    out = quant.index_query_roundtrip(q)
    assert out[0, 1, 5].item() == 7.0
    assert out[0, 1, 6].item() == 0.625 / 64
    assert torch.count_nonzero(out) == 2
    k = torch.full((4, 128), 0.3)
    kk = quant.index_key_roundtrip(k)
    # amax 0.3 (bf16 0.30078125) -> s = 2^-10; 0.30078125 * 1024 = 308 -> E4M3 step 32 in [256, 512) -> 320
    assert torch.allclose(kk, torch.full_like(k, 320 / 1024))


def test_act_roundtrip_eps_and_blocks():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    x[0, 0], x[0, 200] = 1.0, 3.0
    y = quant.act_roundtrip(x, 128)
    assert y.dtype == torch.bfloat16
    assert y[0, 0].item() == 1.0 and y[0, 200].item() == 3.0
    with pytest.raises(ValueError):
        quant.act_roundtrip(torch.zeros(1, 100), 128)


def test_exact_mode_linear_unchanged():
    torch.manual_seed(0)
    lin = Linear(256, 8, dtype=torch.bfloat16)
    lin.weight.data.normal_()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    ref = x @ lin.weight.t()
    assert lin.act_block is None
    assert torch.equal(lin(x), ref)
    # switched on by name only; the quantised input changes the result
    holder = torch.nn.Module()
    holder.attn = torch.nn.Module()
    holder.attn.wq_a = lin
    holder.attn.other = Linear(256, 8)
    assert enable_activation_quant(holder) == ["attn.wq_a"]
    assert holder.attn.other.act_block is None
    assert torch.equal(lin(x), quant.act_roundtrip(x, 128) @ lin.weight.t())


def test_setting_checked():
    from vllm_deepinfer.serving import settings

    assert any("parity" in n for n in settings.check({"DEEPINFER_NUMERICS": "parity"}, platform_device="cpu"))
    settings.check({"DEEPINFER_NUMERICS": "exact"}, platform_device="cpu")
    settings.check({"DEEPINFER_NUMERICS": "kv,index_q"}, platform_device="cpu")
    with pytest.raises(settings.DeepInferSettingError, match="DEEPINFER_NUMERICS"):
        settings.check({"DEEPINFER_NUMERICS": "fp4"}, platform_device="cpu")


def test_tf32_truncate():
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11 + 2.0 ** -20, -3.0 - 2.0 ** -12])
    assert quant.tf32_truncate(x).tolist() == [1.0 + 2.0 ** -10, 1.0, -3.0]


def test_grouped_low_rank_is_block_diagonal():
    """The attention output applies `wo_b` as a Linear to z = grouped_low_rank(...) (so that its parity W8A8
    input quantiser runs); z is the block-diagonal product: group g of o times rows g*R.. of wo_a."""
    from vllm_deepinfer import ops
    torch.manual_seed(0)
    o = torch.randn(5, 8, 64)
    wo_a = torch.randn(2 * 16, 4 * 64)
    z = ops.grouped_low_rank(o, wo_a, 2)
    assert z.shape == (5, 32)
    torch.testing.assert_close(z, o.flatten(1) @ torch.block_diag(*wo_a.view(2, 16, 256)).t())
