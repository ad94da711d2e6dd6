"""A mixed step under vLLM's V2 adaptive verification (`VLLM_DEEPINFER_DSPARK_V2=1` + varlen): the runner trims
each verification request's drafts on the device only, so the host `query_start_loc` of the leading
verification requests is an even split of the draft budget while the device copy holds the real lengths (host
offsets exact from the first prefill chunk on). The V2 runner itself needs Triton/CUDA; here the real V4.1 target
of a tiny real-format checkpoint runs one such step from metadata built the way vLLM builds it, on its own
paged buffers, and its output and cache writes are those of the step with exact host offsets.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import engine, model_runner, tiny_checkpoint

MAX_LEN = 256
K = 3  # drafts per verification request
# Step 1 prefills requests 0-2 (the later verifications) and the first chunk of request 3.
PROMPTS = (40, 33, 57, 30)
# Step 2: verifications of requests 0-2 with K drafts scheduled each, trimmed on the device to 0, 3 and 1
# (device lengths 1, 4, 2; budget 4 -> host split 2, 1, 1 drafts: lengths 3, 2, 2), then request 3's second
# chunk (20 tokens) and request 4's first (13 tokens).
DEVICE_LENS = (1, 4, 2, 20, 13)
HOST_SPLIT_LENS = (3, 2, 2, 20, 13)
TRIMMED = 3


def _paged(target) -> list:
    from vllm_deepinfer.attention.caches import PagedCache

    return [m for m in target.modules() if isinstance(m, PagedCache)]


class Step:
    """The target of an engine with its caches on fresh zeroed buffers: request r owns blocks r*nb+1 .. (r+1)*nb of
    every cache (block 0 is the null block)."""

    def __init__(self, llm, n_reqs: int):
        self.target, self.vcfg, self.n_reqs = model_runner(llm).model, llm.llm_engine.vllm_config, n_reqs
        self.caches = _paged(self.target)
        self.tables = {}
        for cache in self.caches:
            nb = -(-MAX_LEN // cache.block_size)
            cache.bind_kv_cache(torch.zeros(n_reqs * nb + 1, 1, cache.rows_per_block, cache.width, dtype=cache.dtype))
            self.tables[cache.prefix] = 1 + torch.arange(n_reqs * nb, dtype=torch.int32).view(n_reqs, nb)

    def snapshot(self) -> list[torch.Tensor]:
        return [c.kv_cache.clone() for c in self.caches]

    def restore(self, state: list[torch.Tensor]) -> None:
        for c, s in zip(self.caches, state):
            c.kv_cache.copy_(s)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, context: list[int], device_lens: list[int],
            host_lens: list[int], upper_lens: list[int], num_trimmed: int = 0) -> torch.Tensor:
        """One step of requests 0..R-1 (`context`: tokens cached before it) as vLLM's V2 runner describes it:
        device offsets and lengths from `device_lens`, the host offsets from `host_lens`, the host sequence lengths
        from the scheduled (untrimmed) `upper_lens` -> the target's hidden states [T, D]."""
        from vllm.forward_context import set_forward_context

        from vllm_deepinfer.attention.backend import PagedCacheMetadata

        def offsets(lens: list[int]) -> torch.Tensor:
            return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

        r = len(context)
        seq_lens = torch.tensor(context) + torch.tensor(device_lens)
        meta = {c.prefix: PagedCacheMetadata(
            self.tables[c.prefix][:r], offsets(host_lens), seq_lens.int(), c.block_size, r, int(ids.shape[0]),
            max(upper_lens) <= 1 + K, MAX_LEN, offsets(device_lens),
            seq_lens_cpu=(torch.tensor(context) + torch.tensor(upper_lens)).int(), num_trimmed=num_trimmed)
            for c in self.caches}
        with torch.inference_mode(), set_forward_context(meta, self.vcfg, num_tokens=int(ids.shape[0])):
            return self.target(ids, positions)


@pytest.fixture(scope="module")
def step(ckpt_root):
    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash")
    with engine(ckpt, max_model_len=MAX_LEN) as llm:
        yield Step(llm, len(DEVICE_LENS))


def test_split_host_offsets_give_the_exact_step(step):
    """The mixed step with the host split and the trimmed count equals, bitwise (output and every cache row
    written), the same step with exact host offsets and the count (both run the verifications on the per-token
    path), and, within fp32 rounding, the step with exact offsets and no count (the V1 layout: the one-token
    verification per-token, the others as prefill spans). Without the count the split host offsets give another
    step."""
    g = torch.Generator().manual_seed(0)
    vocab = step.target.arch.vocab_size
    first = list(PROMPTS) + [0]                        # request 4 starts in step 2
    step.run(torch.randint(3, vocab, (sum(PROMPTS),), generator=g),
             torch.cat([torch.arange(p) for p in PROMPTS]), [0] * 4, list(PROMPTS), list(PROMPTS), list(PROMPTS))
    before = step.snapshot()
    ids = torch.randint(3, vocab, (sum(DEVICE_LENS),), generator=g)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(first, DEVICE_LENS)])
    scheduled = [1 + K] * TRIMMED + list(DEVICE_LENS[TRIMMED:])  # V2's host sequence lengths count every draft

    def run(host: tuple[int, ...], trimmed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step with host offsets `host` (exact ones come with exact host sequence lengths)."""
        step.restore(before)
        upper = list(DEVICE_LENS) if host == DEVICE_LENS else scheduled
        out = step.run(ids, positions, first, list(DEVICE_LENS), list(host), upper, trimmed)
        return out, step.snapshot()

    exact, exact_caches = run(DEVICE_LENS, TRIMMED)
    split, split_caches = run(HOST_SPLIT_LENS, TRIMMED)
    assert torch.equal(split, exact)
    # block 0 is the null block, the sink of dropped writes (several at once: whichever lands last stays)
    assert all(torch.equal(a[1:], b[1:]) for a, b in zip(split_caches, exact_caches))
    v1_layout, _ = run(DEVICE_LENS, 0)
    torch.testing.assert_close(split, v1_layout, rtol=1e-5, atol=1e-5)
    unhinted, _ = run(HOST_SPLIT_LENS, 0)
    assert not torch.allclose(unhinted, exact, rtol=1e-3, atol=1e-3)
