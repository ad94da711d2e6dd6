"""DSpark drafter of V4.1 (issue 11 part B) on tiny real-format checkpoints.

The target runs inside a vLLM engine (in-process, fp32); the drafter is built on that engine's config and
target (`spec_decode.dspark.DSparkDrafter`), loads the checkpoint's `mtp.*` tensors, and its window caches
get their own paged buffers and block tables here (the engine does not schedule the drafter yet).
References: `tests/reference/dense_dspark.py` on `dense_v41.py` (independent of the package).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import draft_policy, engine, model_runner, tiny_checkpoint
from tests.sampling_stats import assert_same_distribution, seeded_samples

W_MAX_LEN = 1024  # max_model_len of the test engines


def _weights(ckpt: Path):
    from safetensors import safe_open

    for shard in sorted(set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values())):
        with safe_open(str(ckpt / shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class Session:
    """An engine on `ckpt` with its target model, a loaded drafter and paged buffers for the drafter's caches."""

    def __init__(self, llm, ckpt: Path, prefix: str):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        from vllm_deepinfer.spec_decode.dspark import DSparkDrafter

        self.llm, self.vcfg, self.ckpt = llm, llm.llm_engine.vllm_config, ckpt
        self.target = model_runner(llm).model
        with set_current_vllm_config(self.vcfg):
            self.drafter = DSparkDrafter(vllm_config=self.vcfg, prefix=prefix)
        self.drafter.bind_target(self.target)
        self.drafter.load_weights(_weights(ckpt))
        process_weights_after_loading(self.drafter, self.vcfg.model_config, torch.device("cpu"))
        self.arch = self.target.arch

    def caches(self, n_reqs: int, drafter=None) -> dict:
        """Fresh zeroed buffers for every stage's window cache of `drafter` (default: the session's): request r
        owns blocks r*nb+1 .. (r+1)*nb (block 0 is the null block) -> the metadata per cache prefix."""
        from vllm_deepinfer.attention.backend import PagedCacheMetadata

        meta = {}
        for stage in (drafter or self.drafter).stages:
            cache = stage.attn.window_cache
            nb = -(-W_MAX_LEN // cache.block_size)
            cache.bind_kv_cache(torch.zeros(n_reqs * nb + 1, 1, cache.rows_per_block, cache.width))
            table = 1 + torch.arange(n_reqs * nb, dtype=torch.int32).view(n_reqs, nb)
            qsl = torch.zeros(n_reqs + 1, dtype=torch.int32)
            meta[cache.prefix] = PagedCacheMetadata(table, qsl, torch.zeros(n_reqs, dtype=torch.int32),
                                                    cache.block_size, n_reqs, 0, False, W_MAX_LEN, qsl)
        return meta

    @contextlib.contextmanager
    def forward(self):
        from vllm.forward_context import set_forward_context

        with torch.inference_mode(), set_forward_context(None, self.vcfg):
            yield

    def draft(self, contexts: list[torch.Tensor], anchors: list[int], n: int, req: list[int] | None = None,
              temperature=None, seeds=None):
        """contexts[b]: features [P_b + 1, n_targets, D] of request b (or of request req[b], written once)."""
        from vllm_deepinfer.spec_decode.dspark import DraftBatch

        req = list(range(len(contexts))) if req is None else req
        meta = self.caches(max(req) + 1)
        with self.forward():
            for r in sorted(set(req)):
                f = max((c for c, q in zip(contexts, req) if q == r), key=len)
                self.drafter.write_context(f, torch.full((f.shape[0],), r), torch.arange(f.shape[0]), meta)
            block = DraftBatch(torch.tensor(req), torch.tensor([c.shape[0] for c in contexts]), n, meta)
            return self.drafter.draft(torch.tensor(anchors), block, temperature, seeds)

    def target_features(self, ids: list[int]) -> torch.Tensor:
        """Our target's captured features [T, n_targets, D] of one prefill of `ids` (through the engine)."""
        from vllm import SamplingParams

        capture = self.target.enable_stream_capture(self.arch.dspark_target_layer_ids, 4096)
        try:
            self.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0),
                              use_tqdm=False)
        finally:
            self.target.model.capture = None
        assert capture.n_tokens == len(ids) and bool(capture.valid[: len(ids)].all())
        return capture.features[: len(ids)].clone()


@pytest.fixture(scope="module")
def random_ckpt(ckpt_root):
    return tiny_checkpoint(ckpt_root, "v4.1-flash")


@pytest.fixture(scope="module")
def session(random_ckpt):
    with engine(random_ckpt, max_model_len=W_MAX_LEN) as llm:
        yield Session(llm, random_ckpt, "draft_random")


@pytest.fixture(scope="module")
def reference(random_ckpt):
    from tests.reference.dense_dspark import DenseDSpark
    from tests.reference.dense_v41 import DenseV41

    return DenseDSpark(DenseV41(random_ckpt))


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 8000, (n,), generator=g).tolist()


# fp32 tolerances (measured maxima, printed with -s: features 8.6e-6, logits 2.9e-6, confidences 5.4e-7)
FEATURE_TOL = dict(rtol=1e-5, atol=5e-5)
LOGIT_TOL = dict(rtol=1e-5, atol=5e-5)
CONF_TOL = dict(rtol=0, atol=5e-6)


def test_target_capture_matches_reference(session, reference):
    """The streams entering the target layers (stream mean), our engine's forward vs the dense reference."""
    for n in (9, 130):
        ids = _ids(n, n)
        ours, ref = session.target_features(ids), reference.features(ids)
        print(f"features T={n}: max |diff| {(ours - ref).abs().max():.2e}")
        torch.testing.assert_close(ours, ref.to(ours.dtype), **FEATURE_TOL)


@pytest.mark.parametrize("lens,n", [((1,), 5), ((37,), 5), ((150, 37, 1), 5), ((129, 4), 3)])
def test_draft_matches_reference(session, reference, lens, n):
    """Logits (Markov-corrected), confidences and greedy tokens of one block per request, batched, vs the
    reference run per request; contexts shorter than, equal to and longer than the window (W = 128)."""
    contexts = [reference.features(_ids(p, p)) for p in lens]
    anchors = _ids(len(lens), 99)
    got = session.draft(contexts, anchors, n)
    assert got.tokens.shape == (len(lens), n) and got.logits.shape == (len(lens), n, session.arch.vocab_size)
    for b, (f, a) in enumerate(zip(contexts, anchors)):
        want = reference.draft(f, a, n)
        print(f"P+1={f.shape[0]} n={n}: logits max |diff| {(got.logits[b] - want['logits']).abs().max():.2e}, "
              f"confidence {(got.confidence[b] - want['confidence']).abs().max():.2e}")
        torch.testing.assert_close(got.logits[b], want["logits"].float(), **LOGIT_TOL)
        torch.testing.assert_close(got.confidence[b], want["confidence"].float(), **CONF_TOL)
        assert got.tokens[b].tolist() == want["tokens"]


def test_seeded_draft_is_batch_independent(session, reference):
    """Seeded drafts are a function of (seed, position, logits): the same request drafts the same tokens
    alone and in a batch; T = 0 rows stay greedy; different seeds draw differently."""
    contexts = [reference.features(_ids(p, p)) for p in (20, 45)]
    anchors = _ids(2, 7)
    t1 = torch.tensor([1.0, 0.0])
    both = session.draft(contexts, anchors, 5, temperature=t1, seeds=torch.tensor([11, 12]))
    alone = session.draft(contexts[:1], anchors[:1], 5, temperature=t1[:1], seeds=torch.tensor([11]))
    greedy = session.draft(contexts, anchors, 5)
    assert both.tokens[0].tolist() == alone.tokens[0].tolist()
    assert both.tokens[1].tolist() == greedy.tokens[1].tolist()
    probs = both.probs(t1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 5))
    assert probs[1].argmax(-1).tolist() == greedy.tokens[1].tolist() and bool((probs[1].max(-1).values == 1).all())
    other = session.draft(contexts[:1], anchors[:1], 5, temperature=t1[:1], seeds=torch.tensor([12345]))
    assert other.tokens[0].tolist() != alone.tokens[0].tolist()


def test_heads_match_vllm_in_tree_pieces(session):
    """vLLM's in-tree DSpark stages need CUDA kernels (tilelang mHC, fused KV-RoPE insert); its Markov and
    confidence heads (`qwen3_dspark.DSparkMarkovHead` / `DSparkConfidenceHead`, used by the V4.1 DSpark
    model) are plain torch: with our checkpoint's weights they give our heads' values."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead

    a, ours = session.arch, session.drafter
    with set_current_vllm_config(session.vcfg):
        markov = DSparkMarkovHead(a.vocab_size, a.vocab_size, a.dspark_markov_rank, prefix="intree.markov")
        conf = DSparkConfidenceHead(a.hidden_size + a.dspark_markov_rank, prefix="intree.confidence")
        processor = LogitsProcessor(a.vocab_size)
    markov.markov_w1.weight.data.copy_(ours.markov_head.embed.weight)
    markov.markov_w2.weight.data.copy_(ours.markov_head.head.weight)
    conf.proj.weight.data.copy_(ours.confidence_head.proj.weight)
    for module in (markov, conf):  # vLLM's CPU linears repack here
        process_weights_after_loading(module, session.vcfg.model_config, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, a.vocab_size, (7,), generator=g)
    hidden = torch.randn(7, a.hidden_size, generator=g)
    with session.forward():
        psi = ours.markov_head.embed(prev)
        torch.testing.assert_close(markov.embed(prev), psi, rtol=0, atol=0)
        torch.testing.assert_close(markov.bias(psi, processor), ours.markov_head.head(psi),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.sigmoid(conf(hidden, psi)), ours.confidence_head(hidden, psi),
                                   rtol=1e-6, atol=1e-7)

def test_v2_speculator_steps_equal_draft(session, reference):
    """The steps vLLM's V2 `DSparkSpeculator` calls (`VLLM_DEEPINFER_DSPARK_V2=1`), in its order, on a drafter
    whose embedding and head were shared the way vLLM's V2 loader shares them (`model.embed_tokens`, `lm_head`):
    context KV stored by slot ids (as a cold drafter's skipped proposal stores it), the block forward from the
    forward context, then the Markov loop and the
    confidences: the same greedy tokens as `draft` on the V1 path, logits and confidences within fp32 rounding
    (the context KV of all requests comes from one GEMM here, per request there)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_deepinfer.spec_decode.draft_graphs import ContextWriteGraphs
    from vllm_deepinfer.spec_decode.dspark import DSparkDrafter

    n, lens = 5, (150, 37, 1)
    contexts = [reference.features(_ids(p, p)) for p in lens]
    anchors = _ids(len(lens), 99)
    want = session.draft(contexts, anchors, n)
    with set_current_vllm_config(session.vcfg):
        v2 = DSparkDrafter(vllm_config=session.vcfg, prefix="draft_v2")
    v2.load_weights(_weights(session.ckpt))
    process_weights_after_loading(v2, session.vcfg.model_config, torch.device("cpu"))
    v2.model.embed_tokens, v2.lm_head = session.target.model.embed_tokens, session.target.lm_head  # the loader's sharing
    v2.block_len = n
    meta = session.caches(len(lens), v2)
    cache = v2.stages[0].attn.window_cache
    table, bs = meta[cache.prefix].block_table, cache.block_size
    req = torch.cat([torch.full((c.shape[0],), r) for r, c in enumerate(contexts)])
    pos = torch.cat([torch.arange(c.shape[0]) for c in contexts])
    slots = table[req, pos // bs].long() * bs + pos % bs  # vLLM's slot mapping
    ids = torch.full((len(lens), n), v2.noise)
    ids[:, 0] = torch.tensor(anchors)
    block_pos = torch.tensor([c.shape[0] for c in contexts]).unsqueeze(1) + torch.arange(n)
    with torch.inference_mode(), set_forward_context(meta, session.vcfg):
        # the context write of a skipped V2 proposal (`patches/cold_drafter_v2.py`; on CPU eager):
        # combine_hidden_states, then precompute_and_store_context_kv at vLLM's slots
        aux = torch.cat(contexts)                                            # [T, n_targets, D]
        writes = ContextWriteGraphs(v2, aux.shape[0], aux[0].numel(), aux.dtype, aux.device)
        writes.store(list(aux.unbind(1)), pos, [slots] * len(v2.stages))
        hidden = v2(ids.flatten(), block_pos.flatten())
        base = v2.compute_draft_logits(hidden).view(len(lens), n, -1)
        prev, tokens, logits, psis = torch.tensor(anchors), [], [], []
        for k in range(n):
            psi = v2.markov_embed(prev)
            logits.append(base[:, k] + v2.markov_bias(psi))
            prev = v2.map_draft_to_target(logits[-1].argmax(-1))
            tokens.append(prev)
            psis.append(psi)
        confidence = v2.compute_confidence(hidden, torch.stack(psis, dim=1).flatten(0, 1)).view(len(lens), n)
    assert v2.get_draft_kv_cache_layer_names() == [s.attn.window_cache.prefix for s in v2.stages]
    assert torch.stack(tokens, 1).tolist() == want.tokens.tolist()
    torch.testing.assert_close(torch.stack(logits, 1), want.logits, **LOGIT_TOL)
    torch.testing.assert_close(confidence, want.confidence, **CONF_TOL)


# Tests below start their own engines; an engine's exit tears down the distributed state that the module's
# `session` engine uses, so every test on `session` comes before them.

def _acceptance(tokens: torch.Tensor, truth: list[list[int]]) -> float:
    """Mean accepted prefix length / N over the rows."""
    n, total = tokens.shape[1], 0
    for row, want in zip(tokens.tolist(), truth):
        k = 0
        while k < n and row[k] == want[k]:
            k += 1
        total += k
    return total / (n * len(truth))


@pytest.mark.parametrize("kind", ["reproduce", "noise"])
def test_checkpoint_drafters(ckpt_root, kind):
    """`make_checkpoint(..., drafter=kind)`: on our target's greedy continuation, drafting after every
    anchor of it, the reproducing drafter's tokens are that continuation (acceptance ~1, c ~ 1) and the
    noise drafter's never are (acceptance ~0, c ~ 0)."""
    from vllm import SamplingParams

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter=kind)
    n = 5
    with engine(ckpt, max_model_len=W_MAX_LEN) as llm:
        s = Session(llm, ckpt, f"draft_{kind}")
        prompt = _ids(40, 3)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=48, temperature=0),
                           use_tqdm=False)
        seq = prompt + list(out[0].outputs[0].token_ids)
        features = s.target_features(seq)
        anchors = range(len(prompt), len(seq) - n - 1)       # anchor at position p: context 0..p-1
        draft = s.draft([features[:p] for p in anchors], [seq[p] for p in anchors], n, req=[0] * len(anchors))
    acc = _acceptance(draft.tokens, [seq[p + 1:p + 1 + n] for p in anchors])
    conf = draft.confidence.mean().item()
    print(f"{kind}: acceptance {acc:.3f} over {len(anchors)} blocks of {n}, mean confidence {conf:.4f}")
    if kind == "reproduce":
        assert acc >= 0.95 and conf > 0.99
    else:
        assert acc <= 0.05 and conf < 0.01


SPEC = {"method": "dspark", "num_speculative_tokens": 5}


def _generate(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _spec_counters(llm) -> tuple[int, int]:
    m = {x.name: x for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_draft_tokens"].value, m["vllm:spec_decode_num_accepted_tokens"].value


def _verified_lengths(llm) -> list[int]:
    """Request-steps by verified draft length 0..k from `vllm:deepinfer_spec_decode_verified_length`
    (`patches/spec_length_metrics.py`): the histogram's cumulative buckets, differenced."""
    (h,) = [x for x in llm.get_metrics() if x.name == "vllm:deepinfer_spec_decode_verified_length"]
    cumulative = [h.buckets[le] for le in sorted(h.buckets, key=float) if le != "+Inf"]
    return [b - a for a, b in zip([0] + cumulative, cumulative)]


def test_engine_dspark_varlen_lossless_max_and_min(ckpt_root, monkeypatch):
    """vLLM's V1 runner with `method="dspark"` (our proposer) and confidence-scheduled verification
    (DEEPINFER_ENABLE_MTP_VARLEN=1), mixed-length batch, chunked prefill: greedy tokens equal speculation off
    for both checkpoint drafters (same target); the reproducing drafter (c ~ 0.9997) is accepted and verified
    at the full block length, the noise drafter (c ~ 0.0003) at length 0 (vLLM counts no draft tokens), and after
    a few unpaid blocks its proposals skip the block (`schedule.ColdDrafter`), still with the same tokens.
    vLLM computes no per-token slot mapping for any of the target's and drafter's cache groups.
    Decode and verification steps take the fixed-buffer draft step that CUDA graphs replay on a GPU
    (`spec_decode/draft_graphs.py`, run eagerly here: 3 requests padded to 4, trimmed verifications)."""
    ckpts = {kind: tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter=kind) for kind in ("reproduce", "noise")}
    prompts = [_ids(n, n) for n in (7, 40, 150)]
    chunked = dict(max_model_len=W_MAX_LEN, max_num_batched_tokens=64, enable_chunked_prefill=True)
    with engine(ckpts["reproduce"], **chunked) as llm:
        base = _generate(llm, prompts, 24)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    n = SPEC["num_speculative_tokens"]
    for kind, ckpt in ckpts.items():
        with engine(ckpt, speculative_config=SPEC, disable_log_stats=False, **chunked) as llm:
            proposer = model_runner(llm).drafter
            assert proposer.fixed_steps is None  # no CUDA graphs on CPU
            # no group of ours (target and drafter caches) gets vLLM's slot mapping (patches/unused_slot_mappings.py)
            modes = {t.slot_mapping_mode.name for t in model_runner(llm).input_batch.block_table.block_tables}
            assert modes == {"NONE"}, modes
            proposer.fixed_steps = proposer.fixed_step_graphs(capture_graphs=False)
            assert _generate(llm, prompts, 24) == base, kind
            drafted, accepted = _spec_counters(llm)
            policy = draft_policy(llm)
            counts, blocks, skipped, steps = (policy.length_counts, policy.draft_steps, policy.cold.skipped,
                                              policy.steps)
            verified = _verified_lengths(llm)
            fixed = proposer.fixed_steps.steps
        print(f"{kind} in vLLM, varlen: {accepted}/{drafted} draft tokens accepted, lengths chosen {counts}, "
              f"verified (/metrics) {verified}, {fixed} fixed-buffer steps, {blocks} blocks run, {skipped} "
              "proposals skipped")
        assert sum(counts) > 0 and fixed >= 3 and len(verified) == n + 1
        if kind == "reproduce":
            assert counts[n] == sum(counts) and drafted > 0 and accepted / drafted >= 0.95
            assert verified[n] * n == drafted and sum(verified[1:n]) == 0
            assert skipped == 0
        else:
            assert counts[0] == sum(counts) and drafted == 0
            assert sum(verified[1:]) == 0 and verified[0] > 0
            # the cold drafter: after 4 unpaid blocks, proposals store context rows only, with probes between
            assert skipped > 0 and blocks + skipped == steps


def test_engine_dspark_seeded_sampling_distribution(ckpt_root):
    """Seeded sampling (temperature 0.1: tiny V4.1's top logits are 0.02-0.6 apart) with DSpark speculation
    follows the distribution without it: DSpark's greedy drafts are a deterministic proposal, which vLLM's
    rejection sampler (accept with p(d), else resample from p without d) keeps exact. Chi-square homogeneity per
    position, false alarm <= 1 % in all (`sampling_stats`); drafts are both accepted and rejected."""
    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter="reproduce")
    with engine(ckpt, max_num_seqs=64) as llm:
        off = seeded_samples(llm, 0.1)
    with engine(ckpt, speculative_config=SPEC, disable_log_stats=False, max_num_seqs=64) as llm:
        on = seeded_samples(llm, 0.1)
        drafted, accepted = _spec_counters(llm)
    print(f"DSpark, seeded sampling: {accepted}/{drafted} draft tokens accepted")
    assert 0 < accepted < drafted
    assert_same_distribution(off, on)


def test_engine_dspark_invariant_mode_equals_no_speculation(ckpt_root, monkeypatch):
    """DEEPINFER_BATCH_INVARIANT=1: seeded requests (temperature 1.5; temperature 1 with top-k 20) and greedy
    ones with DSpark speculation get exactly the tokens of that mode without speculation (exact-match
    verification against the seeded draws, drafts drawn with the target's noise); drafts are accepted."""
    from vllm import SamplingParams

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter="reproduce")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    params = ([SamplingParams(temperature=1.5, seed=s, max_tokens=16, ignore_eos=True) for s in range(3)]
              + [SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=16, ignore_eos=True),
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)])
    prompts = [{"prompt_token_ids": _ids(n, i)} for i, n in enumerate((7, 40, 150, 40, 150))]

    def run(llm) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    with engine(ckpt, max_model_len=W_MAX_LEN) as llm:
        off = run(llm)
    with engine(ckpt, speculative_config=SPEC, disable_log_stats=False, max_model_len=W_MAX_LEN) as llm:
        on = run(llm)
        drafted, accepted = _spec_counters(llm)
    print(f"DSpark, invariant mode: {accepted}/{drafted} draft tokens accepted")
    assert on == off
    assert 0 < accepted <= drafted


def test_engine_dspark_drafts_match_reference(random_ckpt, reference):
    """Random drafter in vLLM (drafts rejected every step, chunked prefill): every block our proposer
    drafts equals the dense reference's greedy block for the same context and anchor, and the greedy
    tokens equal speculation off."""
    chunked = dict(max_model_len=W_MAX_LEN, max_num_batched_tokens=64, enable_chunked_prefill=True)
    prompt = _ids(150, 5)
    records = []
    with engine(random_ckpt, speculative_config=SPEC, **chunked) as llm:
        proposer = model_runner(llm).drafter
        propose = proposer.propose

        def recording(**kw):
            tokens = propose(**kw)
            cm, rejected = kw["common_attn_metadata"], kw["num_rejected_tokens_gpu"]
            pos = int(cm.seq_lens[0]) - (0 if rejected is None else int(rejected[0]))
            records.append((pos, int(kw["next_token_ids"][0]), tokens[0].tolist()))
            return tokens

        proposer.propose = recording
        spec = _generate(llm, [prompt], 12)[0]
    with engine(random_ckpt, **chunked) as llm:
        assert spec == _generate(llm, [prompt], 12)[0]
    seq = prompt + spec
    features = reference.features(seq)
    done = [r for r in records if r[0] >= len(prompt)]  # the last prefill chunk's and every decode step's block
    assert len(done) >= len(spec) - 1
    for pos, anchor, tokens in done:
        assert anchor == seq[pos]
        assert tokens == reference.draft(features[:pos], anchor, 5)["tokens"], pos

