"""Tensor parallel (`LLM(..., tensor_parallel_size=2)`, vLLM's multiprocessing executor) against one process.

Each rank owns half of the query heads, `attn_sink` entries and `wo_a` groups, a row slice of `wo_b`
(all-reduce), and half of the vocabulary of the embedding and LM head; everything else is replicated
(models/attention.py). On this CPU build TP=2 needs one OpenMP core per rank
(`VLLM_CPU_OMP_THREADS_BIND="0|1"`: vLLM refuses auto-binding with one NUMA node), and the workers are
spawned processes (minutes to start here). The all-reduce sums the two ranks' partial `wo_b` products,
a different summation order: greedy tokens must be identical, logprobs equal to 1e-4 (fp32).

The V4.1 bf16 case keeps its Engram tables in host memory (`DEEPINFER_ENGRAM_DEVICE=host`, the CUDA default):
both ranks then map one node-shared copy (`models/shared_host.py`), which rank 0 alone loads.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import engine, tiny_checkpoint
from tests.fidelity import prompt_ids
from vllm_deepinfer.models.shared_host import FILE_PREFIX, SHM_DIR

LOGPROB_TOL = 1e-4


def _generate(ckpt, probe=None, **overrides) -> tuple[list[tuple[list[int], list[dict[int, float]]]], list | None]:
    """(greedy tokens and top-5 logprobs per prompt, `probe(worker)` of every worker (or, with `probe="metrics"`,
    the engine's `get_metrics()`) or None)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=prompt_ids(ckpt, n, seed=i)) for i, n in enumerate((37, 300))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    with engine(ckpt, max_model_len=1024, max_num_batched_tokens=1024, **overrides) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        probed = llm.get_metrics() if probe == "metrics" else llm.collective_rpc(probe) if probe else None
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs], probed


def _assert_same(want: list, got: list) -> None:
    """Per prompt (`_generate` outputs): equal greedy tokens, top-5 logprobs within LOGPROB_TOL."""
    for (tokens1, lps1), (tokens2, lps2) in zip(want, got):
        assert tokens2 == tokens1
        diff = max(abs(a[t] - b[t]) for a, b in zip(lps1, lps2) for t in a.keys() & b.keys())
        assert diff <= LOGPROB_TOL, diff


def _engram_tables(worker) -> dict:
    """Where this worker's Engram tables live: the /dev/shm files its process maps, and its tables' labels."""
    from vllm_deepinfer.models.shared_host import FILE_PREFIX

    model = getattr(worker, "worker", worker).model_runner.model
    tables = [layer.engram.embed for layer in model.model.layers if layer.engram is not None]
    with open("/proc/self/maps") as f:
        mapped = {line.split(maxsplit=5)[5].strip() for line in f if FILE_PREFIX in line}
    return {"mapped": sorted(mapped), "host": [t.host for t in tables], "shared": {t.shared for t in tables},
            "writer": {t.loads_checkpoint for t in tables}}


_SINGLE: dict[str, list] = {}


@pytest.mark.parametrize("arch,storage,engram", [("v4-flash", "bf16", "gpu"), ("v4.1-flash", "bf16", "host"),
                                                 ("v4.1-flash", "packed", "gpu")])
def test_tp2_matches_one_process(ckpt_root, monkeypatch, arch, storage, engram):
    """`packed`: each rank loads its shard of the FP8 codes and E8M0 scale blocks (the one-process run keeps
    bf16: packed equals bf16 bitwise there, tests/test_fp8_linears.py). `host`: one node-shared table copy."""
    ckpt = tiny_checkpoint(ckpt_root, arch, 0)
    if arch not in _SINGLE:
        _SINGLE[arch] = _generate(ckpt)[0]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("DEEPINFER_FP8_LINEARS", storage)
    monkeypatch.setenv("DEEPINFER_ENGRAM_DEVICE", engram)
    shm_before = {f for f in os.listdir(SHM_DIR) if f.startswith(FILE_PREFIX)}
    tp2, tables = _generate(ckpt, probe=_engram_tables if engram == "host" else None, tensor_parallel_size=2)
    _assert_same(_SINGLE[arch], tp2)
    if tables:  # both ranks map the same unlinked file; rank 0 wrote it; nothing is left in /dev/shm
        (mapped,) = {tuple(t["mapped"]) for t in tables}
        assert len(mapped) == 1 and mapped[0].startswith(f"{SHM_DIR}/{FILE_PREFIX}") and mapped[0].endswith("(deleted)")
        assert all(all(t["host"]) and t["shared"] == {f"{mapped[0].split()[0]} (2 ranks)"} for t in tables), tables
        assert [t["writer"] for t in tables] == [{True}, {False}]
    assert {f for f in os.listdir(SHM_DIR) if f.startswith(FILE_PREFIX)} == shm_before


@pytest.mark.parametrize("arch,method", [("v4-flash", "mtp"), ("v4.1-flash", "dspark")])
def test_tp2_speculation_matches_one_process(ckpt_root, monkeypatch, arch, method):
    """The drafters under TP=2 (V4's MTP block, V4.1's DSpark stages; checkpoints whose drafter reproduces the
    target): greedy tokens with speculation equal one process without it, logprobs to 1e-4."""
    ckpt = tiny_checkpoint(ckpt_root, arch, 0, drafter="reproduce")
    single = _generate(ckpt)[0]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp2, metrics = _generate(ckpt, "metrics", tensor_parallel_size=2, disable_log_stats=False,
                             speculative_config={"method": method, "num_speculative_tokens": 3})
    _assert_same(single, tp2)
    counts = {m.name: m.value for m in metrics if m.name.startswith("vllm:spec_decode_num_")
              and hasattr(m, "value")}
    assert counts["vllm:spec_decode_num_accepted_tokens"] > 0.9 * counts["vllm:spec_decode_num_draft_tokens"] > 0, \
        counts


def test_tp_that_cannot_split_the_heads_is_refused(ckpt_root):
    """tiny V4.1 has 4 query heads and 2 wo_a groups: TP=4 is refused before any weight is loaded."""
    from vllm_deepinfer.config import ArchConfig, ConfigError

    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash", 0)
    arch = ArchConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    arch.check_tensor_parallel(2)
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 must divide .* o_groups \\(2\\)"):
        arch.check_tensor_parallel(4)
