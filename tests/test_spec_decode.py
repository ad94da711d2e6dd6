"""V4 MTP speculative decoding on vLLM's V1 runner (CPU), issue 11 part A.

Real engines on tiny V4 checkpoints (fp32): greedy outputs with speculation (K=1, K=3; chunked prefill;
preemption) equal speculation off; a drafter that reproduces the target (`make_checkpoint --drafter
reproduce`) is accepted ~always and confidence-scheduled verification then verifies the maximum length,
a noise drafter is accepted ~never and verification drops to the minimum (vLLM's own spec-decode
metrics); seeded sampling with speculation follows the distribution without it (chi-square tests).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import draft_policy, engine, recorded_preemptions, tiny_checkpoint
from tests.fidelity import prompt_ids
from tests.sampling_stats import ALPHA, POSITIONS, assert_same_distribution, chi2_homogeneity_p, seeded_samples
from vllm_deepinfer.spec_decode.schedule import ColdDrafter, VerifyCost, choose_lengths, draft_survival, no_slot_pays

# Module-scoped engines live until the module ends, and a newer engine in the process takes over vLLM's global
# state (forward context, distributed groups): each test uses only the newest engine, so the tests are ordered
# by the engine they use (reproducing drafter, then noise drafter, then the tests that start their own).
LENGTHS = (5, 37, 130, 301)
N_NEW = 24
# an 80-block pool (drafter caches included) holds two ~70-token prompts at admission but not two of them
# grown by 300 tokens: the scheduler admits two of the three and must preempt one as they grow
PREEMPT_BLOCKS, PREEMPT_PROMPTS, PREEMPT_NEW = 80, 3, 300
K = 3


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def _generate(llm, prompts: list[list[int]], n_new: int = N_NEW, params=None) -> list[list[int]]:
    """Greedy tokens of `prompts` (or sampled with `params`, one SamplingParams per prompt)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = params or SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _spec_counts(llm) -> dict[str, float | list[float]]:
    """vLLM's spec-decode counters of `llm` (cumulative): drafts, draft tokens, accepted, accepted per position."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            out[m.name.removeprefix("vllm:spec_decode_")] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _delta(after: dict, before: dict) -> dict:
    d = {}
    for k, v in after.items():
        b = before.get(k, [0] * len(v) if isinstance(v, list) else 0)
        d[k] = [x - y for x, y in zip(v, b)] if isinstance(v, list) else v - b
    return d


@pytest.fixture(scope="module")
def std(ckpt_root):
    """(model dir, mixed prompts, preemption prompts, greedy tokens without speculation for both)."""
    model_dir = tiny_checkpoint(ckpt_root, "v4-flash", 0, index_topk=16)
    mixed = [prompt_ids(model_dir, n, i) for i, n in enumerate(LENGTHS)]
    preempt = [prompt_ids(model_dir, 60 + 7 * i, i) for i in range(PREEMPT_PROMPTS)]
    with engine(model_dir) as llm:
        return model_dir, mixed, preempt, _generate(llm, mixed), _generate(llm, preempt, PREEMPT_NEW)


def test_lossless_k1_mixed_batch(std):
    model_dir, mixed, _, ref, _ = std
    with engine(model_dir, speculative_config=_mtp(1), disable_log_stats=False) as llm:
        assert _generate(llm, mixed) == ref
        assert _spec_counts(llm)["num_drafts"] > 0


def test_lossless_k3_chunked_prefill_and_preemption(std):
    """K=3 on a KV pool too small for the long decodes (preemption + recompute) with 128-token chunks; then
    varlen with a cost model under which the random drafter's drafts are trimmed to a partial length."""
    model_dir, mixed, preempt, ref, ref_preempt = std
    with engine(model_dir, speculative_config=_mtp(K), num_gpu_blocks_override=PREEMPT_BLOCKS, max_num_seqs=6,
                max_model_len=1024, max_num_batched_tokens=128, enable_chunked_prefill=True,
                disable_log_stats=False) as llm:
        assert _generate(llm, mixed) == ref
        with recorded_preemptions(llm) as preempted:
            assert _generate(llm, preempt, PREEMPT_NEW) == ref_preempt
        assert _spec_counts(llm)["num_draft_tokens"] > 0
        policy = draft_policy(llm)
        # threshold s > E * b / (a + b n) ~ 1e-3 at B = 4: below this drafter's first-position probabilities,
        # above its products at later positions (measured: length 1 of 3 for every request and step)
        policy.varlen, policy.cost = True, VerifyCost(fixed=1.0, per_token=2.5e-4)
        counts = list(policy.length_counts)
        assert _generate(llm, mixed) == ref
        chosen = [a - b for a, b in zip(policy.length_counts, counts)]
        assert sum(chosen) > 0 and chosen[0] + chosen[K] < sum(chosen), f"no partial length chosen: {chosen}"
    assert preempted, "the KV pool was large enough: no request was preempted"


@pytest.fixture(scope="module")
def reproduce(ckpt_root):
    """(model dir, mixed prompts, greedy tokens and seeded samples without speculation)."""
    model_dir = tiny_checkpoint(ckpt_root, "v4-flash", 0, drafter="reproduce")
    mixed = [prompt_ids(model_dir, n, i) for i, n in enumerate(LENGTHS)]
    with engine(model_dir, max_num_seqs=64) as llm:
        return model_dir, mixed, _generate(llm, mixed), seeded_samples(llm, TEMPERATURE)


@pytest.fixture(scope="module")
def reproduce_llm(reproduce):
    """K=3 speculation with confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN=1 at start-up)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
        with engine(reproduce[0], speculative_config=_mtp(K), disable_log_stats=False, max_num_seqs=64) as llm:
            yield llm


def test_reproducing_drafter_accepted_and_max_length(reproduce, reproduce_llm):
    _, mixed, ref, _ = reproduce
    llm = reproduce_llm
    policy = draft_policy(llm)
    assert policy.varlen
    before = _spec_counts(llm)
    assert _generate(llm, mixed) == ref
    stats = _delta(_spec_counts(llm), before)
    assert stats["num_accepted_tokens"] / stats["num_draft_tokens"] > 0.95, stats
    assert stats["num_accepted_tokens"] / stats["num_drafts"] > 0.95 * K, stats   # mean accepted length
    assert min(stats["num_accepted_tokens_per_pos"]) > 0.95 * stats["num_drafts"], stats
    assert sum(policy.length_counts) > 0 and policy.length_counts[K] == sum(policy.length_counts), policy.length_counts


# ----------------------------------------------------------------------------- seeded sampling
TEMPERATURE = 2.0  # tiny V4's logits have std ~32 (`sampling_stats.seeded_samples`)


def test_seeded_sampling_distribution(reproduce, reproduce_llm):
    """Tokens sampled with speculation follow the no-speculation distribution (`sampling_stats`: chi-square
    homogeneity per position, false alarm <= 1 % in all); both of vLLM's rejection-sampler paths (accept,
    reject + resample) run."""
    llm = reproduce_llm
    before = _spec_counts(llm)
    on = seeded_samples(llm, TEMPERATURE)
    stats = _delta(_spec_counts(llm), before)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert_same_distribution(reproduce[3], on)


@pytest.fixture(scope="module")
def noise_llm(ckpt_root):
    model_dir = tiny_checkpoint(ckpt_root, "v4-flash", 0, drafter="noise")
    mixed = [prompt_ids(model_dir, n, i) for i, n in enumerate(LENGTHS)]
    with engine(model_dir, speculative_config=_mtp(K), disable_log_stats=False) as llm:
        yield llm, mixed


def test_noise_drafter_rejected(noise_llm):
    llm, mixed = noise_llm
    policy = draft_policy(llm)
    policy.varlen = False  # fixed length (the default): every draft verified
    before = _spec_counts(llm)
    _generate(llm, mixed)
    stats = _delta(_spec_counts(llm), before)
    assert stats["num_draft_tokens"] >= K * len(mixed) * (N_NEW // 2), stats
    assert stats["num_accepted_tokens"] / stats["num_draft_tokens"] < 0.05, stats


def test_noise_drafter_min_length(noise_llm):
    llm, mixed = noise_llm
    policy = draft_policy(llm)
    policy.varlen = True
    counts, steps, proposals = list(policy.length_counts), policy.draft_steps, policy.steps
    before = _spec_counts(llm)
    _generate(llm, mixed)
    chosen = [a - b for a, b in zip(policy.length_counts, counts)]
    assert sum(chosen) > 0 and chosen[0] == sum(chosen), chosen
    assert _delta(_spec_counts(llm), before).get("num_draft_tokens", 0) == 0
    # no first draft pays, so the drafter stops after its first step (1 forward per proposal, not K)
    assert policy.draft_steps - steps == policy.steps - proposals > 0


def test_invariant_mode_seeded_speculation_equals_no_speculation(reproduce, monkeypatch):
    """DEEPINFER_BATCH_INVARIANT=1 with K=3 speculation: seeded requests (temperature 2; temperature 1 with top-k
    20) and greedy ones, batched, get exactly the tokens of invariant mode without speculation, and the first
    request alone the same again (exact-match verification against the seeded draws,
    `patches/seeded_sampler.py`); the reproducing drafter's coupled drafts are accepted."""
    from vllm import SamplingParams

    model_dir, mixed = reproduce[0], reproduce[1]
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    n = 12
    params = ([SamplingParams(temperature=2.0, seed=s, max_tokens=n, ignore_eos=True) for s in range(6)]
              + [SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=n, ignore_eos=True)]
              + [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)] * 2)
    prompts = [list(range(100, 140))] * 7 + mixed[1:3]
    with engine(model_dir, max_num_seqs=16) as llm:
        off = _generate(llm, prompts, params=params)
    with engine(model_dir, speculative_config=_mtp(K), disable_log_stats=False, max_num_seqs=16) as llm:
        on = _generate(llm, prompts, params=params)
        stats = _spec_counts(llm)
        solo = _generate(llm, prompts[:1], params=params[:1])
    print(f"invariant mode, K={K}: {stats['num_accepted_tokens']}/{stats['num_draft_tokens']} draft tokens accepted")
    assert on == off
    assert solo == off[:1]
    # the reproducing drafter's drafts, drawn with the target's noise (coupled), are the target's draws
    assert stats["num_accepted_tokens"] > 0.9 * stats["num_draft_tokens"] > 0, stats


def test_chi2_helper_detects_a_shift():
    """The statistic has power at this sample size: 60/40 vs 40/60 splits of 256 draws are rejected at
    ALPHA / 3, near-equal splits are not."""
    assert chi2_homogeneity_p([0] * 154 + [1] * 102, [0] * 102 + [1] * 154) < ALPHA / len(POSITIONS)
    assert chi2_homogeneity_p([0] * 128 + [1] * 128, [0] * 131 + [1] * 125) > 0.5


# ----------------------------------------------------------------------------- draft-length policy
def test_verified_lengths_from_vllm_counters():
    """`patches/spec_length_metrics.verified_lengths`: a step's request-steps by verified length, zeros from the
    decode outputs without a draft (k = 3: drafts of 3, 3, 1 tokens among 5 decode outputs; a step without drafts)."""
    from vllm_deepinfer.patches.spec_length_metrics import verified_lengths

    assert verified_lengths([3, 2, 2], 5) == [2, 1, 0, 2]
    assert verified_lengths([0, 0, 0], 4) == [4, 0, 0, 0]


def test_choose_lengths_prefix_and_extremes():
    sure, flat = draft_survival(torch.full((4, K), 0.999)), draft_survival(torch.full((4, K), 1 / 8192))
    assert choose_lengths(sure, 4).tolist() == [K] * 4
    assert choose_lengths(flat, 4).tolist() == [0] * 4
    mixed = draft_survival(torch.tensor([[0.99, 0.99, 0.1], [0.5, 0.5, 0.5], [0.01, 0.9, 0.9]]))
    assert choose_lengths(mixed, 3, VerifyCost(fixed=1.0, per_token=1.0)).tolist() == [2, 0, 0]


def test_choose_lengths_shrinks_with_batch_size():
    """The same confidences verify fewer drafts when the batch makes each verified token cost more."""
    s = draft_survival(torch.full((256, K), 0.9))
    small, large = choose_lengths(s[:2], 2), choose_lengths(s, 256)
    assert small.tolist() == [K, K] and int(large.max()) < K


def test_choose_lengths_maximises_expected_rate():
    """Against brute force over every length vector of a small batch."""
    import itertools

    cost = VerifyCost(fixed=2.0, per_token=1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        s = draft_survival(torch.rand(3, K, generator=g))
        def rate(ks):
            return (3 + sum(float(s[r, :k].sum()) for r, k in enumerate(ks))) / cost.step_time(3 + sum(ks))
        best = max(rate(ks) for ks in itertools.product(range(K + 1), repeat=3))
        assert math.isclose(rate(choose_lengths(s, 3, cost).tolist()), best, rel_tol=1e-9)


def test_choose_lengths_fills_graph_padding():
    """A step padded to a captured graph's size computes the padding anyway: once no slot pays, the best remaining
    slots (prefixes, nonzero survival only) fill it; without padding the choice is unchanged."""
    g = torch.Generator().manual_seed(1)
    low = draft_survival(torch.rand(5, K, generator=g) * 0.01)         # nothing pays at this confidence
    assert choose_lengths(low, 5).tolist() == [0] * 5
    assert choose_lengths(low, 5, padded=lambda n: n).tolist() == [0] * 5
    got = choose_lengths(low, 5, padded=lambda n: 8 if n <= 8 else n)  # 5 tokens replay the 8-token graph
    assert int(got.sum()) == 3
    taken = sorted(float(low[r, i]) for r in range(5) for i in range(int(got[r])))
    assert taken == sorted(low.flatten().tolist())[-3:]                 # the 3 best slots, as row prefixes
    zero = torch.zeros(5, K)
    zero[0, 0] = 0.001
    assert choose_lengths(zero, 5, padded=lambda n: 8).tolist() == [1, 0, 0, 0, 0]  # survival 0: never verified
    mixed = draft_survival(torch.tensor([[0.99, 0.99, 0.1], [0.5, 0.5, 0.5], [0.01, 0.9, 0.9]]))
    cost = VerifyCost(fixed=1.0, per_token=1.0)
    assert choose_lengths(mixed, 3, cost, padded=lambda n: 6).tolist() == [2, 1, 0]  # + the next best: 0.5


def test_no_slot_pays_bounds_the_chosen_lengths():
    """Where `no_slot_pays` holds for a position (the MTP loop's stop), `choose_lengths` verifies none at or
    after it (the stop changes no chosen length)."""
    cost = VerifyCost()
    g = torch.Generator().manual_seed(1)
    stops = 0
    for _ in range(200):
        b = int(torch.randint(1, 65, (1,), generator=g))
        s = draft_survival(torch.rand(b, K, generator=g) ** 4)
        lengths = choose_lengths(s, b, cost)
        for j in range(K):
            if no_slot_pays(s[:, j], b, cost):
                stops += 1
                assert int(lengths.max()) <= j
                break
    assert 20 < stops < 200, stops   # both outcomes exercised


def _cold_run(cold: ColdDrafter, outcomes, lag: int = 0) -> str:
    """Drive `cold` for len(outcomes) proposals; outcomes[i]: whether proposal i's drafts would pay. A RUN / PROBE
    proposal's outcome is reported `lag` proposals later (V2's budget reads stale estimates). -> the kinds as a
    string of letters (R run, P probe, M more, S skip)."""
    kinds, pending = [], []
    for i, pays in enumerate(outcomes):
        while pending and pending[0][0] <= i:
            cold.paid(*pending.pop(0)[1:])
        kind = cold.step()
        kinds.append(kind[0].upper())
        if kind in (ColdDrafter.RUN, ColdDrafter.PROBE):
            pending.append((i + lag, kind, pays))
    return "".join(kinds)


def test_cold_drafter_skips_unpaid_blocks_and_probes():
    """`ColdDrafter`: four unpaid blocks turn it cold; it probes after 4, 8, 16 ... skipped proposals (at most
    128); a paid probe makes it hot again; a new request brings the next probe forward, once between two
    scheduled probes."""
    never = _cold_run(ColdDrafter(), [False] * 80)
    assert never == "RRRR" + "S" * 4 + "P" + "S" * 8 + "P" + "S" * 16 + "P" + "S" * 32 + "P" + "S" * 12
    assert _cold_run(ColdDrafter(), [True] * 20) == "R" * 20
    # paid again from proposal 8 (the first probe): hot from then on
    assert _cold_run(ColdDrafter(), [False] * 8 + [True] * 6) == "RRRR" + "SSSS" + "P" + "R" * 5
    capped = ColdDrafter(max_interval=16)
    _cold_run(capped, [False] * 200)
    assert capped.interval == 16
    cold = ColdDrafter()
    _cold_run(cold, [False] * 20)          # cold, waiting 16 - 6 more proposals
    cold.new_request()
    assert _cold_run(cold, [False] * 6) == "SSSSPS"
    cold.new_request()                     # once between two scheduled probes: the wait (32) stays
    assert _cold_run(cold, [False] * 33) == "S" * 31 + "PS"
    cold.new_request()                     # after a scheduled probe: again
    assert _cold_run(cold, [False] * 5) == "SSSSP"
    # V2: a probe is two blocks and its outcome arrives two proposals later; the probe's second block is not
    # reported, and an unpaid RUN block still in flight when it turned cold does not count
    v2 = _cold_run(ColdDrafter(probe_len=2), [False] * 40, lag=2)
    assert v2 == "RRRRR" + "SSSS" + "PM" + "S" * 8 + "PM" + "S" * 16 + "PM" + "S", v2


def test_free_slots_of_vllms_verify_cost_table():
    """V2's cold-drafter rule counts a budget as paid only past the slots the step's padded graph computes anyway:
    `free_slots` on a table vLLM itself builds (`build_cost_tables_from_curves`, graphs of 1/2/4/8 tokens)."""
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import build_cost_tables_from_curves

    from vllm_deepinfer.patches.cold_drafter_v2 import free_slots

    _, verify = build_cost_tables_from_curves([(1, 0.5)], [(1, 1.0), (2, 1.1), (4, 1.2), (8, 1.5)], 8, 64, 8)
    assert [free_slots(verify, n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 0, 1, 0, 3, 0, 0]


# ----------------------------------------------------------------------------- vllm serve
def test_serve_metrics_from_deepinfer_settings(ckpt_root, tmp_path):
    """`vllm serve` with DEEPINFER_USE_NEXTN_DECODE=3 and DEEPINFER_ENABLE_MTP_VARLEN=1 (no --speculative-config):
    speculation runs, and /metrics shows vLLM's acceptance counters per position and in total."""
    import re

    import httpx

    from tests.conftest import Server, free_port

    model = tiny_checkpoint(ckpt_root, "v4-flash", 0, drafter="reproduce")
    srv = Server(model, free_port(), tmp_path / "server.log", ["--max-model-len", "1024", "--max-num-seqs", "4"],
                 env={"DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "1"})
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
            "model": str(model), "prompt": list(range(100, 140)), "max_tokens": 32, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()

    def value(name: str, labels: str = "") -> float:
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*{labels}[^}}]*\}} ([0-9.e+]+)$", metrics, re.M)
        assert m, f"{name} {labels} not on /metrics"
        return float(m.group(1))

    drafts, draft_tokens = value("vllm:spec_decode_num_drafts_total"), value("vllm:spec_decode_num_draft_tokens_total")
    accepted = value("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"') for i in range(K)]
    assert drafts > 0 and draft_tokens == K * drafts, (drafts, draft_tokens)   # varlen kept the maximum
    assert accepted / draft_tokens > 0.95 and min(per_pos) > 0.95 * drafts, (accepted, per_pos)
    # verified draft lengths per request-step (`patches/spec_length_metrics.py`): every draft verified at K
    full = value("vllm:deepinfer_spec_decode_verified_length_bucket", f'le="{K}.0"') - \
        value("vllm:deepinfer_spec_decode_verified_length_bucket", f'le="{K - 1}.0"')
    assert full == drafts, (full, drafts)
    assert "confidence-scheduled" in (tmp_path / "server.log").read_text()
