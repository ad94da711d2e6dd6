"""Speculative decoding on a CUDA GPU (issue 11): greedy tokens with speculation equal those without, with CUDA
graphs on (verification steps replay full graphs, trimmed ones included).

On the memorised-head tiny-gpu checkpoints that `benchmarks/gpu_session.sh` builds (`.gpuwork/ckpt-v41m`,
`.gpuwork/ckpt-v4m`; `DEEPINFER_GPU_WORK` names another folder): their greedy continuations of the fidelity
prompts win by several nats, so the bf16 numerics of a 4-token verification step and of a 1-token decode step
cannot split them, and a difference is a real error. The drafters are the checkpoints' own (random) heads:
acceptance is low, losslessness is the point. The CPU suite proves the same in fp32 (`tests/test_spec_decode.py`,
`tests/test_dspark.py`).

    PYTHONPATH=$PWD python3 -m pytest -q -s tests/gpu/test_spec_decode_gpu.py
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import engine, model_runner

WORK = Path(os.environ.get("DEEPINFER_GPU_WORK", ".gpuwork"))
K = 3

pytestmark = pytest.mark.gpu


def _ckpt(name: str) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = WORK / name
    if not path.is_dir() or not (WORK / "prompts.json").is_file():
        pytest.skip(f"{path} or its prompts.json is missing (benchmarks/gpu_session.sh make_checkpoints builds them)")
    return path


def _generate(ckpt: Path, spec: dict | None = None, setup: Callable | None = None,
              **overrides) -> tuple[list[list[int]], str, int, int, int, str]:
    """Greedy 64 tokens for the 37/300/1000-token fidelity prompts in one batch -> (tokens, the engine's
    cudagraph mode, draft tokens vLLM counted, draft-step graphs DSpark's proposer captured, trimmed
    verification steps that replayed a full graph, the model runner's module). `setup(llm)` runs before."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads((WORK / "prompts.json").read_text())
    kw = dict(dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.3, max_model_len=1100,
              max_num_batched_tokens=2048, max_num_seqs=8, disable_log_stats=False, **overrides)
    if spec is not None:
        kw["speculative_config"] = spec
    with engine(ckpt, **kw) as llm:
        mode = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
        if setup is not None:
            setup(llm)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.values()],
                            SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        drafts = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")
        drafter = getattr(model_runner(llm), "drafter", None)
        fixed = getattr(drafter, "fixed_steps", None)
        graphs = 0 if fixed is None else len(fixed.graphs)
        trimmed = getattr(model_runner(llm), "deepinfer_trimmed_graph_steps", 0)
        runner = type(model_runner(llm)).__module__
    return [list(o.outputs[0].token_ids) for o in outs], mode, drafts, graphs, trimmed, runner


_PLAIN: dict[str, list[list[int]]] = {}


def _plain(ckpt: Path) -> list[list[int]]:
    """Greedy tokens without speculation, one engine per checkpoint for the whole module."""
    if ckpt.name not in _PLAIN:
        _PLAIN[ckpt.name] = _generate(ckpt)[0]
    return _PLAIN[ckpt.name]


@pytest.mark.parametrize("name,method", [("ckpt-v41m", "dspark"), ("ckpt-v4m", "mtp")])
def test_greedy_speculation_equals_none_with_cuda_graphs(name, method):
    ckpt = _ckpt(name)
    ref = _plain(ckpt)
    got, mode, drafts, graphs, _, _ = _generate(ckpt, {"method": method, "num_speculative_tokens": K})
    print(f"\n{name} {method} K={K}: cudagraph_mode {mode}, {drafts} draft tokens, {graphs} draft-step graphs")
    assert "NONE" not in mode, f"speculation turned CUDA graphs off ({mode})"
    assert drafts > 0
    if method == "dspark":  # decode and verification steps replay the proposer's graphs (spec_decode/draft_graphs.py)
        assert graphs > 0
    assert got == ref


@pytest.mark.parametrize("name,method", [("ckpt-v4m", "mtp"), ("ckpt-v41m", "dspark")])
def test_varlen_equals_none(monkeypatch, name, method):
    """Varlen on the V1 runner (synchronous scheduling): verification steps whose drafts were trimmed replay full
    graphs too (`patches/varlen_graphs.py`: plain-decode keys, smallest key that holds the step); the tokens stay
    those of plain decode."""
    ckpt = _ckpt(name)
    ref = _plain(ckpt)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    got, mode, _, _, trimmed, _ = _generate(ckpt, {"method": method, "num_speculative_tokens": K},
                                            async_scheduling=False)
    print(f"\n{name} {method} varlen K={K}: cudagraph_mode {mode}, {trimmed} trimmed steps on full graphs")
    assert trimmed > 0, "no trimmed verification step replayed a graph"
    assert got == ref


def test_dspark_on_v2_equals_none(monkeypatch):
    """`VLLM_DEEPINFER_DSPARK_V2=1`: vLLM's V2 runner and its own DSpark speculator drive our drafter (context KV
    by slot ids, block forward, Markov and confidence heads; `spec_decode/dspark.py`) on the target's aux hidden
    states (`DeepseekV41ForCausalLM.set_aux_hidden_state_layers`), fixed length, CUDA graphs: the tokens stay those
    of plain decode."""
    ckpt = _ckpt("ckpt-v41m")
    ref = _plain(ckpt)
    monkeypatch.setenv("VLLM_DEEPINFER_DSPARK_V2", "1")
    got, mode, drafts, _, _, runner = _generate(ckpt, {"method": "dspark", "num_speculative_tokens": K})
    print(f"\nckpt-v41m dspark on V2 K={K}: runner {runner}, cudagraph_mode {mode}, {drafts} draft tokens")
    assert runner.startswith("vllm.v1.worker.gpu.") and drafts > 0
    assert got == ref


def test_dspark_varlen_on_v2_equals_none(monkeypatch):
    """`VLLM_DEEPINFER_DSPARK_V2=1` + `DEEPINFER_ENABLE_MTP_VARLEN=1`: vLLM's V2 runner with its own adaptive
    verification (`patches/speculative_settings.py` sets `enable_adaptive_verification`): drafts trimmed on the
    device, host query offsets an even split of the draft budget (`models/step.py` reads the device ones), varlen
    decode graphs, costs profiled at start-up. The tiny model's verification cost is flat, so the profiled costs
    would verify every draft: the test sets a verify cost that jumps past 7 tokens (3 requests: 1 + 4 drafts of 9
    in a decode step), so decode steps split the drafts unevenly. The tokens stay those of plain decode."""
    ckpt = _ckpt("ckpt-v41m")
    ref = _plain(ckpt)
    monkeypatch.setenv("VLLM_DEEPINFER_DSPARK_V2", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setenv("VLLM_DEEPINFER_COLD_DRAFTER", "0")  # every budget here fits the graph padding (test below)
    seen = {"adaptive": False, "split": 0, "mixed_split": 0}

    def steep_verify_cost_and_count_splits(llm) -> None:
        runner = model_runner(llm)
        manager = getattr(runner, "adaptive_verification", None)
        spec = llm.llm_engine.vllm_config.speculative_config
        seen["adaptive"] = manager is not None and spec.enable_adaptive_verification
        if manager is None:
            return
        manager.set_cost_curves([(1, 0.0), (8, 0.0)], [(7, 1.0), (8, 1000.0)])
        prepare = runner.model_state.prepare_attn

        def counting(input_batch, *args, **kwargs):  # host vs device offsets of every real step (one sync each)
            host = input_batch.query_start_loc_np
            if not (input_batch.query_start_loc[: len(host)].cpu().numpy() == host).all():
                seen["split"] += 1
                seen["mixed_split"] += bool(input_batch.has_prefill)
            return prepare(input_batch, *args, **kwargs)

        runner.model_state.prepare_attn = counting

    got, mode, drafts, _, _, runner = _generate(ckpt, {"method": "dspark", "num_speculative_tokens": K},
                                                setup=steep_verify_cost_and_count_splits)
    print(f"\nckpt-v41m dspark varlen on V2 K={K}: runner {runner}, cudagraph_mode {mode}, {drafts} draft tokens, "
          f"{seen['split']} steps with split host offsets ({seen['mixed_split']} with a prefill)")
    assert runner.startswith("vllm.v1.worker.gpu.") and seen["adaptive"] and drafts > 0
    assert seen["split"] > 0, "no step ran with host offsets other than the device ones"
    assert got == ref


def test_cold_drafter_on_v2_equals_none(monkeypatch):
    """Adaptive verification on V2 with a verify cost that no draft pays (the step cost jumps past one token):
    after four unpaid blocks vLLM's DSpark speculator skips the block (`patches/cold_drafter_v2.py`: context rows
    only, replayed as a CUDA graph, budget 0), probing it now and then; the tokens stay those of plain decode."""
    from vllm_deepinfer.patches import cold_drafter_v2

    ckpt = _ckpt("ckpt-v41m")
    ref = _plain(ckpt)
    monkeypatch.setenv("VLLM_DEEPINFER_DSPARK_V2", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    seen = {}

    def no_draft_pays(llm) -> None:
        manager = model_runner(llm).adaptive_verification
        seen["adaptive"] = manager is not None
        if manager is not None:
            manager.set_cost_curves([(1, 0.0), (8, 0.0)], [(1, 1.0), (2, 1000.0)])

    got, mode, drafts, _, _, runner = _generate(ckpt, {"method": "dspark", "num_speculative_tokens": K},
                                                setup=no_draft_pays)
    state = cold_drafter_v2.newest()
    skipped, replays = state.rule.skipped, state.context.replays
    print(f"\nckpt-v41m dspark cold drafter on V2 K={K}: runner {runner}, cudagraph_mode {mode}, {skipped} proposals "
          f"skipped, {replays} context writes replayed as graphs")
    assert runner.startswith("vllm.v1.worker.gpu.") and seen["adaptive"]
    assert skipped > 20  # 64 decode steps: 4 unpaid, then probes after 4, 8, 16, 32 skipped proposals
    assert replays >= skipped - 2  # the first skipped step of the batch size runs eagerly, then its graph
    assert got == ref


def test_cold_drafter_context_rows_on_v2(monkeypatch, tmp_path):
    """The context rows a skipped V2 proposal stores (its own slots and graph, not vLLM's propose) are the rows the
    next blocks read: with a drafter that reproduces the target (`make_checkpoint --drafter reproduce`) and two of
    every six proposals forced to skip, the drafts verified afterwards are still accepted (a wrong row in the
    window would turn them into noise). Acceptance is counted against the drafts the budget verified
    (`cold_drafter_v2.ColdState.verified`): vLLM's V2 counters count the scheduled ones."""
    import subprocess
    import sys

    from vllm_deepinfer.patches import cold_drafter_v2
    from vllm_deepinfer.spec_decode.schedule import ColdDrafter

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ckpt = tmp_path / "v41-reproduce"
    subprocess.run([sys.executable, "-m", "vllm_deepinfer.tools.make_checkpoint", "--arch", "v4.1-flash", "--preset",
                    "tiny-gpu", "--drafter", "reproduce", "--out", str(ckpt)], check=True, capture_output=True)
    monkeypatch.setenv("VLLM_DEEPINFER_DSPARK_V2", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")

    def pattern(self) -> str:  # proposals 0, 1 of every 6 skip; the rest run (outcomes ignored)
        self.proposals += 1
        if self.proposals % 6 in (1, 2):
            self.skipped += 1
            return ColdDrafter.SKIP
        return ColdDrafter.RUN

    monkeypatch.setattr(ColdDrafter, "step", pattern)
    monkeypatch.setattr(ColdDrafter, "paid", lambda self, kind, any_paid: None)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(range(100 + 7 * i, 140 + 7 * i))) for i in range(3)]
    with engine(ckpt, dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.3, max_model_len=512,
                max_num_seqs=8, disable_log_stats=False, speculative_config={"method": "dspark",
                                                                          "num_speculative_tokens": K}) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True), use_tqdm=False)
        accepted = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")
    state = cold_drafter_v2.newest()
    print(f"\nreproducing drafter on V2, 2 of 6 proposals skipped: {state.rule.skipped} skipped, {state.verified} "
          f"drafts verified, {accepted} accepted, {state.context.replays} context writes replayed")
    assert state.rule.skipped > 10 and state.verified > 30
    assert accepted >= 0.9 * state.verified
