"""End-to-end throughput in vLLM: the DeepInfer plugin ("ours") vs vLLM's in-tree DeepSeek-V4.1 / V4 ("intree").

The deciding protocol (the defaults; one H200, vLLM 0.32 + plugin staged as in NOTES.md; about 8 min with two
engine starts and --no-jit-warmup):

    python3 benchmarks/bench_e2e.py --out $OUT/bench_e2e --no-jit-warmup

  = V4.1-Flash at release widths (hidden 5120, 64 heads x 512, LoRA ranks, expert width 2304, index heads), 8
    layers keeping the release layer plan's encoder/decoder split (printed: layers before / after the ratio-1 KV
    source), 384 routed experts top-6 (drafter 128 top-3 in the config), the 8192-token synthetic vocabulary,
    dummy weights, bf16, CUDA-graph capture sizes 1,16,64,256, the same KV budget in bytes for both sides
    (kv_cache_memory_bytes = --kv-gib, default 24 GiB), prefix caching off; both sides hold the same weight
    formats: ours with DEEPINFER_FP8_LINEARS=packed DEEPINFER_EXPERT_STORAGE=packed (--storage), in-tree with the
    config's quantization_config (FP8 block linears, MXFP4 experts). Each implementation in its own subprocess,
    one after the other; in-tree with DEEPINFER_DISABLE=1. Eager: --enforce-eager. One side: --only ours|intree.

Batch-invariant cost (issue 12): --invariant compares the plugin with DEEPINFER_BATCH_INVARIANT=1 ("invariant")
against the plugin's default ("ours"), same protocol; the ratio column is invariant/ours (goal >= 0.9):

    python3 benchmarks/bench_e2e.py --invariant --decode-batches 1,16,64 --out $OUT/bench_invariant --no-jit-warmup
    V4-Flash: --arch v4-flash (256 experts top-6). Other configs: --layers, --set key=JSON (make_checkpoint).

CPU smoke test (no GPU; tiny widths, same protocol structure, small sizes; ~2-3 min):

    python benchmarks/bench_e2e.py --device-smoke --only ours --out /tmp/bench_e2e_smoke

What is measured (warm-up runs excluded):
  prefill   for each N in --prefill-tokens (1k/4k/16k): N // P prompts of P = min(N, --prompt-len) random ids as
            one `llm.generate` with max_tokens=1 (token budget max_num_batched_tokens >= N, so one scheduler
            step). Reported: input tok/s = N / median wall time of --reps calls.
  decode    for each B in --decode-batches (1/16/64/256): B prompts of --decode-prompt-len ids added to the
            engine at once (`LLMEngine.add_request`), then `step()` until all finish, timing every step. Steady
            steps are those where every request had its first token before the step (all prefills done), every
            request got a token in it and none finished: output tok/s = B / median steady step time (also p10/p90
            and the number of steady steps). No difference of two totals: prefill never enters the number.
  profile   (--profile; both sides) torch.profiler top ops of one prefill call and of the decode steps at
            --profile-batch ((T(D) call - T(1) call) per op / (D - 1)); runs the engines in-process.
  engine    vLLM's own log lines of each side (model loading GiB, KV cache size / concurrency, KV group sizes),
            and for ours the memory planner's numbers for the same model dir and KV budget
            (`vllm_deepinfer.tools.plan`), so planner and engine can be compared on the device.

Output: a table (ours, intree, ratio ours/intree) on stdout, `results.json` + one `<impl>.json` and `<impl>.log`
per implementation under --out (default $OUT/bench_e2e, else ./bench_e2e_out). The model directory (config.json,
generation_config.json, tokenizer; no weights) is written once under --out/model-<arch>-<preset> from
`vllm_deepinfer.tools.make_checkpoint.build_config` + `checkpoint.tokenizer.write_tokenizer`, or given with --model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine_info import describe, host_profile  # benchmarks/ is on sys.path: the scripts run as files

HERE = Path(__file__).resolve()


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def _dump(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# ============================================================================ model directory (no weights)
def write_model_dir(arch: str, preset: str, out: Path, layers: int | None = None, overrides: dict | None = None) -> Path:
    """config.json + generation_config.json + tokenizer files exactly as make_checkpoint writes them, no tensors."""
    from vllm_deepinfer.checkpoint import engram_hash
    from vllm_deepinfer.checkpoint.tokenizer import write_tokenizer
    from vllm_deepinfer.tools.make_checkpoint import (
        _family,
        _generation_config,
        build_config,
    )

    fam = _family(arch)
    out.mkdir(parents=True, exist_ok=True)
    info = write_tokenizer(out, fam)
    cfg = build_config(arch, preset, layers, tokenizer_info=info, overrides=overrides)
    if fam == "v41" and cfg["text_config"].get("engram_layer_ids"):
        from tokenizers import Tokenizer

        cvs = engram_hash.compressed_vocab_size(Tokenizer.from_file(str(out / "tokenizer.json")))
        cfg = build_config(arch, preset, layers, tokenizer_info=info, compressed_vocab=cvs, overrides=overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(), indent=2) + "\n")
    return out


#: Expert counts of the deciding protocol (release values), applied before --set.
PROTOCOL_EXPERTS = {
    "v4.1-flash": {"n_routed_experts": 384, "num_experts_per_tok": 6, "dspark_n_routed_experts": 128,
                   "dspark_num_experts_per_tok": 3},
    "v4-flash": {"n_routed_experts": 256, "num_experts_per_tok": 6},
}


def _parse_set(arch: str, items) -> dict:
    from vllm_deepinfer.tools.make_checkpoint import _parse_set as parse

    return {**PROTOCOL_EXPERTS[arch], **(parse(items) if items else {})}


def layer_split(model: Path) -> list[str]:
    """The layer plan of the model dir, one line per layer, and where the encoder/decoder cut lies (V4.1: the
    ratio-1 KV source, from which every later layer reads its compressed KV)."""
    from vllm_deepinfer.config import V41, ArchConfig

    arch = ArchConfig.from_hf(json.loads((model / "config.json").read_text()))
    cut = next((l for l in arch.kv_source_layer_ids if arch.compress_ratios[l] == 1), None)
    lines = [f"layer plan ({arch.family}, {arch.num_layers} layers, {arch.n_routed_experts} experts "
             f"top-{arch.num_experts_per_tok}):"]
    for l in range(arch.num_layers):
        p = arch.layer_plan(l)
        side = "" if arch.family != V41 or cut is None else ("decoder" if l >= cut else "encoder")
        roles = [f"m={p.ratio}"] + (["KV source"] if p.owns_compressor else [f"KV of {p.kv_source}"] if p.compressed
                                    else []) + (["index source"] if p.owns_indexer else []) \
            + (["candidates"] if p.candidate_source else []) + ([f"Engram {p.engram_table}"]
                                                                if p.engram_table is not None else [])
        lines.append(f"  {l:2d} {side:8s}" + ", ".join(roles))
    if cut is not None:
        lines.append(f"  cut: layers 0-{cut - 1} encoder, {cut}-{arch.num_layers - 1} decoder (read layer {cut}'s "
                     "ratio-1 KV)")
    return lines


#: vLLM log lines that state what the engine holds (weights, KV cache).
ENGINE_LINES = ("Model loading took", "KV cache size", "Available KV cache memory", "kv cache group sizes",
                "Maximum concurrency", "KV cache memory")


def planner_lines(model: Path, a) -> list[str]:
    """The memory planner's numbers for ours on this model dir (storage from --storage)."""
    from vllm_deepinfer.tools import plan

    import torch

    packed = "packed" if a.storage in ("packed", "auto") else "bf16"
    linears = "marlin" if packed == "packed" and torch.cuda.is_available() else packed  # CUDA: Marlin's layout
    args = ["--model-config", str(model), "--fp8-linears", linears, "--experts", packed, "--engram", "gpu",
            "--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--batch", "1",
            "--max-num-batched-tokens", str(a.token_budget), "--no-prefix-caching", "--kv-cache-dtype", a.kv_cache_dtype]
    kv = a.kv_gib or float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 0)  # CPU: vLLM's KV space in GiB
    args += ["--kv-gib", str(kv)] if kv else []
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        plan.main(args)
    return ["planner (python -m vllm_deepinfer.tools.plan " + " ".join(args) + "):"] + [
        "  " + x for x in buf.getvalue().splitlines() if x.strip()]


# ============================================================================ worker (one engine, one process)
def worker(a) -> None:
    if a.impl == "intree":
        os.environ["DEEPINFER_DISABLE"] = "1"
    else:
        os.environ.pop("DEEPINFER_DISABLE", None)
    if a.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prefill_ns, decode_bs = _ints(a.prefill_tokens), _ints(a.decode_batches)
    res = {"impl": a.impl, "model": a.model, "dtype": a.dtype, "vllm": vllm.__version__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "env": {k: v for k, v in os.environ.items() if k.startswith(("DEEPINFER", "VLLM_", "KERNELS_"))},
           "prefill": {}, "decode": {}}
    out = Path(a.result)
    max_seqs = max(decode_bs + [max(1, n // min(n, a.prompt_len)) for n in prefill_ns])
    budget = a.token_budget  # every prefill call and every decode batch's prompts fit one scheduler step
    kwargs = dict(model=a.model, load_format="dummy", dtype=a.dtype, enforce_eager=a.enforce_eager,
                  max_model_len=a.max_model_len, max_num_batched_tokens=budget, max_num_seqs=max_seqs, seed=0,
                  enable_prefix_caching=False, gpu_memory_utilization=a.gpu_mem, trust_remote_code=False,
                  limit_mm_per_prompt={"image": 0})  # text only: vLLM's V4.1 mm profiling hard-codes id 129264
    if a.kv_gib:
        kwargs["kv_cache_memory_bytes"] = int(a.kv_gib * 2**30)
    if a.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = a.kv_cache_dtype
    if a.no_jit_warmup:
        kwargs["kernel_config"] = {"enable_jit_warmup": False, "enable_flashinfer_autotune": False}
    if not a.enforce_eager:
        cc = {"cudagraph_capture_sizes": _ints(a.cudagraph_sizes)}
        if a.cudagraph_mode:
            cc["cudagraph_mode"] = a.cudagraph_mode
        kwargs["compilation_config"] = cc
    res["llm_kwargs"] = kwargs
    _dump(out, res)
    print(f"[{a.impl}] starting LLM {kwargs}", flush=True)
    llm = LLM(**kwargs)
    res.update(describe(llm))
    mc = llm.llm_engine.model_config
    try:
        res["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    except Exception:  # noqa: BLE001
        pass
    res["startup_s"] = round(time.time() - t0, 1)
    print(f"[{a.impl}] engine up in {res['startup_s']} s; {res['architecture']} -> {res['model_class']}; "
          f"cudagraph_mode {res.get('cudagraph_mode')}", flush=True)
    _dump(out, res)

    vocab = int(mc.get_vocab_size())
    gen = torch.Generator().manual_seed(1234)
    lo = min(1000, vocab // 4)  # stay clear of the special ids at the start of the synthetic vocabulary

    def prompts(n_req: int, length: int):
        ids = torch.randint(lo, vocab - 16, (n_req, length), generator=gen).tolist()
        return [TokensPrompt(prompt_token_ids=x) for x in ids]

    def timed(n_req: int, length: int, max_tokens: int) -> float:
        ps = prompts(n_req, length)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        sync()
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        sync()
        dt = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == n_req * max_tokens, (got, n_req, max_tokens)
        return dt

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def measure(n_req, length, max_tokens) -> list[float]:
        for _ in range(a.warmup):
            timed(n_req, length, max_tokens)
        return [timed(n_req, length, max_tokens) for _ in range(a.reps)]

    for n in prefill_ns:
        p = min(n, a.prompt_len)
        k = max(1, n // p)
        ts = measure(k, p, 1)
        med = statistics.median(ts)
        res["prefill"][str(n)] = {"requests": k, "prompt_len": p, "tokens": k * p, "times_s": ts,
                                  "tok_s": k * p / med}
        print(f"[{a.impl}] prefill {k}x{p} tokens: median {med * 1e3:.1f} ms -> {k * p / med:,.0f} input tok/s",
              flush=True)
        _dump(out, res)
    engine = llm.llm_engine
    for b in decode_bs:
        for i in range(a.warmup):
            decode_steps(engine, prompts(b, a.decode_prompt_len), a.decode_tokens, f"w{b}.{i}")
        r = decode_steps(engine, prompts(b, a.decode_prompt_len), a.decode_tokens, f"d{b}")
        res["decode"][str(b)] = r
        print(f"[{a.impl}] decode batch {b}: {r['steady_steps']} steady steps of {r['steps']}, median "
              f"{r['step_ms']:.2f} ms/step (p10 {r['p10_ms']:.2f}, p90 {r['p90_ms']:.2f}) -> "
              f"{r['tok_s']:,.1f} output tok/s", flush=True)
        _dump(out, res)

    if a.profile:
        res["profile"] = profile(a, timed, prefill_ns, decode_bs)
    if a.host_profile:  # after the timed runs: cProfile of one decode batch (the engine core runs in-process)
        b = a.host_profile
        host_profile(lambda: decode_steps(engine, prompts(b, a.decode_prompt_len), a.decode_tokens, f"h{b}"),
                     f"{a.impl}, decode batch {b}, {a.decode_tokens} tokens", top=40)
        host_profile(lambda: timed(1, a.prompt_len, 1), f"{a.impl}, prefill 1x{a.prompt_len}", top=40)
    res["total_s"] = round(time.time() - t0, 1)
    _dump(out, res)
    print(f"[{a.impl}] done in {res['total_s']} s", flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def decode_steps(engine, prompts: list, max_tokens: int, tag: str) -> dict:
    """Add all `prompts` at once, step the engine until they finish, time every step; steady decode steps are
    those after every request's first token (all prefills done) in which every request got a token and none
    finished. Output tok/s = batch / median steady step time."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    b = len(prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, sp)
    got = dict.fromkeys((f"{tag}-{i}" for i in range(b)), 0)
    steady, steps = [], 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        all_started = min(got.values()) >= 1
        outs = engine.step()
        now = time.perf_counter()
        new = {o.request_id: len(o.outputs[0].token_ids) for o in outs if o.outputs}
        finished = any(o.finished for o in outs)
        for rid, n in new.items():
            got[rid] += n
        if all_started and not finished and len(new) == b and all(n == 1 for n in new.values()):
            steady.append(now - t)
        steps += 1 if outs else 0
        t = now
    assert all(n == max_tokens for n in got.values()), got
    if not steady:
        return {"batch": b, "max_tokens": max_tokens, "steps": steps, "steady_steps": 0, "tok_s": float("nan"),
                "step_ms": float("nan"), "p10_ms": float("nan"), "p90_ms": float("nan")}
    q = statistics.quantiles(steady, n=10) if len(steady) > 1 else [steady[0]] * 9
    med = statistics.median(steady)
    return {"batch": b, "max_tokens": max_tokens, "steps": steps, "steady_steps": len(steady),
            "step_ms": med * 1e3, "p10_ms": q[0] * 1e3, "p90_ms": q[-1] * 1e3, "tok_s": b / med,
            "steady_times_s": steady}


def profile(a, timed, prefill_ns, decode_bs) -> dict:
    """torch.profiler top ops of one prefill call, and the per-step decode breakdown at batch
    --profile-batch: the call generating D tokens minus the call generating 1 (same prompts' shapes), per op,
    divided by D - 1 — so the prefill inside both calls cancels and only decode steps remain."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"

    shapes: dict[str, tuple[float, int]] = {}
    host: dict[str, tuple[float, int]] = {}  # host side of the prefill call: launches, syncs, torch ops' own CPU time

    def run(k: int, length: int, mt: int, by_shape: bool = False) -> dict[str, tuple[float, int]]:
        """Kernel rows of one call; `by_shape`: also the torch ops' own kernel time by op and input
        shapes into `shapes` (on CUDA: which torch op launched the glue kernels)."""
        timed(k, length, mt)  # warm
        with tprofile(activities=acts, record_shapes=by_shape) as prof:
            timed(k, length, mt)
        if a.trace_dir:
            Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(a.trace_dir) / f"{a.impl}_{k}x{length}_{mt}tok.json"))
        if by_shape and cuda:
            shapes.update({f"{e.key} {e.input_shapes}": (e.self_device_time_total, e.count)
                           for e in prof.key_averages(group_by_input_shape=True)
                           if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")
                           and e.self_device_time_total > 0})
            host.update({e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()
                         if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0})
        # On CUDA only kernel rows: an aten op's self device time is its kernels' time again.
        return {e.key: (getattr(e, attr, 0), e.count) for e in prof.key_averages()
                if not cuda or e.device_type == torch.autograd.DeviceType.CUDA}

    def table(name: str, ops: dict[str, tuple[float, int]], unit: str, sort: str = attr) -> dict:
        total = sum(us for us, _ in ops.values()) or 1
        rows = sorted(ops.items(), key=lambda kv: kv[1][0], reverse=True)[: a.profile_top]
        print(f"\n[{a.impl}] profile {name}: top {a.profile_top} ops by {sort} (total {total / 1e3:.3f} ms{unit})",
              flush=True)
        for op, (us, calls) in rows:
            print(f"  {us / 1e3:9.3f} ms {100 * us / total:5.1f}%  x{calls:<8g} {op[:160]}", flush=True)
        return {"total_us": total, "sort": sort, "unit": unit, "top": [
            {"op": op, "self_us": us, "pct": 100.0 * us / total, "calls": calls} for op, (us, calls) in rows]}

    n = prefill_ns[len(prefill_ns) // 2]
    p = min(n, a.prompt_len)
    k = max(1, n // p)
    out = {f"prefill_{k}x{p}": table(f"prefill {k}x{p}", run(k, p, 1, by_shape=True), "")}
    if shapes:
        out[f"prefill_{k}x{p}_torch_ops"] = table(f"prefill {k}x{p}, torch ops by input shapes", shapes, "")
    if host:
        out[f"prefill_{k}x{p}_host"] = table(f"prefill {k}x{p}, host", host, "", "self_cpu_time_total")
    b = a.profile_batch if a.profile_batch in decode_bs else max(decode_bs)
    D = a.decode_tokens
    one, many = run(b, a.decode_prompt_len, 1), run(b, a.decode_prompt_len, D)
    step = {op: ((us - one.get(op, (0, 0))[0]) / (D - 1), (c - one.get(op, (0, 0))[1]) / (D - 1))
            for op, (us, c) in many.items()}
    step = {op: v for op, v in step.items() if v[0] > 0}
    out[f"decode_b{b}_per_step"] = table(f"decode batch {b}, per step (T({D}) - T(1)) / {D - 1}", step, " per step")
    return out


# ============================================================================ driver
def table(results: dict, impls: list[str]) -> str:
    rows = []
    head = "| phase | size | " + " | ".join(impls) + (f" | {impls[0]}/{impls[1]} |" if len(impls) == 2 else " |")
    rows += [head, "|" + "---|" * (head.count("|") - 1)]

    def line(label, size, key, sub, unit):
        vals = [results.get(i, {}).get(key, {}).get(size, {}).get(sub) for i in impls]
        cells = [f"{v:,.0f}" if isinstance(v, (int, float)) and math.isfinite(v) else "–" for v in vals]
        ratio = ""
        if len(impls) == 2:
            o, t = (results.get(impls[0], {}).get(key, {}).get(size, {}).get(sub),
                    results.get(impls[1], {}).get(key, {}).get(size, {}).get(sub))
            ratio = f" {o / t:.2f} |" if o and t and math.isfinite(o / t) else " – |"
        rows.append(f"| {label} | {size} {unit} | " + " | ".join(cells) + (" |" + ratio if ratio else " |"))

    sizes_p = sorted({s for i in impls for s in results.get(i, {}).get("prefill", {})}, key=int)
    sizes_d = sorted({s for i in impls for s in results.get(i, {}).get("decode", {})}, key=int)
    for s in sizes_p:
        line("prefill input tok/s", s, "prefill", "tok_s", "tok/step")
    for s in sizes_d:
        line("decode output tok/s", s, "decode", "tok_s", "seqs")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="v4.1-flash", help="v4.1-flash | v4-flash")
    p.add_argument("--preset", default="full-width", help="make_checkpoint preset (full-width | tiny)")
    p.add_argument("--layers", type=int, default=8, help="backbone layers (make_checkpoint layer plan; 0: the "
                   "preset's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=JSON",
                   help="config override as in make_checkpoint --set (repeatable)")
    p.add_argument("--model", default=None, help="existing model dir (config + tokenizer); default: written")
    p.add_argument("--only", choices=["ours", "intree", "invariant"], default=None)
    p.add_argument("--invariant", action="store_true",
                   help="plugin with DEEPINFER_BATCH_INVARIANT=1 vs the plugin's default (instead of vs in-tree)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--storage", choices=["packed", "bf16", "auto"], default="packed",
                   help="ours: DEEPINFER_FP8_LINEARS / DEEPINFER_EXPERT_STORAGE (packed = the formats in-tree holds)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cudagraph-sizes", default="1,16,64,256")
    p.add_argument("--cudagraph-mode", default=None, help="e.g. FULL_DECODE_ONLY, PIECEWISE (default: vLLM's)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--prefill-tokens", default="1024,4096,16384", help="tokens per prefill step")
    p.add_argument("--prompt-len", type=int, default=1024, help="prefill prompt length (N // len prompts)")
    p.add_argument("--decode-batches", default="1,16,64,256")
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-gib", type=float, default=24.0, help="fixed KV cache GiB (0: vLLM's memory profiling)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="both sides (auto: ours exact bf16 rows, in-tree fp8_ds_mla records on Hopper; fp8_ds_mla: "
                        "records on both)")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--no-jit-warmup", action="store_true", help="kernel_config: no JIT warm-up / FlashInfer autotune")
    p.add_argument("--profile", action="store_true", help="torch.profiler top ops, both sides (runs engines in-process)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--profile-batch", type=int, default=64, help="decode batch of the per-step profile")
    p.add_argument("--host-profile", type=int, default=0, metavar="B",
                   help="after the timed runs, cProfile one decode batch of B requests (in-process engine)")
    p.add_argument("--inproc", action="store_true",
                   help="VLLM_ENABLE_V1_MULTIPROCESSING=0 (implied by --profile and --host-profile)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per implementation subprocess")
    p.add_argument("--device-smoke", action="store_true",
                   help="CPU smoke test: tiny preset, float32, eager, small sizes")
    p.add_argument("--out", default=None)
    p.add_argument("--report", default=None, metavar="DIR",
                   help="only print the table of DIR/ours.json and DIR/intree.json (e.g. two device calls)")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["ours", "intree", "invariant"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--trace-dir", default=None, help="also export chrome traces of the profiled calls here")
    a = p.parse_args(argv)

    if a.device_smoke:
        a.preset, a.dtype, a.enforce_eager = "tiny", "float32", True
        a.prefill_tokens, a.prompt_len, a.decode_batches = "64,256", 64, "1,4,16"
        a.decode_prompt_len, a.decode_tokens, a.max_model_len = 32, 8, 512
        a.kv_gib, a.gpu_mem, a.profile_top, a.warmup, a.reps = 0.0, 0.2, 12, 0, 1
        a.inproc = True  # engine start ~5 s instead of ~80 s on CPU
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if a.profile or a.host_profile:
        a.inproc = True
    a.layers = a.layers or None
    # one scheduler step holds every prefill and every decode batch's prompts: the decode batches start with
    # all their prefills in one step, so the steady decode steps begin right after it
    a.token_budget = max(_ints(a.prefill_tokens) + [b * a.decode_prompt_len for b in _ints(a.decode_batches)])
    if a.worker:
        worker(a)
        return 0
    if a.report:
        d = Path(a.report)
        res = {i: json.loads((d / f"{i}.json").read_text()) for i in ("ours", "intree") if (d / f"{i}.json").exists()}
        return report(d, res, ["ours", "intree"], {"report": a.report}, "")

    out = Path(a.out or (Path(os.environ["OUT"]) / "bench_e2e" if os.environ.get("OUT") else "bench_e2e_out"))
    out.mkdir(parents=True, exist_ok=True)
    model = Path(a.model) if a.model else write_model_dir(a.arch, a.preset, out / f"model-{a.arch}-{a.preset}",
                                                          a.layers, _parse_set(a.arch, a.overrides))
    print(f"model dir {model} (config + tokenizer, dummy weights)", flush=True)
    print("\n".join(layer_split(model)), flush=True)
    impls = [a.only] if a.only else ["invariant", "ours"] if a.invariant else ["ours", "intree"]
    fwd = list(argv if argv is not None else sys.argv[1:])
    skip = {"--only", "--out", "--model", "--timeout", "--set"}  # options with a value
    passthru, i = [], 0
    while i < len(fwd):
        x = fwd[i]
        if x == "--invariant":  # a flag: no value follows
            i += 1
            continue
        if x.split("=")[0] in skip:
            i += 1 if "=" in x else 2
            continue
        passthru.append(x)
        i += 1
    results = {}
    for impl in impls:
        rpath, log = out / f"{impl}.json", out / f"{impl}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if impl == "intree":
            env["DEEPINFER_DISABLE"] = "1"
        else:
            env.pop("DEEPINFER_DISABLE", None)
            env["DEEPINFER_BATCH_INVARIANT"] = "1" if impl == "invariant" else "0"
            if a.storage != "auto":
                env["DEEPINFER_FP8_LINEARS"] = env["DEEPINFER_EXPERT_STORAGE"] = a.storage
        cmd = [sys.executable, str(HERE), "--worker", "--impl", impl, "--model", str(model), "--result", str(rpath),
               *passthru]
        print(f"== {time.strftime('%T')} {impl}: {' '.join(cmd)}  (log {log}, limit {a.timeout} s)", flush=True)
        t = time.time()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout,
                                    check=False).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"== {impl}: rc={rc} in {time.time() - t:.0f} s", flush=True)
        if rpath.exists():
            results[impl] = json.loads(rpath.read_text())
            results[impl]["rc"] = rc
        text = log.read_text(errors="replace").splitlines()
        for ln in text:
            if ln.startswith(f"[{impl}]"):
                print("  " + ln)
        engine_lines = [ln.split("] ", 1)[-1] for ln in text if any(k in ln for k in ENGINE_LINES)]
        print("  vLLM says: " + "\n  vLLM says: ".join(engine_lines))
        if impl in results:
            results[impl]["engine_log"] = engine_lines
        if impl == "ours":
            try:
                lines = planner_lines(model, a)
            except Exception as e:  # noqa: BLE001 - informational
                lines = [f"planner failed: {e!r}"]
            print("\n".join("  " + x for x in lines))
            if impl in results:
                results[impl]["planner"] = lines
        if rc != 0:
            print("  --- log tail ---\n  " + "\n  ".join(text[-25:]))
        elif a.profile or a.host_profile:
            keep, on = [], False
            for ln in text:
                on = on or ln.startswith((f"[{impl}] profile", "== host profile"))
                if on and not ln.startswith(f"[{impl}] done"):
                    keep.append(ln)
            print("\n".join(keep))
    return report(out, results, impls, {k: v for k, v in vars(a).items() if k not in ("worker", "impl", "result")},
                  str(model))


def report(out: Path, results: dict, impls: list[str], args: dict, model_dir: str) -> int:
    """Print the ours / in-tree table with ratios and write `out/results.json`."""
    tbl = table(results, impls)
    print("\n" + tbl)
    summary = {"args": args, "model_dir": model_dir, "table": tbl, "results": results}
    if len(impls) == 2 and impls[0] in results and impls[1] in results:
        ratios = summary[f"ratio_{impls[0]}_over_{impls[1]}"] = {}
        for ph in ("prefill", "decode"):
            for s, r in results[impls[0]].get(ph, {}).items():
                t = results[impls[1]].get(ph, {}).get(s)
                if t and t.get("tok_s") and math.isfinite(r.get("tok_s") or math.nan):
                    ratios[f"{ph}_{s}"] = r["tok_s"] / t["tok_s"]
    _dump(out / "results.json", summary)
    print(f"\nresults: {out / 'results.json'}")
    return 0 if all(results.get(i, {}).get("rc", 0) == 0 for i in impls) else 1

if __name__ == "__main__":
    sys.exit(main())
