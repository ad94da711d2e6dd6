"""Fidelity on vLLM 0.32: the DeepInfer plugin vs vLLM's in-tree DeepSeek-V4.1 / V4 model, same checkpoint.

Three sub-commands (see NOTES-gpu-vllm.md for the exact device commands):

  prompts  CKPT OUT.json [--lens 37,300,1000]       CPU: token ids of English text (tests/fidelity.prompt_ids)
  run      --impl ours|intree --ckpt DIR --prompts P.json --out R.json [--dtype bfloat16] [--eager] [--tp N]
           [--serve-args "--data-parallel-size 2 --enable-expert-parallel ..."]
           one vLLM engine (in this process), greedy N new tokens per prompt (ignore_eos), prompt
           logprobs (top-5 + the prompt token) and sampled logprobs (top-5). `intree` sets
           DEEPINFER_DISABLE=1 before vLLM is imported, so vLLM's own model class serves the arch.
           With --serve-args the engine is `vllm serve` with the same settings plus those arguments (data
           parallel needs it: `LLM(data_parallel_size>1)` is refused), queried on /v1/completions.
           R.json is rewritten after every prompt (a run stopped at its time limit keeps what it did).
  compare  A.json B.json [--ref dense|hf|none --ckpt DIR]
           token agreement per prompt, first divergence, prompt-logprob differences; with --ref it
           also scores both continuations with the CPU full-sequence reference (teacher forcing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from engine_info import describe  # benchmarks/ is on sys.path: the scripts run as files

REPO = Path(__file__).resolve().parents[1]


def _dump(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def cmd_prompts(a) -> None:
    sys.path.insert(0, str(REPO))
    from tests.fidelity import prompt_ids

    lens = [int(x) for x in a.lens.split(",")]
    out = {str(n): prompt_ids(a.ckpt, n) for n in lens}
    for n, ids in out.items():
        assert len(ids) == int(n), (n, len(ids))
    Path(a.out).write_text(json.dumps(out))
    print("prompts:", {n: len(v) for n, v in out.items()})


def _lp_dict(d) -> dict[str, float]:
    return {str(t): float(lp.logprob) for t, lp in d.items()}


def cmd_run(a) -> None:
    if a.impl == "intree":
        os.environ["DEEPINFER_DISABLE"] = "1"
    else:
        os.environ.pop("DEEPINFER_DISABLE", None)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = {int(k): v for k, v in json.loads(Path(a.prompts).read_text()).items()}
    res = {"impl": a.impl, "ckpt": str(a.ckpt), "dtype": a.dtype, "vllm": vllm.__version__,
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "env": {k: v for k, v in os.environ.items() if k.startswith(("DEEPINFER", "VLLM_", "DG_"))},
           "results": {}}
    out = Path(a.out)
    kwargs = dict(model=str(a.ckpt), dtype=a.dtype, enforce_eager=a.eager, max_model_len=a.max_model_len,
                  max_num_batched_tokens=a.max_model_len, max_num_seqs=4, seed=0,
                  gpu_memory_utilization=a.gpu_mem, trust_remote_code=False, tensor_parallel_size=a.tp)
    if a.kv_bytes:  # fixed KV budget: skips vLLM's device-global memory profiling (two engines share the GPU)
        kwargs["kv_cache_memory_bytes"] = int(a.kv_bytes * 2**30)
    if a.no_jit_warmup:  # compile kernels on first use instead of for every warm-up shape (numerics unchanged)
        kwargs["kernel_config"] = {"enable_jit_warmup": False, "enable_flashinfer_autotune": False}
    if a.text_only:  # no image inputs: skips the multimodal processor/profiling (vLLM's V4.1 one hard-codes id 129264)
        kwargs["limit_mm_per_prompt"] = {"image": 0}
    if a.cudagraph_sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [int(x) for x in a.cudagraph_sizes.split(",")]}
    res["llm_kwargs"] = kwargs
    _dump(out, res)
    if a.serve_args:
        _run_served(a, kwargs, prompts, res, out, t0)
        return
    print(f"[{a.impl}] starting LLM {kwargs}", flush=True)
    llm = LLM(**kwargs)
    res.update(describe(llm))
    res["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    res["startup_s"] = round(time.time() - t0, 1)
    print(f"[{a.impl}] engine up in {res['startup_s']} s; arch {res['architecture']} -> {res['model_class']}", flush=True)
    _dump(out, res)
    params = SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True, prompt_logprobs=5, logprobs=5)
    for n in sorted(prompts):
        ids = prompts[n]
        t1 = time.time()
        o = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        dt = time.time() - t1
        c = o.outputs[0]
        plp = [None] + [_lp_dict(d) for d in o.prompt_logprobs[1:]]
        res["results"][str(n)] = {
            "prompt": ids, "generated": list(c.token_ids), "seconds": round(dt, 2),
            "prompt_logprobs": plp,
            "gen_logprobs": [_lp_dict(d) for d in (c.logprobs or [])],
        }
        _dump(out, res)
        print(f"[{a.impl}] len {n}: {dt:.2f} s, first tokens {list(c.token_ids)[:12]}", flush=True)
    # a repeat of the shortest prompt inside a 3-request batch (batch invariance / determinism check)
    batch = [TokensPrompt(prompt_token_ids=prompts[n]) for n in sorted(prompts)]
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True), use_tqdm=False)
    res["batched_generated"] = {str(n): list(o.outputs[0].token_ids) for n, o in zip(sorted(prompts), outs)}
    res["total_s"] = round(time.time() - t0, 1)
    _dump(out, res)
    same = {n: res["batched_generated"][str(n)] == res["results"][str(n)]["generated"] for n in sorted(prompts)}
    print(f"[{a.impl}] batched == single: {same}; total {res['total_s']} s", flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def _serve_flags(kwargs: dict) -> list[str]:
    """`vllm serve` flags for the LLM(**kwargs) settings of cmd_run (model and tensor_parallel_size included)."""
    flags = ["--enforce-eager"] if kwargs.pop("enforce_eager") else []
    kwargs.pop("model")
    for k, v in kwargs.items():
        if v is not False:
            flags += [f"--{k.replace('_', '-')}", json.dumps(v) if isinstance(v, dict) else str(v)]
    return flags


def _complete(port: int, model: str, ids: list[int], new: int, logprobs: int) -> dict:
    """One greedy /v1/completions on token ids: generated ids, prompt logprobs (top-5 + prompt token), top-5 sampled."""
    import urllib.request

    body = {"model": model, "prompt": ids, "max_tokens": new, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    if logprobs:
        body.update(prompt_logprobs=logprobs, logprobs=logprobs, return_tokens_as_token_ids=True)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        c = json.loads(r.read())["choices"][0]
    res = {"prompt": ids, "generated": c["token_ids"]}
    if logprobs:
        res["prompt_logprobs"] = [None] + [{k: float(v["logprob"]) for k, v in d.items()}
                                           for d in c["prompt_logprobs"][1:]]
        res["gen_logprobs"] = [{k.split(":", 1)[1]: float(v) for k, v in d.items()}
                               for d in c["logprobs"]["top_logprobs"]]
    return res


def _run_served(a, kwargs: dict, prompts: dict[int, list[int]], res: dict, out: Path, t0: float) -> None:
    """cmd_run through `vllm serve` + `a.serve_args`: same JSON (results per prompt, batched_generated)."""
    import concurrent.futures
    import shlex

    sys.path.insert(0, str(Path(__file__).parent))
    from serve_util import Server, serve_cmd, wait_first_token

    port = a.port
    cmd = serve_cmd(str(a.ckpt), port, _serve_flags(dict(kwargs)) + shlex.split(a.serve_args))
    res["serve_cmd"] = cmd
    with Server(cmd, dict(os.environ, PYTHONUNBUFFERED="1"), out.with_suffix(".serve.log")) as server:
        up = wait_first_token(server, port, str(a.ckpt), limit=a.start_timeout)
        if up is None:
            raise RuntimeError(f"vllm serve did not answer:\n{server.tail()}")
        res["startup_s"] = round(up, 1)
        print(f"[{a.impl}] served engine up in {res['startup_s']} s: {shlex.join(cmd)}", flush=True)
        for n in sorted(prompts):
            t1 = time.time()
            r = _complete(port, str(a.ckpt), prompts[n], a.new, 5)
            r["seconds"] = round(time.time() - t1, 2)
            res["results"][str(n)] = r
            _dump(out, res)
            print(f"[{a.impl}] len {n}: {r['seconds']:.2f} s, first tokens {r['generated'][:12]}", flush=True)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # one batch (spread over the DP ranks)
            batched = list(pool.map(lambda n: _complete(port, str(a.ckpt), prompts[n], a.new, 0), sorted(prompts)))
    res["batched_generated"] = {str(n): b["generated"] for n, b in zip(sorted(prompts), batched)}
    res["total_s"] = round(time.time() - t0, 1)
    _dump(out, res)
    same = {n: res["batched_generated"][str(n)] == res["results"][str(n)]["generated"] for n in sorted(prompts)}
    print(f"[{a.impl}] batched == single: {same}; total {res['total_s']} s", flush=True)


def _load(path: str) -> dict:
    """A run's JSON; `.json.gz` too (the stored results are compressed to keep device transfers small)."""
    p = Path(path)
    if p.suffix == ".gz":
        import gzip
        return json.loads(gzip.decompress(p.read_bytes()))
    return json.loads(p.read_text())


def _prompt_diffs(ra, rb):
    """Per prompt position: |logprob_a - logprob_b| of the actual next prompt token, max over the union of the
    two top-5 sets present in both dicts, and whether the two top-1 tokens agree."""
    tok_d, top_d, top1 = [], [], []
    ids = ra["prompt"]
    for i in range(1, len(ids)):
        da, db = ra["prompt_logprobs"][i], rb["prompt_logprobs"][i]
        t = str(ids[i])
        tok_d.append(abs(da[t] - db[t]))
        common = set(da) & set(db)
        top_d.append(max(abs(da[k] - db[k]) for k in common))
        top1.append(max(da, key=da.get) == max(db, key=db.get))
    return tok_d, top_d, top1


def _stats(x):
    x = sorted(x)
    return {"max": x[-1], "mean": sum(x) / len(x), "p50": x[len(x) // 2], "p99": x[min(len(x) - 1, int(0.99 * len(x)))]}


def _ref_check(ref_logits_fn, r):
    """Teacher-force the reference on prompt + this implementation's continuation."""
    import torch
    ids, gen = r["prompt"], r["generated"]
    logits = ref_logits_fn(ids + gen).float()
    lp = torch.log_softmax(logits, -1)
    n = len(ids)
    cont = logits[n - 1: n - 1 + len(gen)]
    arg = cont.argmax(-1).tolist()
    top2 = cont.topk(2, -1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    mism = [(i, g, r_, round(margins[i], 5)) for i, (g, r_) in enumerate(zip(gen, arg)) if g != r_]
    pdiff = [abs(r["prompt_logprobs"][i][str(ids[i])] - lp[i - 1, ids[i]].item()) for i in range(1, n)]
    gdiff = [abs(r["gen_logprobs"][i][str(g)] - lp[n - 1 + i, g].item()) for i, g in enumerate(gen)] \
        if r.get("gen_logprobs") else []
    return {"mismatches": mism, "n_mismatch": len(mism), "min_margin": min(margins),
            "prompt_tok_logprob_vs_ref": _stats(pdiff), "gen_logprob_vs_ref": _stats(gdiff) if gdiff else None}


def cmd_compare(a) -> None:
    A, B = _load(a.a), _load(a.b)
    ref = None
    if a.ref != "none":
        sys.path.insert(0, str(REPO))
        import torch
        torch.set_grad_enabled(False)
        if a.ref == "dense":
            from tests.reference.dense_v41 import DenseV41 as Ref
        else:
            from tests.reference.hf_v4 import HFV4 as Ref
        model = Ref(Path(a.ckpt))
        ref = model.logits
    if a.labels:  # e.g. two runs of the same implementation on different devices / dtypes
        A["impl"], B["impl"] = a.labels.split(",")
    report = {"a": A["impl"], "b": B["impl"], "per_len": {}}
    for n in sorted(set(A["results"]) & set(B["results"]), key=int):
        ra, rb = A["results"][n], B["results"][n]
        assert ra["prompt"] == rb["prompt"]
        ga, gb = ra["generated"], rb["generated"]
        first = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)
        tok_d, top_d, top1 = _prompt_diffs(ra, rb)
        gaps = None
        if first is not None:  # how close each side was to the other's choice at the first divergence
            la, lb = ra["gen_logprobs"][first], rb["gen_logprobs"][first]
            gaps = {A["impl"]: la[str(ga[first])] - la.get(str(gb[first]), float("-inf")),
                    B["impl"]: lb[str(gb[first])] - lb.get(str(ga[first]), float("-inf"))}
        row = {"identical": ga == gb, "first_divergence": first, "divergence_gaps": gaps,
               "agree_tokens": sum(x == y for x, y in zip(ga, gb)), "n_new": len(ga),
               "prompt_tok_logprob_absdiff": _stats(tok_d), "prompt_top5_absdiff": _stats(top_d),
               "prompt_top1_agree": f"{sum(top1)}/{len(top1)}",
               "seconds": {A["impl"]: ra["seconds"], B["impl"]: rb["seconds"]}}
        if ref is not None:
            row["ref_" + A["impl"]] = _ref_check(ref, ra)
            row["ref_" + B["impl"]] = _ref_check(ref, rb)
        row["pass"] = (row["prompt_tok_logprob_absdiff"]["mean"] <= a.mean_tol
                       and (gaps is None or max(gaps.values()) <= a.tie_tol))
        report["per_len"][n] = row
        print(f"len {n}: identical={row['identical']} agree={row['agree_tokens']}/{row['n_new']} "
              f"first_div={first} gaps {gaps and {k: round(v, 4) for k, v in gaps.items()}} "
              f"prompt |dlp| max={row['prompt_tok_logprob_absdiff']['max']:.4g} "
              f"mean={row['prompt_tok_logprob_absdiff']['mean']:.4g} top1 {row['prompt_top1_agree']} "
              f"-> {'PASS' if row['pass'] else 'FAIL'}")
        if ref is not None:
            for k in ("ref_" + A["impl"], "ref_" + B["impl"]):
                r = row[k]
                print(f"   {k}: mismatches {r['n_mismatch']}/{len(ga)} first {r['mismatches'][:3]} "
                      f"min margin {r['min_margin']:.4g}; prompt |dlp| vs ref max "
                      f"{r['prompt_tok_logprob_vs_ref']['max']:.4g} mean {r['prompt_tok_logprob_vs_ref']['mean']:.4g}")
    for k in ("startup_s", "total_s", "model_class", "device", "torch"):
        report[k] = {A["impl"]: A.get(k), B["impl"]: B.get(k)}
    report["pass"] = bool(report["per_len"]) and all(r["pass"] for r in report["per_len"].values())  # no data: FAIL
    print(f"fidelity check (tie <= {a.tie_tol} nats, prompt mean <= {a.mean_tol}): "
          f"{'PASS' if report['pass'] else 'FAIL'}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("startup_s", "total_s", "model_class")}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prompts")
    s.add_argument("ckpt")
    s.add_argument("out")
    s.add_argument("--lens", default="37,300,1000")
    s = sub.add_parser("run")
    s.add_argument("--impl", choices=["ours", "intree"], required=True)
    s.add_argument("--ckpt", required=True)
    s.add_argument("--prompts", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--new", type=int, default=64)
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--gpu-mem", type=float, default=0.25)
    s.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--cudagraph-sizes", default="")
    s.add_argument("--kv-bytes", type=float, default=0.0, help="GiB of KV cache (0: vLLM's profiling)")
    s.add_argument("--no-jit-warmup", action="store_true")
    s.add_argument("--text-only", action="store_true")
    s.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    s.add_argument("--serve-args", default="", help="run under `vllm serve` with these extra arguments")
    s.add_argument("--start-timeout", type=float, default=420, help="seconds for the served engine to answer")
    s.add_argument("--port", type=int, default=8013, help="port of the served engine")
    s = sub.add_parser("compare")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--ref", choices=["dense", "hf", "none"], default="none")
    s.add_argument("--ckpt")
    s.add_argument("--out")
    s.add_argument("--labels", help="A,B: names for the two runs (default: their impl)")
    s.add_argument("--tie-tol", type=float, default=0.1,
                   help="PASS needs, at the first divergence, each side's logprob gap between its token and the "
                        "other's <= this (a near tie; gaps exceed it when the other token is outside the top 5)")
    s.add_argument("--mean-tol", type=float, default=0.05, help="PASS needs mean |d logprob| over the prompt <= this")
    a = p.parse_args()
    {"prompts": cmd_prompts, "run": cmd_run, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    main()
