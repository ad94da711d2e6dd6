"""Tests of the checkpoint formats, inventory, Engram layout, synthetic tokenizer and the tiny-checkpoint generator.

Model-spec §4 (formats), §5 (inventory, tokenizer), §3.9 / §8.8 (Engram test vectors), §8.2-§8.8 (generator).
"""

from __future__ import annotations

import copy
import filecmp
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_deepinfer.checkpoint import engram_hash, formats
from vllm_deepinfer.checkpoint.inventory import (
    InventoryError,
    expected_tensors,
    validate_inventory,
)
from vllm_deepinfer.config import ArchConfig
from vllm_deepinfer.tools import make_checkpoint as mc

REPO = Path(__file__).resolve().parents[1]


def _template(name: str) -> dict:
    return json.loads((REPO / "configs" / f"{name}.json").read_text())


def _release_v4() -> dict:
    cfg = _template("tiny-v4-flash")
    cfg.update(vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
               o_lora_rank=1024, o_groups=8, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], index_n_heads=64,
               n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048)
    return cfg


def _release_v41() -> dict:
    cfg = _template("tiny-v4.1-flash")
    cfg["text_config"].update(
        vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=40, num_attention_heads=64,
        q_lora_rank=1280, o_lora_rank=1024, o_groups=8, n_routed_experts=384, num_experts_per_tok=6,
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], kv_source_layer_ids=[2, 8, 14, 20],
        index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], index_n_heads=32, candidate_source_layer_id=20,
        candidate_topk_blocks=2048, candidate_block_size=8, engram_layer_ids=[1, 14],
        engram_num_embeddings=[384006168, 384016682], engram_vocab_size=16000000, engram_n_heads=8,
        engram_head_dim=256, engram_compressed_vocab_size=99092, dspark_noise_token_id=128799,
        dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256, dspark_n_routed_experts=128,
        dspark_num_experts_per_tok=3)
    cfg["vision_config"].update(num_hidden_layers=32, hidden_size=1024, num_attention_heads=16, intermediate_size=2816)
    return cfg


def _per_block_counts(inv: dict) -> dict:
    out: dict[str, int] = {}
    for name in inv:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else ("vision" if parts[0] in (
            "vision", "aligner") or parts[0].startswith("image_") else "global")
        out[key] = out.get(key, 0) + 1
    return out


# ============================================================================ inventory
def test_inventory_tiny_v4():
    inv = expected_tensors(ArchConfig.from_hf(_template("tiny-v4-flash")), include_vision=False)
    assert len(inv) == 506
    c = _per_block_counts(inv)
    assert c == {"global": 6, "layers.0": 77, "layers.1": 77, "layers.2": 88, "layers.3": 81, "layers.4": 88,
                 "mtp.0": 89}
    assert inv["layers.0.attn.wq_b.weight"] == ("F8_E4M3", (4096, 128))
    assert inv["layers.0.attn.wq_b.scale"] == ("F8_E8M0", (32, 1))
    assert inv["layers.0.attn.wo_a.weight"] == ("F8_E4M3", (256, 2048))
    assert inv["layers.0.attn.wo_a.scale"] == ("F8_E8M0", (2, 16))
    assert inv["layers.0.ffn.experts.0.w1.weight"] == ("I8", (128, 64))
    assert inv["layers.0.ffn.experts.0.w1.scale"] == ("F8_E8M0", (128, 4))
    assert inv["layers.0.ffn.gate.tid2eid"] == ("I64", (8192, 2))
    assert inv["layers.0.hc_attn_fn"] == ("F32", (24, 512))
    assert "layers.3.ffn.gate.bias" in inv and "layers.3.ffn.gate.tid2eid" not in inv
    assert inv["layers.3.attn.compressor.ape"] == ("F32", (128, 512))
    assert inv["layers.2.attn.compressor.ape"] == ("F32", (4, 1024))


def test_inventory_tiny_v41():
    arch = ArchConfig.from_hf(_template("tiny-v4.1-flash"))
    inv = expected_tensors(arch, include_vision=True)
    assert len(inv) == 1008
    assert len(expected_tensors(arch, include_vision=False)) == 990
    c = _per_block_counts(inv)
    assert c == {"global": 3, "layers.0": 78, "layers.1": 84, "layers.2": 86, "layers.3": 78, "layers.4": 92,
                 "layers.5": 78, "layers.6": 85, "layers.7": 78, "layers.8": 81, "layers.9": 78, "mtp.0": 57,
                 "mtp.1": 54, "mtp.2": 58, "vision": 18}
    assert inv["layers.0.attn.wq_b.weight"] == ("F8_E4M3", (2048, 64))
    assert inv["layers.0.attn.wq_b.scale"] == ("F8_E8M0", (64, 2))
    assert inv["layers.0.attn.wo_a.scale"] == ("F8_E8M0", (8, 32))
    assert inv["layers.2.attn.indexer.wq_b.scale"] == ("F8_E8M0", (32, 2))
    assert inv["layers.2.attn.indexer.wk.weight"] == ("BF16", (128, 512))
    assert inv["layers.1.engram.embed.weight"] == ("F8_E4M3", (6126, 32))
    assert inv["layers.1.engram.embed.scale"] == ("F8_E8M0", (6126, 1))
    assert inv["layers.1.engram.wkv.scale"] == ("F8_E8M0", (10, 6))
    assert inv["mtp.0.main_proj.scale"] == ("F8_E8M0", (2, 6))
    assert inv["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 96))
    assert inv["aligner.w1.weight"] == ("BF16", (64, 576))
    assert inv["vision.patch_embed.proj.weight"] == ("BF16", (64, 588))
    assert "layers.6.attn.compressor.wgate.weight" not in inv  # ratio-1 source: ungated
    assert "layers.8.attn.indexer.wk.weight" not in inv       # index source without keys
    assert "mtp.0.embed.weight" not in inv and "mtp.2.head.weight" not in inv


def test_inventory_release_counts():
    a4 = ArchConfig.from_hf(_release_v4())
    inv4 = expected_tensors(a4)
    assert len(inv4) == 69189
    assert sum(1 for n in inv4 if not n.startswith("mtp.")) == 67612
    assert inv4["layers.2.ffn.experts.0.w2.weight"] == ("I8", (4096, 1024))
    assert inv4["layers.2.ffn.experts.0.w2.scale"] == ("F8_E8M0", (4096, 64))
    assert inv4["layers.3.attn.compressor.wkv.weight"] == ("BF16", (512, 4096))
    a41 = ArchConfig.from_hf(_release_v41())
    inv41 = expected_tensors(a41, include_vision=True)
    assert len(inv41) == 96085
    c = _per_block_counts(inv41)
    assert (c["layers.0"], c["layers.1"], c["layers.2"], c["layers.14"], c["layers.20"], c["layers.24"]) == (
        2334, 2340, 2342, 2348, 2341, 2337)
    assert (c["mtp.0"], c["mtp.1"], c["mtp.2"], c["vision"]) == (801, 798, 802, 266)
    assert inv41["layers.14.engram.embed.weight"] == ("F8_E4M3", (384016682, 256))
    assert inv41["layers.1.engram.wkv.weight"] == ("F8_E4M3", (25600, 6144))
    assert inv41["mtp.0.main_proj.scale"] == ("F8_E8M0", (160, 480))
    assert inv41["mtp.2.markov_head.embed.weight"] == ("BF16", (129280, 256))


def test_validate_inventory_names_the_tensor():
    arch = ArchConfig.from_hf(_template("tiny-v4-flash"))
    inv = dict(expected_tensors(arch))
    validate_inventory(inv, arch)
    bad = dict(inv)
    del bad["layers.1.attn.wkv.scale"]
    with pytest.raises(InventoryError, match=r"layers\.1\.attn\.wkv\.scale"):
        validate_inventory(bad, arch)
    bad = dict(inv)
    bad["layers.0.attn_norm.weight"] = ("F32", (128,))
    with pytest.raises(InventoryError, match=r"layers\.0\.attn_norm\.weight.*dtype"):
        validate_inventory(bad, arch)
    bad = dict(inv)
    bad["layers.0.attn.wq_a.weight"] = ("F8_E4M3", (128, 64))
    with pytest.raises(InventoryError, match=r"wq_a\.weight.*shape"):
        validate_inventory(bad, arch)
    bad = dict(inv)
    bad["layers.0.ffn.gate.bias"] = ("F32", (8,))
    with pytest.raises(InventoryError, match="unexpected tensor 'layers.0.ffn.gate.bias'"):
        validate_inventory(bad, arch)


def test_layer_plans_reproduce_templates():
    assert mc.v4_layer_plan(5)["compress_ratios"] == _template("tiny-v4-flash")["compress_ratios"]
    assert mc.v4_layer_plan(43)["compress_ratios"] == _release_v4()["compress_ratios"]
    for cfg, n in ((_template("tiny-v4.1-flash"), 10), (_release_v41(), 40)):
        plan = mc.v41_layer_plan(n)
        for key, value in plan.items():
            assert cfg["text_config"][key] == value, key
    for n in range(1, 13):  # every derived plan passes the config validation
        cfg = mc.build_config("v4.1-flash", "tiny", layers=n)
        ArchConfig.from_hf(cfg)
        cfg4 = mc.build_config("v4-flash", "tiny", layers=n)
        ArchConfig.from_hf(cfg4)


# ============================================================================ engram
def test_engram_test_vectors():
    assert engram_hash.hash_multipliers(1, 99092, 4) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram_hash.hash_multipliers(14, 99092, 4) == [67716810739261, 51510806800915, 30921347202721,
                                                          82619226485591]
    assert engram_hash.hash_multipliers(4, 99092, 4) == [82260218638837, 5037792023067, 73653454411355,
                                                         18954862957863]
    assert engram_hash.engram_num_embeddings(16000000, 8, 4, 2) == [384006168, 384016682]
    primes = engram_hash.bucket_primes(1000, 2, 4, 2)
    assert primes == [[1009, 1013, 1019, 1021, 1031, 1033], [1039, 1049, 1051, 1061, 1063, 1069]]
    assert [sum(r) for r in primes] == [6126, 6332]
    assert engram_hash.bucket_offsets(primes) == [[0, 1009, 2022, 3041, 4062, 5093], [0, 1039, 2088, 3139, 4200, 5263]]
    assert all(engram_hash.is_prime(p) for p in (2, 3, 1009, 16000057, 2**31 - 1))
    assert not any(engram_hash.is_prime(p) for p in (0, 1, 4, 1001, 561, 3215031751))


def test_engram_normalisation():
    n = engram_hash.normalize_token_text
    assert n(" The") == "the" and n("THE") == "the" and n("Café") == "cafe"
    assert n(" ") == " " and n("  \n ") == " " and n("a  b") == "a b"
    assert n("ﬁ") == "fi"  # NFKC


# ============================================================================ formats
def test_e8m0_decode():
    b = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    got = formats.e8m0_to_float(b.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float32
    assert got.tolist() == [2.0 ** (x - 127) for x in b.tolist()]
    with pytest.raises(formats.FormatError):
        formats.e8m0_to_float(torch.tensor([127, 255], dtype=torch.uint8))


def test_fp8_block_roundtrip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g) * 0.05
    for block in (32, (32, 32)):
        q, s = formats.quant_fp8_block(w, block)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 5)
        d = formats.dequant_fp8_block(q, s, block)
        assert d.dtype == torch.float32 and d.shape == w.shape
        # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 of the block scale range
        assert torch.allclose(d, w, rtol=0.0625, atol=float(s.float().max()) * 2 ** -9)
        q2, s2 = formats.quant_fp8_block(d, block)  # dequantised values are exactly representable
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2.view(torch.uint8),
                                                                                      s.view(torch.uint8))
        formats.check_no_nan_codes(q)
    # partial edge blocks and the exact formula on hand-made codes
    q, s = formats.quant_fp8_block(torch.randn(70, 33, generator=g), 32)
    assert s.shape == (3, 2)
    ref = q.float() * torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, 0)[:70].repeat_interleave(
        32, 1)[:, :33]
    assert torch.equal(formats.dequant_fp8_block(q, s, 32), ref)
    big = torch.full((4, 4), 1e30)
    q, s = formats.quant_fp8_block(big, 4)
    assert torch.allclose(formats.dequant_fp8_block(q, s, 4), big, rtol=0.07)
    formats.check_no_nan_codes(q)
    formats.check_no_nan_codes(s)


def test_mxfp4_roundtrip_and_nibble_order():
    # byte 0x21: element 0 = code 1 (0.5) in the low nibble, element 1 = code 2 (1.0) in the high nibble
    packed = torch.tensor([[0x21] + [0x00] * 15], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # x2
    d = formats.dequant_mxfp4(packed, scale)
    assert d.dtype == torch.float32 and d.shape == (1, 32)
    assert d[0, :3].tolist() == [1.0, 2.0, 0.0]
    neg = torch.tensor([[0xF9] + [0] * 15], dtype=torch.uint8).view(torch.int8)  # low 0x9 = -0.5, high 0xF = -6
    assert formats.dequant_mxfp4(neg, scale)[0, :2].tolist() == [-1.0, -12.0]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 16, 96, generator=g)
    q, s = formats.quant_mxfp4(w)
    assert q.dtype == torch.int8 and q.shape == (4, 16, 48) and s.shape == (4, 16, 3)
    d = formats.dequant_mxfp4(q, s)
    err = (d - w).abs() / w.abs().reshape(4, 16, 3, 32).amax(-1).repeat_interleave(32, -1)
    assert float(err.max()) <= 0.25 + 1e-6  # half the widest E2M1 gap (2) of the top of the range (6 -> amax)
    q2, s2 = formats.quant_mxfp4(d)
    assert torch.equal(formats.dequant_mxfp4(q2, s2), d)
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4).reshape(1, 32)
    q, s = formats.quant_mxfp4(vals)
    assert torch.equal(formats.dequant_mxfp4(q, s), vals)


def test_mxfp4_rounding_is_nearest_ties_to_even():
    """Each E2M1 code is the nearest grid value (ties to the even code), checked against brute force."""
    x = torch.cat([torch.linspace(-6, 6, 20001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])])
    x = torch.cat([x, torch.zeros(-x.numel() % 32)]).reshape(-1, 32)
    x[:, 0] = 6.0  # pin every group's scale to 2**0
    grid = torch.tensor(formats.E2M1_VALUES)
    d = (x.reshape(-1).abs().clamp(max=6)[:, None] - grid[None]).abs()
    cand = d == d.min(1, keepdim=True).values
    idx = torch.arange(8)[None].expand_as(cand)
    code = torch.where(cand & (idx % 2 == 0), idx, torch.where(cand, idx + 100, 1000)).min(1).values % 100
    expected = (grid[code] * torch.sign(x.reshape(-1))).reshape(x.shape)
    q, s = formats.quant_mxfp4(x)
    assert bool((s.view(torch.uint8) == 127).all())
    assert torch.equal(formats.dequant_mxfp4(q, s), expected)


def test_engram_reference_hash():
    primes = engram_hash.bucket_primes(1000, 2, 4, 1)[0]
    offs = engram_hash.bucket_offsets([primes])[0]
    mult = engram_hash.hash_multipliers(1, 500, 4)
    pad = 7
    ids = [11, 22, 33]
    h = engram_hash.hash_ids(ids, 1, primes, offs, mult, n_heads=2, max_ngram=4, pad_id=pad)
    assert h.shape == (3, 6) and h.dtype == np.int64
    # position 1, 3-gram (order 3, lookback s=2 is before the start -> pad)
    r = (22 * mult[0]) ^ (11 * mult[1]) ^ (pad * mult[2])
    assert h[1, 2] == r % primes[2] + offs[2] and h[1, 3] == r % primes[3] + offs[3]
    # a dead (image) token breaks the n-grams of later positions
    h2 = engram_hash.hash_ids(ids, 1, primes, offs, mult, 2, 4, pad, dead=[True, False, False])
    r2 = (33 * mult[0]) ^ (22 * mult[1]) ^ (pad * mult[2]) ^ (pad * mult[3])
    assert h2[2, 4] == r2 % primes[4] + offs[4]
    # chunk look-back: the same hashes as hashing the whole sequence
    full = engram_hash.hash_ids(ids + [44, 55], 1, primes, offs, mult, 2, 4, pad)
    chunk = engram_hash.hash_ids([44, 55], 1, primes, offs, mult, 2, 4, pad, history=ids)
    assert np.array_equal(full[3:], chunk)


def test_engram_hash_op_matches_numpy_reference():
    """The model's hashing op (`ops.engram_hash`: torch, and on CUDA its kernel) equals the NumPy reference
    above on a sequence with image tokens and a start, token by token from each one's look-back window."""
    from vllm_deepinfer.ops import reference as ref

    k, heads, img = 4, 3, (900, 905)
    primes = engram_hash.bucket_primes(2000, heads, k, 1)[0]
    offs = engram_hash.bucket_offsets([primes])[0]
    mult = engram_hash.hash_multipliers(3, 700, k)
    token_map = torch.arange(1000, dtype=torch.long) % 700
    pad = 5
    seq = [int(v) for v in torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0))]
    seq[7], seq[20], seq[21] = 901, 900, 904
    want = engram_hash.hash_ids([int(token_map[t]) for t in seq], 3, primes, offs, mult, heads, k, pad,
                                dead=[img[0] <= t < img[1] for t in seq])
    pos = torch.arange(len(seq)).unsqueeze(1) - (k - 1) + torch.arange(k)
    valid = pos >= 0
    hist = torch.where(valid, torch.tensor(seq)[pos.clamp(min=0)], 0)
    got = ref.engram_hash(hist, valid, token_map, torch.tensor(mult), torch.tensor(primes), torch.tensor(offs), pad,
                          img)
    assert np.array_equal(got.numpy(), want)


def test_fp8_rows_roundtrip():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(50, 64, generator=g)
    q, s = formats.quant_fp8_rows(w)
    assert q.shape == (50, 64) and s.shape == (50, 2)
    d = formats.dequant_fp8_rows(q, s)
    assert torch.allclose(d, w, rtol=0.0625, atol=1e-3)
    idx = torch.tensor([3, 7, 7, 0])
    assert torch.equal(formats.dequant_fp8_rows(q[idx], s[idx]), d[idx])
    bad = q.clone().view(torch.uint8)
    bad[0, 0] = 0x7F
    with pytest.raises(formats.FormatError):
        formats.check_no_nan_codes(bad.view(torch.float8_e4m3fn))


# ============================================================================ generator
@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(root / "cache"))
        v41 = mc.ensure_demo_checkpoint()  # tiny V4.1, seed 0, self-checked
    assert v41.parent == root / "cache"
    v4 = mc.make_checkpoint("v4-flash", "tiny", root / "v4", seed=0, progress=False)
    return {"v4": v4, "v41": v41, "root": root}


def test_generated_layout(ckpt_dirs):
    for fam, n_tensors in (("v4", 506), ("v41", 1008)):
        d = ckpt_dirs[fam]
        summary = mc.self_check(d)
        assert summary["tensors"] == n_tensors and summary["shards"] >= 2
        files = sorted(p.name for p in d.iterdir() if not p.name.startswith("."))
        shards = [f for f in files if f.startswith("model-")]
        assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "model.safetensors.index.json"} <= set(files)
        assert sum((d / f).stat().st_size for f in shards) < 100 * 2**20
    cfg = json.loads((ckpt_dirs["v41"] / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32] and "text_config" in cfg
    assert text["vocab_size"] == 8192 and cfg["image_token_id"] == 8190 and text["dspark_noise_token_id"] == 8191
    assert text["engram_num_embeddings"] == [6126, 6332]
    assert text["engram_compressed_vocab_size"] == engram_hash.compressed_vocab_size(ckpt_dirs["v41"])
    cfg4 = json.loads((ckpt_dirs["v4"] / "config.json").read_text())
    assert cfg4["expert_dtype"] == "fp4" and cfg4["vocab_size"] == 8192 and "text_config" not in cfg4


def test_generated_values_follow_recipe(ckpt_dirs):
    from safetensors import safe_open

    d = ckpt_dirs["v4"]
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    def get(name):
        with safe_open(str(d / index[name]), framework="pt") as f:
            return f.get_tensor(name)

    assert torch.equal(get("mtp.0.emb.tok_emb.weight"), get("embed.weight"))
    assert torch.equal(get("mtp.0.head.weight"), get("head.weight"))
    tid = get("layers.0.ffn.gate.tid2eid")
    assert tid.dtype == torch.int64 and int(tid.min()) >= 0 and int(tid.max()) < 8
    assert bool((tid[:, 0] != tid[:, 1]).all())
    w = formats.dequant_fp8_block(get("layers.2.attn.wq_a.weight"), get("layers.2.attn.wq_a.scale"), 128)
    assert abs(float(w.std()) - 128 ** -0.5) < 0.01
    e = formats.dequant_mxfp4(get("layers.4.ffn.experts.3.w2.weight"), get("layers.4.ffn.experts.3.w2.scale"))
    assert e.shape == (128, 128) and 0.05 < float(e.std()) < 0.12
    n = get("layers.1.attn_norm.weight").float()
    assert abs(float(n.mean()) - 1.0) < 0.05 and 0.05 < float(n.std()) < 0.15
    s = get("layers.1.hc_attn_scale")
    assert s.dtype == torch.float32 and bool(((s >= 0.5) & (s <= 1.5)).all()) and len(set(s.tolist())) == 3


def test_determinism_and_independent_seeding(ckpt_dirs, tmp_path):
    a = ckpt_dirs["v4"]
    b = mc.make_checkpoint("v4-flash", "tiny", tmp_path / "same", seed=0, progress=False, check=False)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors
    # fewer layers: the tensors that still exist are bit-identical (seeded by name, not by position)
    c = mc.make_checkpoint("v4-flash", "tiny", tmp_path / "short", layers=3, seed=0, progress=False, check=False)
    from safetensors import safe_open

    def load(d, names_):
        idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        out = {}
        for n in names_:
            with safe_open(str(d / idx[n]), framework="pt") as f:
                out[n] = f.get_tensor(n)
        return out

    probe = ["embed.weight", "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "layers.1.attn.wkv.weight",
             "layers.1.ffn.experts.5.w3.weight", "layers.0.ffn.gate.tid2eid"]
    ta, tc = load(a, probe), load(c, probe)
    for n in probe:
        assert torch.equal(ta[n].view(torch.uint8) if ta[n].element_size() == 1 else ta[n],
                           tc[n].view(torch.uint8) if tc[n].element_size() == 1 else tc[n]), n
    cfg_c = json.loads((c / "config.json").read_text())
    assert cfg_c["num_hidden_layers"] == 3 and cfg_c["compress_ratios"] == [0, 4, 128, 0]


def test_demo_checkpoint_is_reused(ckpt_dirs, monkeypatch):
    d = ckpt_dirs["v41"]
    before = (d / "model.safetensors.index.json").stat().st_mtime_ns
    monkeypatch.setenv("DEEPINFER_CACHE", str(d.parent))
    assert mc.ensure_demo_checkpoint() == d
    assert mc.ensure_demo_checkpoint(cache_dir=d.parent) == d
    assert (d / "model.safetensors.index.json").stat().st_mtime_ns == before


def test_v4_tiny_loads_in_transformers(ckpt_dirs):
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(str(ckpt_dirs["v4"]), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[0, 17, 400, 1234, 8000]])).logits
    assert logits.shape == (1, 5, 8192) and bool(torch.isfinite(logits).all())


def test_vllm_parses_configs(ckpt_dirs):
    from vllm.transformers_utils.config import get_config

    c4 = get_config(str(ckpt_dirs["v4"]), trust_remote_code=False)
    assert type(c4).__name__ == "DeepseekV4Config" and c4.expert_dtype == "fp4"
    c41 = get_config(str(ckpt_dirs["v41"]), trust_remote_code=False)
    assert type(c41).__name__ == "DeepseekV41Config"
    assert c41.vision_n_layers == 1 and c41.expert_dtype == "fp4" and c41.num_hidden_layers == 10
    a = ArchConfig.from_hf(c41)  # vLLM's flattened object
    assert a.engram_compressed_vocab_size == c41.engram_compressed_vocab_size and a.vision_dim == 64
    assert len(expected_tensors(a)) == 1008


def test_engram_map_matches_vllm(ckpt_dirs):
    try:
        from vllm.models.deepseek_v41.common.engram import (
            build_compressed_token_map,
            compute_hash_multipliers,
        )
    except Exception as e:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM engram module not importable: {e}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt_dirs["v41"]))
    lookup, n = build_compressed_token_map(tok)
    mine = engram_hash.compressed_token_map(tok)
    assert mine.dtype == np.int64 and mine.tolist() == lookup and int(mine.max()) + 1 == n
    ref = compute_hash_multipliers((1, 4), 4, n).tolist()
    assert [engram_hash.hash_multipliers(l, n, 4) for l in (1, 4)] == ref


# ============================================================================ tokenizer
def test_tokenizers_load_and_render(ckpt_dirs):
    from transformers import AutoTokenizer
    from vllm.tokenizers.registry import get_tokenizer

    conv = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."},
            {"role": "user", "content": "And of Italy?"}]
    for fam, mode in (("v4", "deepseek_v4"), ("v41", "deepseek_v41")):
        d = str(ckpt_dirs[fam])
        hf = AutoTokenizer.from_pretrained(d)
        assert hf.is_fast and hf.backend_tokenizer is not None and len(hf) == 8192
        assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
        assert hf.convert_ids_to_tokens([0, 1]) == ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
        for special in ("<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<｜latest_reminder｜>", "<think>", "</think>",
                        "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
                        "<｜deepseek_image｜>", "<｜DSML｜tool_calls>", "<｜DSML｜ calls>"):
            assert len(hf.encode(special, add_special_tokens=False)) == 1, special
        words = hf.tokenize(" The quick brown fox jumps over the lazy dog and the children played in the park.")
        assert len(words) <= 18  # whole English words, not bytes
        vt = get_tokenizer(d, tokenizer_mode=mode)
        msgs = copy.deepcopy(conv)
        if fam == "v4":
            msgs[2]["reasoning"] = msgs[2].pop("reasoning_content")
        for kwargs in ({}, {"thinking": False}, {"reasoning_effort": "max"}):
            ref = vt.apply_chat_template(copy.deepcopy(msgs), tokenize=False, **kwargs)
            assert ref.startswith("<｜begin▁of▁sentence｜>") and "<｜User｜>And of Italy?<｜Assistant｜>" in ref
            assert hf.apply_chat_template(copy.deepcopy(msgs), tokenize=False, **kwargs) == ref, (fam, kwargs)
        ids = vt.apply_chat_template(copy.deepcopy(msgs))
        assert ids[0] == 0 and max(ids) < 8192
        assert vt.decode(ids) == vt.apply_chat_template(copy.deepcopy(msgs), tokenize=False)


def test_chat_template_tools_match_vllm(ckpt_dirs):
    from transformers import AutoTokenizer
    from vllm.tokenizers.registry import get_tokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "days": 2}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    for fam, mode in (("v4", "deepseek_v4"), ("v41", "deepseek_v41")):
        hf = AutoTokenizer.from_pretrained(str(ckpt_dirs[fam]))
        vt = get_tokenizer(str(ckpt_dirs[fam]), tokenizer_mode=mode)
        for kwargs in ({}, {"thinking": False}):
            ref = vt.apply_chat_template(copy.deepcopy(conv), tools=tools, tokenize=False, **kwargs)
            assert "<tool_result>sunny</tool_result>" in ref
            assert hf.apply_chat_template(copy.deepcopy(conv), tools=tools, tokenize=False, **kwargs) == ref
