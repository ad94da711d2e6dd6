"""V4.1 decoder bounded replay (`vllm_deepinfer/models/replay.py`): exact against full prefill.

Tiny V4.1 with a 16-token window: 3 layers past the cut (layer 6), so the exact keep is
3 * 15 + 1 = 46 tokens and prompts of 300-1050 tokens drop most of their tokens from layers 7-9;
layers 6..9 run each prompt's last 46 / 31 / 16 / 1 positions.
Replay on (vLLM's default `swa_bounded_replay`) must give the greedy tokens of replay off and the
same first-token logprobs (the last prompt token's distribution) to float32 round-off, alone, in a
mixed batch, under chunked prefill, after a prefix hit that reaches into the retained tail and
after preemption; prompt-logprob requests run in full. Small selection sizes keep the indexer and
candidate filter active.
"""

from __future__ import annotations

import pytest

from tests.conftest import engine, recorded_preemptions, tiny_checkpoint
from tests.fidelity import prompt_ids

CONFIG = {"sliding_window": 16, "index_topk": 16, "candidate_topk_blocks": 4, "candidate_block_size": 8}
KEEP = 3 * 15 + 1
KEEPS = (KEEP, 31, 16, 1)  # rows leaving layers 6..9
LENGTHS = (30, 300, 701)
N_NEW = 8
PREEMPT_NEW = 48
TOL = 1e-5


def _run(llm, prompts, n_new=N_NEW, **params):
    """Greedy tokens and first-token top-5 logprobs {id: logprob} of each prompt (one batch)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, logprobs=5, **params)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), {k: v.logprob for k, v in o.outputs[0].logprobs[0].items()}, o)
            for o in outs]


def _counts(llm) -> dict[str, int]:
    return llm.apply_model(lambda m: dict(m.model.replay_counts))[0]


def _rows(lengths, keeps=KEEPS) -> int:
    """Prompt rows that layers 6..9 run for prompts of `lengths` tokens."""
    return sum(min(n, k) for n in lengths for k in keeps)


def _assert_same(got, want):
    for (tok, lp, _), (ref_tok, ref_lp, _) in zip(got, want, strict=True):
        assert tok == ref_tok
        assert lp.keys() == ref_lp.keys()
        assert max(abs(lp[k] - ref_lp[k]) for k in lp) < TOL


@pytest.fixture(scope="module")
def model_dir(ckpt_root):
    return tiny_checkpoint(ckpt_root, "v4.1-flash", 0, **CONFIG)


@pytest.fixture(scope="module")
def prompts(model_dir):
    return [prompt_ids(model_dir, n, i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def shared(model_dir):
    """Prefix-hit pair: B shares its first 1030 tokens with A; the hit (1024, the block LCM) ends past
    B's replay start (1050 - 46 = 1004), so the rewound tail must rebuild the retained rows."""
    base = prompt_ids(model_dir, 1030, 7)
    return base + prompt_ids(model_dir, 41, 8), base + prompt_ids(model_dir, 20, 9)


@pytest.fixture(scope="module")
def preempt_prompts(model_dir):
    return [prompt_ids(model_dir, 60 + 7 * i, i) for i in range(6)]


@pytest.fixture(scope="module")
def full(model_dir, prompts, shared, preempt_prompts):
    """Replay off: every prompt alone, plus its prompt logprobs; the preemption prompts as one batch."""
    with engine(model_dir, swa_bounded_replay=False) as llm:
        alone = [_run(llm, [p])[0] for p in prompts]
        prompt_lp = _run(llm, [prompts[2]], prompt_logprobs=1)[0][2].prompt_logprobs
        second = _run(llm, [shared[1]])[0]
        preempt = _run(llm, preempt_prompts, PREEMPT_NEW)  # one batch: this pool holds all six
        assert _counts(llm)["past_cut_tokens"] == 0
    return {"alone": alone, "prompt_lp": prompt_lp, "second": second, "preempt": preempt}


def test_exact_alone_and_mixed_batch(model_dir, prompts, full):
    with engine(model_dir) as llm:
        alone = [_run(llm, [p])[0] for p in prompts]
        counts = _counts(llm)
        batched = _run(llm, prompts)
        prompt_lp = _run(llm, [prompts[2]], prompt_logprobs=1)[0][2].prompt_logprobs
        after = _counts(llm)
    _assert_same(alone, full["alone"])
    _assert_same(batched, full["alone"])
    # the saving: only each prompt's last KEEP tokens ran layers 7-9, fewer in each later layer
    assert counts == {"prefill_tokens": sum(LENGTHS), "past_cut_tokens": sum(min(n, KEEP) for n in LENGTHS),
                      "replay_rows": _rows(LENGTHS)}
    # prompt logprobs need every position: that request ran in full, with the same prompt logprobs
    assert after["past_cut_tokens"] - counts["past_cut_tokens"] == sum(min(n, KEEP) for n in LENGTHS) + LENGTHS[2]
    for got, want in zip(prompt_lp[1:], full["prompt_lp"][1:], strict=True):
        assert got.keys() == want.keys()
        assert max(abs(got[k].logprob - want[k].logprob) for k in got) < TOL


def test_exact_chunked_prefill(model_dir, prompts, full):
    """37-token chunks: a request's replay start falls inside a chunk, later chunks read windows that
    start below it, and early chunks drop every token past the cut."""
    with engine(model_dir, max_num_batched_tokens=37, max_num_seqs=4, enable_chunked_prefill=True) as llm:
        got = _run(llm, prompts)
        counts = _counts(llm)
    _assert_same(got, full["alone"])
    assert counts["past_cut_tokens"] == sum(min(n, KEEP) for n in LENGTHS)
    assert counts["replay_rows"] == _rows(LENGTHS)


def test_exact_after_prefix_hit(model_dir, shared, full):
    with engine(model_dir, enable_prefix_caching=True) as llm:
        _run(llm, [shared[0]])
        second = _run(llm, [shared[1]])[0]
    assert second[2].num_cached_tokens > 0, "no prefix hit"
    _assert_same([second], [full["second"]])


def test_exact_after_preemption(model_dir, preempt_prompts, full):
    """A KV pool too small for six long decodes forces preemption; recompute keeps each request's
    replay start (its prompt length minus KEEP)."""
    with engine(model_dir, num_gpu_blocks_override=75, max_num_seqs=6, max_model_len=256,
                max_num_batched_tokens=128, enable_chunked_prefill=True) as llm:
        with recorded_preemptions(llm) as preempted:
            got = _run(llm, preempt_prompts, PREEMPT_NEW)
    assert preempted, "the KV pool was large enough: no request was preempted"
    assert [g[0] for g in got] == [f[0] for f in full["preempt"]]


def test_approximate_keep_is_close(model_dir, prompts, full, monkeypatch):
    """DEEPINFER_YOCO_PREFILL_KEEP_TOKENS below the exact keep (here the window, as vLLM in-tree)
    truncates the first retained rows' windows: close to full prefill, not equal."""
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "16")
    with engine(model_dir) as llm:
        got = [_run(llm, [p])[0] for p in prompts]
        counts = _counts(llm)
    assert counts["past_cut_tokens"] == sum(min(n, 16) for n in LENGTHS)
    assert counts["replay_rows"] == _rows(LENGTHS, (16, 15, 15, 1))
    dev = [max(abs(lp[k] - ref[1][k]) for k in lp.keys() & ref[1].keys()) for (_, lp, _), ref in zip(got, full["alone"])]
    print("approximate keep 16: first-token top-5 max |d logprob| per prompt", dev)
    assert 0 < max(dev) < 0.5  # measured 0.041 / 0.040 / 0.39 for 30 / 300 / 701 tokens


def test_policy():
    """V4 has nothing to replay; a keep below the window is refused; off switches."""
    from vllm_deepinfer.config import ArchConfig
    from vllm_deepinfer.models import replay
    from vllm_deepinfer.tools.make_checkpoint import load_template

    v41 = ArchConfig.from_hf(load_template("v4.1-flash", "tiny"))
    v4 = ArchConfig.from_hf(load_template("v4-flash", "tiny"))
    exact = 3 * 127 + 1
    assert replay.resolve(v41, True, {}) == replay.ReplayPolicy(6, exact, exact, (exact, 255, 128, 1))
    assert replay.resolve(v41, True, {}).layer_keeps(capturing=True) == (exact,) * 4
    assert replay.resolve(v41, True, {replay.KEEP_ENV: "140"}).keeps == (140, 127, 127, 1)
    assert replay.resolve(v41, False, {}) is None
    assert replay.resolve(v41, False, {replay.MODE_ENV: "compact"}).exact
    assert replay.resolve(v41, True, {replay.MODE_ENV: "none"}) is None
    assert not replay.resolve(v41, True, {replay.KEEP_ENV: "140"}).exact
    assert replay.resolve(v4, True, {replay.MODE_ENV: "compact"}) is None
    with pytest.raises(ValueError, match="below the sliding window 128"):
        replay.resolve(v41, True, {replay.KEEP_ENV: "100"})


def test_exact_after_prefix_hit_rewound_past_window(ckpt_root):
    """The release window (128; exact keep 382): a 512-token hit is rewound to 130, so the recomputed
    tail writes past-cut window rows far below hit - W (vLLM's own rewind); those rows need real blocks
    (`patches/replay_window_manager.py`: vLLM's admission put them in the null block, and the hit
    run's first-token logprobs moved by 6e-5, later tokens' by 2.7e-4)."""
    model = tiny_checkpoint(ckpt_root, "v4.1-flash", 0)
    prompt = prompt_ids(model, 600, 11)
    with engine(model, max_model_len=2048, max_num_batched_tokens=256, enable_prefix_caching=True) as llm:
        cold = _run(llm, [prompt])
        hit = _run(llm, [prompt])
    assert hit[0][2].num_cached_tokens >= 512, "no prefix hit"
    _assert_same(hit, cold)
