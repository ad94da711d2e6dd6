"""Served benchmark of the protocol: `vllm serve` + `vllm bench serve`, ours vs in-tree on the same model dir.

GPU (one H200; the protocol model of bench_e2e.py: V4.1 release widths, 8 layers, 384 experts top-6, dummy
weights; ~5-6 min per side with 200 prompts at every concurrency, so one side per device call):

    python3 benchmarks/bench_serve.py --only intree --out $OUT/serve     # then --only ours, same --out
    python3 benchmarks/bench_serve.py --report DIR [DIR2]                # ratio table of both sides

CPU smoke (tiny model, ours only, a few minutes):

    python benchmarks/bench_serve.py --cpu-smoke --out /tmp/serve_smoke

Each side: `vllm serve MODEL --load-format dummy` (in-tree: DEEPINFER_DISABLE=1; ours: packed storage, see
serve_util.py) with the same KV budget in bytes (--kv-cache-memory-bytes), CUDA-graph sizes up to the largest
concurrency, prefix caching off; then for C in --concurrency (1, 8, 32, 128):
`vllm bench serve --dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 200
--max-concurrency C --ignore-eos`. Reported per C: output tok/s, mean TTFT, mean TPOT, and ours/in-tree ratios
(tok/s: > 1 is ours faster; TTFT and TPOT: < 1 is ours faster). Files: `<impl>_c<C>.json` (vLLM's result),
`<impl>_server.log`, `serve_results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from serve_util import Server, impl_env, serve_cmd, vllm_cli, wait_first_token

METRICS = (("output_throughput", "output tok/s", 1), ("mean_ttft_ms", "mean TTFT ms", -1),
           ("mean_tpot_ms", "mean TPOT ms", -1))


def protocol_model(out: Path, smoke: bool) -> Path:
    """The bench_e2e protocol model dir (config + tokenizer), or the tiny one for the CPU smoke."""
    from bench_e2e import _parse_set, write_model_dir

    preset = "tiny" if smoke else "full-width"
    return write_model_dir("v4.1-flash", preset, out / f"model-v4.1-flash-{preset}", 8,
                           _parse_set("v4.1-flash", []))


def run_side(impl: str, model: Path, a, out: Path) -> dict:
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256} & set(range(1, max(a.concurrency) + 1)) | set(a.concurrency))
    extra = ["--load-format", "dummy", "--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
             "--max-num-seqs", str(max(a.concurrency)), "--no-enable-prefix-caching"]
    if a.cpu_smoke:
        extra += ["--enforce-eager", "--gpu-memory-utilization", "0.2"]
    else:
        extra += ["--kv-cache-memory-bytes", str(int(a.kv_gib * 2 ** 30)),
                  "-cc", json.dumps({"cudagraph_capture_sizes": sizes}),
                  "--kernel-config", json.dumps({"enable_jit_warmup": False, "enable_flashinfer_autotune": False})]
    extra += a.serve_args.split() if a.serve_args else []
    cmd = serve_cmd(str(model), a.port, extra)
    print(f"== {time.strftime('%T')} {impl}: {' '.join(cmd)}", flush=True)
    res = {"impl": impl, "serve_cmd": cmd, "runs": {}}
    with Server(cmd, impl_env(impl, a.storage), out / f"{impl}_server.log") as srv:
        up = wait_first_token(srv, a.port, str(model), a.start_timeout)
        if up is None:
            print(f"   {impl}: server not up (log tail)\n{srv.tail()}", flush=True)
            res["error"] = "server did not start"
            return res
        res["first_token_s"] = round(up, 1)
        print(f"   {impl}: first token {up:.1f} s after launch", flush=True)
        for c, n in zip(a.concurrency, a.num_prompts):
            name = f"{impl}_c{c}.json"
            bench = vllm_cli() + [
                "bench", "serve", "--backend", "vllm", "--endpoint", "/v1/completions", "--model", str(model),
                "--port", str(a.port), "--dataset-name", "random", "--random-input-len", str(a.input_len),
                "--random-output-len", str(a.output_len), "--num-prompts", str(n), "--max-concurrency", str(c),
                "--ignore-eos", "--temperature", "0", "--save-result", "--result-dir", str(out),
                "--result-filename", name]
            t = time.perf_counter()
            p = subprocess.run(bench, env=impl_env(impl, a.storage), capture_output=True, text=True,
                               timeout=a.bench_timeout)
            (out / f"{impl}_c{c}.out").write_text(p.stdout + p.stderr)
            if p.returncode or not (out / name).exists():
                print(f"   {impl} C={c}: bench failed rc={p.returncode}\n" + "\n".join(
                    (p.stdout + p.stderr).splitlines()[-15:]), flush=True)
                continue
            r = json.loads((out / name).read_text())
            res["runs"][str(c)] = {k: r.get(k) for k, _, _ in METRICS} | {
                "num_prompts": n, "completed": r.get("completed"), "duration_s": r.get("duration")}
            print(f"   {impl} C={c} ({n} prompts, {time.perf_counter() - t:.0f} s): " + ", ".join(
                f"{label} {r.get(k, float('nan')):,.1f}" for k, label, _ in METRICS), flush=True)
    return res


def table(results: dict) -> str:
    impls = [i for i in ("ours", "intree") if i in results]
    both = len(impls) == 2
    head = "| C | metric | " + " | ".join(impls) + (" | ours/intree |" if both else " |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    cs = sorted({c for i in impls for c in results[i].get("runs", {})}, key=int)
    for c in cs:
        for k, label, _ in METRICS:
            vals = [results[i].get("runs", {}).get(c, {}).get(k) for i in impls]
            cells = [f"{v:,.1f}" if isinstance(v, (int, float)) else "–" for v in vals]
            ratio = ""
            if both:
                ratio = f" {vals[0] / vals[1]:.2f} |" if all(isinstance(v, (int, float)) and v for v in vals) \
                    else " – |"
            rows.append(f"| {c} | {label} | " + " | ".join(cells) + (" |" + ratio if ratio else " |"))
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the protocol model, written under --out)")
    p.add_argument("--only", choices=["ours", "intree"], default=None)
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--num-prompts", default="200", help="one number, or one per concurrency")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-gib", type=float, default=24.0, help="--kv-cache-memory-bytes of both sides (GPU)")
    p.add_argument("--storage", choices=["packed", "bf16", "auto"], default="packed")
    p.add_argument("--serve-args", default="", help="more `vllm serve` arguments")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--bench-timeout", type=float, default=900)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model, ours, float32, eager, tiny sizes")
    p.add_argument("--out", default=None)
    p.add_argument("--report", nargs="+", default=None, metavar="DIR",
                   help="only print the table of DIR/serve_results.json (several DIRs: sides merged)")
    a = p.parse_args(argv)
    if a.report:
        merged = {}
        for d in a.report:
            merged.update(json.loads((Path(d) / "serve_results.json").read_text())["results"])
        print(table(merged))
        return 0
    if a.cpu_smoke:
        a.only, a.dtype, a.concurrency, a.num_prompts = "ours", "float32", "1,4", "4,8"
        a.input_len, a.output_len, a.max_model_len = 64, 8, 512
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    n = [int(x) for x in str(a.num_prompts).split(",")]
    a.num_prompts = n * len(a.concurrency) if len(n) == 1 else n
    if len(a.num_prompts) != len(a.concurrency):
        p.error("--num-prompts: one number or one per concurrency")
    out = Path(a.out or (Path(os.environ["OUT"]) / "serve" if os.environ.get("OUT") else "bench_serve_out"))
    out.mkdir(parents=True, exist_ok=True)
    model = Path(a.model) if a.model else protocol_model(out, a.cpu_smoke)
    summary_path = out / "serve_results.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"results": {}}
    for impl in [a.only] if a.only else ["intree", "ours"]:
        summary["results"][impl] = run_side(impl, model, a, out)
        summary_path.write_text(json.dumps(summary, indent=1))
    print("\n" + table(summary["results"]))
    print(f"\nresults: {summary_path}")
    return 0 if all("error" not in r for r in summary["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
