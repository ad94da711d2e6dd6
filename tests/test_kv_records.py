"""FP8 KV records (`--kv-cache-dtype fp8_ds_mla`): the main model's window and compressed KV stored as vLLM's
584-B ``fp8_ds_mla`` records (`attention/caches.py::RecordCache`).

* Layout: records written by the reference store sit at the byte offsets of vLLM's FlashMLA block
  (R x 576 data bytes: 448 E4M3 NoPE codes then 64 BF16 RoPE dims; then R x 8 scale bytes: 7 UE8M0 + a 0 pad)
  and read back bitwise as `quant.kv_record_roundtrip`. vLLM's own insert kernel writes the same bytes:
  `tests/gpu/test_kv_record_kernels.py` (CUDA, or Triton's interpreter in a child here).
* Engine: records give the same greedy tokens and logprobs, bit for bit, as exact rows with the parity KV
  quantiser (`DEEPINFER_NUMERICS=kv`, which rounds the rows to the values a record holds), through chunked
  prefill, decode and (batch-invariant mode) a prefix-cache hit; speculation works with the drafters' window KV
  left in rows; vLLM's KV sizing counts 1.75x the rows per block of the record caches.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import engine, interpreter_child, model_runner, tiny_checkpoint
from tests.fidelity import prompt_ids
from vllm_deepinfer.ops import quant, reference

R, PAGE = 65536 // quant.KV_RECORD_BYTES, 65536   # a 64-token bf16 page holds 112 records


def _rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(n, 512, generator=g) * torch.logspace(-6, 3, n).unsqueeze(1)
    rows[0] = 0.0      # amax floor
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_record_bytes_and_readback(dtype):
    n = 40
    rows = _rows(n, dtype)
    slots = torch.randperm(3 * R, generator=torch.Generator().manual_seed(1))[:n]
    pages = torch.zeros(3, PAGE, dtype=torch.uint8)
    reference.kv_record_store(pages, slots, rows, R)
    want = quant.kv_record_roundtrip(rows)
    # read back through the op: bitwise the parity quantiser's values
    got = reference.kv_record_gather(pages, slots, R, dtype)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # the bytes, decoded by hand at vLLM's offsets
    touched = torch.zeros_like(pages, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        b, r = divmod(s, R)
        data, scale = r * 576, R * 576 + r * 8
        codes = pages[b, data:data + 448].view(torch.float8_e4m3fn).float().view(7, 64)
        exps = pages[b, scale:scale + 7].to(torch.int32) - 127
        nope = (codes * torch.ldexp(torch.ones(7, 1), exps.unsqueeze(1))).flatten()
        rope = pages[b, data + 448:data + 576].view(torch.bfloat16).float()
        assert torch.equal(torch.cat((nope, rope)).to(dtype).view(torch.uint8), want[i].view(torch.uint8))
        assert pages[b, scale + 7] == 0                                   # pad byte
        touched[b, data:data + 576] = touched[b, scale:scale + 8] = True
    assert not pages[~touched].any()                                      # nothing written elsewhere
    # slot -1 reads slot 0 (callers mask it)
    assert torch.equal(reference.kv_record_gather(pages, torch.tensor([-1]), R, dtype),
                       reference.kv_record_gather(pages, torch.tensor([0]), R, dtype))


def test_record_kernels_in_interpreter_child():
    """The Triton record paths (`kernels_nvidia`) and vLLM's own insert kernel, in Triton's interpreter
    (TRITON_INTERPRET=1 must be set before Triton loads, hence a child pytest); on CUDA they run in tests/gpu."""
    pytest.importorskip("triton")
    r = interpreter_child("tests/gpu/test_kv_record_kernels.py")
    summary = r.stdout.strip().splitlines()[-1]
    print(summary)   # random-row stores and bf16 attention are CUDA-only (the interpreter's E4M3 / bf16 dot)
    assert r.returncode == 0 and " passed" in summary, r.stdout[-6000:] + r.stderr[-3000:]


def _generate(llm, prompts: list[list[int]]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)],
             o.num_cached_tokens) for o in outs]


@pytest.mark.parametrize("arch", ["v4.1-flash", "v4-flash"])
def test_records_match_parity_rows(ckpt_root, monkeypatch, arch):
    """Same greedy tokens and logprobs, bitwise, records vs exact rows under DEEPINFER_NUMERICS=kv: a batch with
    chunked prefill (budget 256 tokens) and decode."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "kv")
    model = tiny_checkpoint(ckpt_root, arch)
    batch = [prompt_ids(model, 37, 1), prompt_ids(model, 300, 2), prompt_ids(model, 1041, 3)]
    results = {}
    for kv_dtype in ("auto", "fp8_ds_mla"):
        with engine(model, kv_cache_dtype=kv_dtype, max_num_batched_tokens=256) as llm:
            assert llm.llm_engine.vllm_config.cache_config.cache_dtype == kv_dtype
            results[kv_dtype] = _generate(llm, batch)
    assert [r[:2] for r in results["fp8_ds_mla"]] == [r[:2] for r in results["auto"]]


def test_records_prefix_hit(ckpt_root, monkeypatch):
    """V4.1, batch-invariant mode (where a prefix hit changes no bit): a request whose 1,000-token prefix is a
    prefix-cache hit over record caches gives bitwise the tokens and logprobs of exact rows computed from scratch.

    --block-size 16 keeps the scheduler block (the LCM of the groups' block sizes, where hits land) under the
    prefix: 896 tokens with records on tiny V4.1 (record blocks carry a factor 7)."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "kv")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    model = tiny_checkpoint(ckpt_root, "v4.1-flash")
    shared = prompt_ids(model, 1000, 0)
    first, second = shared + prompt_ids(model, 41, 3), shared + prompt_ids(model, 57, 4)
    with engine(model, block_size=16, max_num_batched_tokens=512, enable_prefix_caching=False) as llm:
        (want,) = _generate(llm, [second])
    with engine(model, kv_cache_dtype="fp8_ds_mla", block_size=16, max_num_batched_tokens=512,
                enable_prefix_caching=True) as llm:
        _generate(llm, [first])
        (got,) = _generate(llm, [second])
    assert got[2] == 896, got[2]
    assert got[:2] == want[:2]


@pytest.mark.parametrize("arch,method", [("v4-flash", "mtp"), ("v4.1-flash", "dspark")])
def test_records_with_speculation(ckpt_root, arch, method):
    """Next to the target's records the drafters' window KV stays exact rows (MTP's layer, DSpark's stages);
    greedy tokens with speculation (3 drafts, the reproducing drafter) equal those without."""
    model = tiny_checkpoint(ckpt_root, arch, 0, drafter="reproduce")
    prompts = [prompt_ids(model, n, i) for i, n in enumerate((7, 40, 150))]
    with engine(model, kv_cache_dtype="fp8_ds_mla") as llm:
        base = [r[0] for r in _generate(llm, prompts)]
    with engine(model, kv_cache_dtype="fp8_ds_mla",
                speculative_config={"method": method, "num_speculative_tokens": 3}) as llm:
        drafter = model_runner(llm).drafter.model
        kinds = {type(m).__name__ for n, m in drafter.named_modules() if n.endswith("window_cache")}
        assert [r[0] for r in _generate(llm, prompts)] == base
    assert kinds == {"PagedCache"}, kinds


def test_records_kv_capacity(ckpt_root):
    """At equal memory (same blocks of the same page) the record caches' blocks hold 112 tokens instead of 64
    (bf16 rows), and vLLM's "KV cache size: N tokens" grows by what the other caches leave (tiny V4.1: 1.30x)."""
    model = tiny_checkpoint(ckpt_root, "v4.1-flash")
    got = {}
    for kv_dtype in ("auto", "fp8"):
        with engine(model, dtype="bfloat16", kv_cache_dtype=kv_dtype) as llm:
            core = llm.llm_engine.engine_core.engine_core
            cfg = core.scheduler.kv_cache_config
            got[kv_dtype] = (cfg.num_blocks, [g.kv_cache_spec.block_size for g in cfg.kv_cache_groups],
                             core.vllm_config.cache_config.kv_cache_size_tokens, core.vllm_config.cache_config.cache_dtype)
    (rows_blocks, rows_bs, rows_tokens, _), (rec_blocks, rec_bs, rec_tokens, rec_dtype) = got["auto"], got["fp8"]
    assert rec_dtype == "fp8_ds_mla"                                   # the alias is written back, as in-tree does
    assert rec_blocks == rows_blocks
    changed = [(a, b) for a, b in zip(rows_bs, rec_bs) if a != b]
    assert changed and all(b * 64 == a * 112 for a, b in changed), changed
    assert 1.25 < rec_tokens / rows_tokens < 1.75, (rows_tokens, rec_tokens)


def test_other_kv_cache_dtypes_refused(ckpt_root):
    model = tiny_checkpoint(ckpt_root, "v4.1-flash")
    with pytest.raises(Exception, match="fp8_ds_mla"), engine(model, kv_cache_dtype="fp8_e5m2"):
        pass
