"""Per-user decode speed with speculation off / fixed / varlen, MTP (V4) or DSpark (V4.1) (issue 11). UNTESTED on a
GPU; on CPU `--device-smoke` (eager, fp32) is the smoke mode. The H200 numbers are the lead's to take.

    python3 benchmarks/bench_spec_decode.py --model CKPT --out $OUT/spec [--k 5] [--batches 1,8,32] [--intree]

CKPT: a V4-Flash or V4.1-Flash checkpoint, e.g. the drafters of known quality
`python -m vllm_deepinfer.tools.make_checkpoint --arch v4.1-flash --preset tiny-gpu --drafter reproduce --out DIR`
(`--drafter noise` for the other end). The method follows the checkpoint (`serving.settings.draft_method`:
dspark on V4.1, mtp on V4). Each mode runs in its own subprocess (one engine each): off (no speculative config,
vLLM's default scheduling), fixed (`{"method": M, "num_speculative_tokens": K}`), varlen (the same with
DEEPINFER_ENABLE_MTP_VARLEN=1 and synchronous scheduling, which it needs); `--intree` adds vLLM's in-tree model
(DEEPINFER_DISABLE=1) fixed, and for DSpark its adaptive verification (`enable_adaptive_verification`, V2 runner);
`--modes ...,fixed-v2` adds ours fixed with VLLM_DEEPINFER_DSPARK_V2=1 (DSpark under vLLM's V2 speculator),
`varlen-v2` ours with VLLM_DEEPINFER_DSPARK_V2=1 and DEEPINFER_ENABLE_MTP_VARLEN=1 (vLLM's adaptive verification
on V2, vLLM's default scheduling).
For each batch size B: B random prompts of --prompt-len tokens, greedy, --new-tokens each (ignore_eos), as
`generate` calls after a warm-up call (prefix caching off, so all do the same work); per-user tok/s = new tokens /
the median wall time of --reps calls; plus vLLM's spec-decode counters (acceptance rate, mean accepted length,
per-position acceptance) over the timed calls; with DSpark's cold drafter also the proposals and how many skipped
their block, and on V2 the drafts the budget verified (vLLM's V2 counters count the scheduled ones, so
`mean_verified` and `acceptance` are recomputed from it there). `--host-profile`: the engine runs in-process and one more batch-1 call (after the timed ones, so
the numbers are unaffected) is cProfiled: the top functions by own time and by cumulative time per mode, to see
where a host-bound speculative step goes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import statistics
import sys
import time
from pathlib import Path

import engine_info  # benchmarks/ is on sys.path: the scripts run as files


def run_mode(args: argparse.Namespace) -> dict:
    """One engine (this process): per batch size, per-user tok/s and spec-decode counters."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_deepinfer.serving.settings import draft_method

    method = draft_method(args.model)
    kw = dict(model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 64,
              max_num_seqs=max(args.batches), gpu_memory_utilization=args.gpu_util, seed=0, disable_log_stats=False,
              enforce_eager=args.device_smoke, enable_prefix_caching=False)  # timed call == warm-up's work
    if args.no_jit_warmup:  # in-tree's JIT warm-up alone outlasted a 265 s cap on a fresh host (2026-12-02)
        kw["kernel_config"] = {"enable_jit_warmup": False, "enable_flashinfer_autotune": False}
    if args.mode != "off":
        kw["speculative_config"] = {"method": method, "num_speculative_tokens": args.k}
    if args.mode == "varlen":
        kw["async_scheduling"] = False
    if args.mode == "intree-varlen":
        kw["speculative_config"]["enable_adaptive_verification"] = True
    if args.mode.startswith("intree") and method == "dspark":
        kw["limit_mm_per_prompt"] = {"image": 0}  # in-tree V4.1 with the synthetic tokenizer
    llm = LLM(**kw)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def counters() -> dict:
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_"):
                out[m.name.removeprefix("vllm:spec_decode_")] = list(m.values) if hasattr(m, "values") else m.value
        return out

    def cold() -> list | None:
        try:
            return llm.collective_rpc(_cold_counts)[0]
        except Exception as e:  # noqa: BLE001 (a worker without the plugin: no counts, the timing still counts)
            print(f"cold-drafter counts unavailable: {e}", file=sys.stderr)
            return None

    results = []
    for b in args.batches:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 8000) for _ in range(args.prompt_len)])
                   for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        before, cold_before = counters(), cold()
        walls = []
        for _ in range(args.reps):  # the median: one call of 128 tokens lasts 0.2-0.7 s, single calls are noisy
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - t)
        wall = statistics.median(walls)
        after = counters()
        d = {k: ([x - y for x, y in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0))
             for k, v in after.items()}
        row = {"batch": b, "wall_s": wall, "walls_s": walls, "per_user_tok_s": args.new_tokens / wall}
        if d.get("num_draft_tokens"):
            row.update(acceptance=d["num_accepted_tokens"] / d["num_draft_tokens"],
                       mean_accepted=d["num_accepted_tokens"] / d["num_drafts"],
                       per_position=[x / d["num_drafts"] for x in d["num_accepted_tokens_per_pos"]],
                       mean_verified=d["num_draft_tokens"] / d["num_drafts"])
        cold_after = cold()
        if cold_before is not None and cold_after is not None:  # DSpark's cold drafter (`schedule.ColdDrafter`)
            row.update(proposals=cold_after[0] - cold_before[0], skipped=cold_after[1] - cold_before[1])
            if cold_after[2] is not None:  # V2: the drafts the budget verified (vLLM counts the scheduled ones)
                verified = cold_after[2] - cold_before[2]
                row.update(verified_drafts=verified)
                if d.get("num_drafts"):
                    row.update(mean_verified=verified / d["num_drafts"],
                               acceptance=d["num_accepted_tokens"] / verified if verified else None)
        results.append(row)
        print(json.dumps({"mode": args.mode, "row": row}), flush=True)
    if args.host_profile:
        host_profile(llm, args, rng, params)
    return {"mode": args.mode, "method": method, "k": args.k, "model": args.model, "results": results}


def _cold_counts(worker) -> list | None:
    """On a worker: DSpark's cold-drafter counts [proposals, skipped, drafts verified (V2 only, else None)], or None
    where no cold drafter runs (`llm.collective_rpc`)."""
    from vllm_deepinfer.patches import cold_drafter_v2

    state = cold_drafter_v2.newest()
    if state is not None:
        return [state.rule.proposals, state.rule.skipped, state.verified]
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    policy = getattr(getattr(drafter, "model", None), "draft_policy", None)
    cold = getattr(policy, "cold", None)
    return None if cold is None else [cold.proposals, cold.skipped, None]


def host_profile(llm, args: argparse.Namespace, rng, params) -> None:
    """cProfile one batch-1 generate call of --new-tokens (after one unprofiled warm call)."""
    from vllm.inputs import TokensPrompt

    prompt = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 8000) for _ in range(args.prompt_len)])]
    llm.generate(prompt, params, use_tqdm=False)
    engine_info.host_profile(lambda: llm.generate(prompt, params, use_tqdm=False),
                             f"{args.mode}, batch 1, {args.new_tokens} tokens")


def run_child(mode: str, args: argparse.Namespace, out: Path) -> dict:
    """One mode in its own process group, at most --mode-timeout s; the rows it printed count even if it is killed."""
    # VLLM_ALLOW_INSECURE_SERIALIZATION: `collective_rpc` sends `_cold_counts` (a function) to this local engine
    env = dict(os.environ, DEEPINFER_ENABLE_MTP_VARLEN="1" if mode in ("varlen", "varlen-v2") else "0",
               VLLM_DEEPINFER_DSPARK_V2="1" if mode.endswith("-v2") else "0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if mode.startswith("intree"):
        env["DEEPINFER_DISABLE"] = "1"
    if args.host_profile:  # the engine core in this process, where cProfile sees it
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    argv = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
    log = out / f"{mode}.log"
    error = None
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.mode_timeout)
            error = f"failed (rc {rc}), see {log}" if rc else None
        except subprocess.TimeoutExpired:  # the engine core is a grandchild: kill the whole group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            error = f"killed after {args.mode_timeout:.0f} s, see {log}"
    lines = log.read_text(errors="replace").splitlines()
    final = [l for l in lines if l.startswith("RESULT ")]
    if final and not error:
        return json.loads(final[-1][len("RESULT "):])
    rows = [json.loads(l)["row"] for l in lines if l.startswith('{"mode"')]
    print(f"{mode}: {error}", file=sys.stderr)
    return {"mode": mode, "k": args.k, "model": args.model, "results": rows, "error": error}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens (DeepInfer default 5)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3, help="timed generate calls per batch size (the median is reported)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-util", type=float, default=0.85)
    p.add_argument("--intree", action="store_true",
                   help="also vLLM's in-tree model (DEEPINFER_DISABLE=1): fixed, and adaptive verification for DSpark")
    p.add_argument("--modes", type=lambda s: s.split(","), help="comma list of modes (default: all that apply)")
    p.add_argument("--mode-timeout", type=float, default=240, help="seconds per mode (engine start included)")
    p.add_argument("--no-jit-warmup", action="store_true", help="kernel_config: no JIT warm-up / FlashInfer autotune")
    p.add_argument("--host-profile", action="store_true",
                   help="in-process engines; cProfile one extra batch-1 call per mode (printed in the mode's log)")
    p.add_argument("--device-smoke", action="store_true", help="CPU smoke run: eager, fp32, small sizes")
    p.add_argument("--mode", choices=["off", "fixed", "fixed-v2", "varlen", "varlen-v2", "intree", "intree-varlen"],
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device_smoke:
        args.dtype, args.gpu_util = "float32", 0.2
    if args.mode:  # child
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from vllm_deepinfer.serving.settings import draft_method

    intree = ["intree"] + (["intree-varlen"] if draft_method(args.model) == "dspark" else [])
    modes = args.modes or ["off", "fixed", "varlen"] + (intree if args.intree else [])
    summary = []
    for mode in modes:
        summary.append(run_child(mode, args, out))
        (out / "spec_decode.json").write_text(json.dumps(summary, indent=2) + "\n")  # kept if a later mode hangs
    base = {r["batch"]: r["per_user_tok_s"] for s in summary if s["mode"] == "off" for r in s["results"]}
    print(f"{'mode':13} {'batch':>5} {'tok/s/user':>11} {'vs off':>7} {'accept':>7} {'verified':>8} {'skipped':>11}")
    nan = float("nan")
    for s in summary:
        if s.get("error"):
            print(f"{s['mode']:13} {s['error']}")
        for r in s["results"]:
            ratio = r["per_user_tok_s"] / base[r["batch"]] if r["batch"] in base else nan
            accept, verified = (nan if r.get(k) is None else r[k] for k in ("acceptance", "mean_verified"))
            skipped = f"{r['skipped']}/{r['proposals']}" if "skipped" in r else "-"
            print(f"{s['mode']:13} {r['batch']:>5} {r['per_user_tok_s']:>11.1f} {ratio:>7.2f} {accept:>7.2f} "
                  f"{verified:>8.2f} {skipped:>11}")


if __name__ == "__main__":
    main()
