"""Data-parallel attention + expert-parallel MoE on CPU through vLLM's own launcher.

`vllm serve --data-parallel-size 2 --enable-expert-parallel` starts a DP coordinator and two engine-core
processes (one worker each; `VLLM_CPU_OMP_THREADS_BIND="0|1"` gives each its own core); vLLM places 4 of the
8 experts on each rank and exchanges tokens with its allgather/reduce-scatter all2all manager, which on CPU
needs `patches/cpu_gatherv.py` (vLLM 0.32's CPU communicator has no `all_gatherv`/`reduce_scatterv`).
The greedy tokens of tiny V4 (hash layers) and V4.1 (`bias_vl`) checkpoints in fp32 must equal one in-process
engine's, logprobs to 1e-4 (each rank sums its experts' share, the reduce-scatter adds the two): first one
request alone (the other rank has none and runs vLLM's dummy batches through the same MoE collectives), then
three at once (the ranks get 2 and 1 requests of different lengths and finish at different steps).
V4.1 runs with host Engram tables (`DEEPINFER_ENGRAM_DEVICE=host`, the CUDA default): the two DP ranks map one
node-shared copy that the first rank loads (`models/shared_host.py`; vLLM's `dp_shared_memory`).

Offline `LLM(data_parallel_size=2)` is refused by vLLM itself (asserted below); vLLM points to its
multi-process example (one `LLM` per rank with VLLM_DP_RANK/VLLM_DP_SIZE), which runs the same engine path.
"""

from __future__ import annotations

import concurrent.futures
import os
import re

import pytest

from tests.conftest import Server, engine, free_port, run_ranks, tiny_checkpoint
from vllm_deepinfer.models.shared_host import FILE_PREFIX, SHM_DIR

httpx = pytest.importorskip("httpx")

PROMPTS = [list(range(5, 5 + n)) for n in (7, 40, 130)]
MAX_TOKENS = 12
LIMITS = ["--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "16", "--seed", "0"]


def _reference(ckpt, prompts: list[list[int]] = PROMPTS, chunk: int = 2048) -> list[tuple[list[int], list[float]]]:
    """One in-process engine (`chunk` tokens per step): (greedy tokens, their logprobs) per prompt."""
    from vllm import SamplingParams

    with engine(ckpt, max_model_len=2048, max_num_batched_tokens=chunk) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1), use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


def _complete(server: Server, prompt: list[int]) -> tuple[list[int], list[float]]:
    """/v1/completions on token ids, greedy: (tokens, their logprobs)."""
    r = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": 1, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]], tol: float = 1e-4) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < tol


@pytest.mark.parametrize("arch", ["v4-flash", "v4.1-flash"])
def test_dp2_ep2_serve_matches_one_process(ckpt_root, tmp_path, arch):
    ckpt = tiny_checkpoint(ckpt_root, arch)
    want = _reference(ckpt)
    shm_before = {f for f in os.listdir(SHM_DIR) if f.startswith(FILE_PREFIX)}
    server = Server(ckpt, free_port(), tmp_path / "server.log",
                    ["--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "1", *LIMITS],
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "DEEPINFER_ENGRAM_DEVICE": "host"})
    try:
        server.wait_ready(timeout=600)
        _same(_complete(server, PROMPTS[1]), want[1])  # one rank busy, the other on dummy batches
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _complete(server, p), PROMPTS))
    finally:
        server.stop()
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    log = server.log.read_text()
    placement = re.findall(r"\[EP Rank (\d)/2\] Expert parallelism is enabled.*?Local/global number of experts: "
                           r"(\d+)/(\d+)\. Experts local to global index map: ([0-9>, -]+)\.", log)
    assert sorted(placement) == [("0", "4", "8", "0->0, 1->1, 2->2, 3->3"), ("1", "4", "8", "0->4, 1->5, 2->6, 3->7")]
    assert log.count("Using allgather_reducescatter all2all manager") == 2
    if arch == "v4.1-flash":  # one table copy for both DP ranks, loaded by the first; nothing left in /dev/shm
        shared = re.findall(rf"Engram tables: .* one node-shared copy, ({SHM_DIR}/{FILE_PREFIX}\w+) \(2 ranks\), "
                            r"written by (this rank|the node's first rank)", log)
        assert len(shared) == 2 and shared[0][0] == shared[1][0], shared
        assert sorted(w for _, w in shared) == ["the node's first rank", "this rank"]
    assert {f for f in os.listdir(SHM_DIR) if f.startswith(FILE_PREFIX)} == shm_before


def test_dp2_bounded_replay_chunked_matches_one_process(ckpt_root, tmp_path):
    """V4.1 bounded replay under DP+EP, prompts of several 256-token chunks: the layers past the cut run on
    different row counts on the two ranks (per-layer DP sizes, agreed once per step), an early chunk leaves
    a rank with no rows past some layer while the other rank still has rows (its FFNs join the MoE
    collectives with none), and concurrent early chunks leave both ranks with none at once."""
    ckpt = tiny_checkpoint(ckpt_root, "v4.1-flash")
    prompts = [[5 + (7 * i + n) % 500 for i in range(n)] for n in (600, 700, 90)]
    want = _reference(ckpt, prompts, chunk=256)
    limits = [*LIMITS[:2], "--max-num-batched-tokens", "256", *LIMITS[4:]]
    server = Server(ckpt, free_port(), tmp_path / "server.log",
                    ["--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "1", *limits],
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "DEEPINFER_ENGRAM_DEVICE": "host"})
    try:
        server.wait_ready(timeout=600)
        # the repeat of prompts[0] below is a 512-token prefix hit rewound by the keep (382): its tail's
        # past-cut window rows need real blocks (`patches/replay_window_manager.py`; before it: 2.8e-4 off)
        _same(_complete(server, prompts[0]), want[0], 1e-4)  # the other rank on dummy batches
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _complete(server, p), prompts))
    finally:
        server.stop()
    for g, w in zip(got, want, strict=True):
        _same(g, w, 1e-4)
    assert "bounded replay: layers 6..9 run on each prompt's last 382/255/128/1 tokens" in server.log.read_text()


@pytest.mark.parametrize("arch,method", [("v4-flash", "mtp"), ("v4.1-flash", "dspark")])
def test_dp2_ep2_speculation_matches_one_process(ckpt_root, tmp_path, arch, method):
    """The drafter's MoE under DP + EP (V4's MTP block, V4.1's DSpark stages; checkpoints whose drafter reproduces
    the target): greedy tokens with speculation on both ranks equal one process without speculation, drafts are
    accepted (/metrics), and every rank places the drafter's experts beside the target's."""
    ckpt = tiny_checkpoint(ckpt_root, arch, drafter="reproduce")
    want = _reference(ckpt)
    spec = f'{{"method": "{method}", "num_speculative_tokens": 3}}'
    server = Server(ckpt, free_port(), tmp_path / "server.log",
                    ["--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "1",
                     "--speculative-config", spec, *LIMITS],
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "DEEPINFER_ENGRAM_DEVICE": "host"})
    try:
        server.wait_ready(timeout=600)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _complete(server, p), PROMPTS))
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    accepted = sum(float(v) for v in re.findall(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$",
                                                 metrics, re.M))
    assert accepted > 0, "no draft accepted"
    drafters = re.findall(rf"vllm-deepinfer {'MTP' if method == 'mtp' else 'DSpark'} drafter: .*?(\d+)/(\d+) routed "
                          r"experts on this rank", server.log.read_text())
    assert len(drafters) == 2 and all(2 * int(local) == int(total) for local, total in drafters), drafters


def test_offline_llm_data_parallel_refused(ckpt_root):
    from vllm import LLM

    refusal = ("LLM(data_parallel_size=2) is not supported for single-process usage and may hang. Please use the "
               "explicit multi-process data-parallel example at "
               "'examples/features/data_parallel/data_parallel_offline.py'.")
    with pytest.raises(ValueError, match=re.escape(refusal)):
        LLM(model=str(tiny_checkpoint(ckpt_root, "v4.1-flash")), data_parallel_size=2)


def _collectives_worker(rank: int, port: int, failures) -> None:
    """One gloo rank of `test_cpu_gatherv_exact`: vLLM's CpuCommunicator with the patch, against local math."""
    import os

    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    from vllm_deepinfer.patches import cpu_gatherv

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cpu_gatherv.apply()
        comm = CpuCommunicator(dist.group.WORLD, device_group=dist.group.WORLD, unique_name="dp:0")

        def rows(r: int, n: int, dtype: torch.dtype) -> torch.Tensor:  # rank r's [n, 3] input
            g = torch.Generator().manual_seed(100 * r + n)
            return (torch.randn(n, 3, generator=g) * 1e3).to(dtype)

        for sizes in ([3, 0], [0, 2], [0, 0], [2, 5], [4, 4], None):
            counts = sizes or [4, 4]
            for dtype in (torch.float32, torch.int32):
                mine = rows(rank, counts[rank], dtype)
                want = torch.cat([rows(r, n, dtype) for r, n in enumerate(counts)])
                got = comm.all_gatherv([mine, mine[:, :1]], dim=0, sizes=sizes)
                assert torch.equal(got[0], want) and torch.equal(got[1], want[:, :1]), (sizes, dtype)
            full = [rows(r, sum(counts), torch.float32) for r in range(2)]
            start = sum(counts[:rank])
            want = (full[0] + full[1])[start: start + counts[rank]]
            assert torch.equal(comm.reduce_scatterv(full[rank], dim=0, sizes=sizes), want), sizes
            assert torch.equal(comm.reduce_scatterv(full[rank].t(), dim=1, sizes=sizes), want.t()), sizes
    except Exception as e:  # reported to the parent, which fails the test
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def test_cpu_gatherv_exact():
    """The patched all_gatherv / reduce_scatterv on two gloo ranks: uneven and empty shares, lists, int ids."""
    run_ranks(_collectives_worker)
