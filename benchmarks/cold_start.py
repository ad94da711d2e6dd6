"""Cold start: seconds from `vllm serve` launch to the first generated token, JIT caches cold and warm.

GPU (one H200, protocol model of bench_e2e.py, dummy weights; one side per device call: in-tree's cold start has
taken 4-9 min on a fresh host, see shared/gpu/README.md):

    python3 benchmarks/cold_start.py --only ours --out $OUT/cold      # then --only intree
    python3 benchmarks/cold_start.py --report DIR [DIR2]

CPU smoke (tiny model, ours):

    python benchmarks/cold_start.py --cpu-smoke --out /tmp/cold_smoke

For each side two launches of the same `vllm serve` command (the served benchmark's: bench_serve.py):
  cold  every JIT / compile cache points at a fresh empty directory under --out/cache-<impl>: HOME (covers
        ~/.cache/vllm incl. torch.compile and DeepGEMM, ~/.triton, ~/.tilelang, ~/.cache/flashinfer),
        VLLM_CACHE_ROOT, TRITON_CACHE_DIR, DG_JIT_CACHE_DIR, TILELANG_CACHE_DIR, FLASHINFER_WORKSPACE_BASE,
        XDG_CACHE_HOME;
  warm  the second launch with the same directories, now filled by the first.
The clock stops when a 1-token completion is answered (polled every 0.5 s). Python imports and the OS page
cache are warm after the first launch on the same host either way; a truly fresh host is only the first call's
cold number. `--serve-args` passes e.g. the default JIT warm-up back (`--kernel-config '{}'`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench_serve import protocol_model
from serve_util import Server, impl_env, serve_cmd, wait_first_token

CACHE_VARS = {"VLLM_CACHE_ROOT": "vllm", "TRITON_CACHE_DIR": "triton", "DG_JIT_CACHE_DIR": "deep_gemm",
              "TILELANG_CACHE_DIR": "tilelang", "FLASHINFER_WORKSPACE_BASE": "flashinfer", "XDG_CACHE_HOME": "xdg"}


def cache_env(root: Path) -> dict:
    env = {"HOME": str(root / "home")}
    env.update({k: str(root / v) for k, v in CACHE_VARS.items()})
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    return env


def launch(impl: str, phase: str, model: Path, a, out: Path) -> dict:
    root = out / f"cache-{impl}"
    if phase == "cold" and root.exists():
        shutil.rmtree(root)
    env = impl_env(impl, a.storage)
    env.update(cache_env(root))
    cmd = serve_cmd(str(model), a.port, a.extra)
    t0 = time.strftime("%T")
    with Server(cmd, env, out / f"{impl}_{phase}.log") as srv:
        s = wait_first_token(srv, a.port, str(model), a.limit)
        tail = None if s is not None else srv.tail()
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"[{impl}] {phase}: " + (f"first token {s:.1f} s" if s is not None else f"no token within {a.limit:.0f} s")
          + f" (started {t0}; caches now {size / 2**20:.1f} MiB)", flush=True)
    if tail:
        print(tail, flush=True)
    return {"first_token_s": s, "limit_s": a.limit, "cache_mib": round(size / 2 ** 20, 1)}


def table(results: dict) -> str:
    rows = ["| side | cold s | warm s | JIT cache MiB |", "|---|---|---|---|"]
    fmt = lambda r: f"{r['first_token_s']:.1f}" if r.get("first_token_s") is not None else f"> {r.get('limit_s')}"  # noqa: E731
    for impl, r in results.items():
        if "cold" in r and "warm" in r:
            rows.append(f"| {impl} | {fmt(r['cold'])} | {fmt(r['warm'])} | {r['warm']['cache_mib']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the protocol model, written under --out)")
    p.add_argument("--only", choices=["ours", "intree"], default=None)
    p.add_argument("--storage", choices=["packed", "bf16", "auto"], default="packed")
    p.add_argument("--serve-args", default=None, help="`vllm serve` arguments (default: the served benchmark's)")
    p.add_argument("--limit", type=float, default=540, help="seconds per launch")
    p.add_argument("--port", type=int, default=8012)
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--report", nargs="+", default=None, metavar="DIR", help="print the table (DIRs merged)")
    a = p.parse_args(argv)
    if a.report:
        merged = {}
        for d in a.report:
            merged.update(json.loads((Path(d) / "cold_start.json").read_text()))
        print(table(merged))
        return 0
    out = Path(a.out or (Path(os.environ["OUT"]) / "cold" if os.environ.get("OUT") else "cold_start_out"))
    out.mkdir(parents=True, exist_ok=True)
    if a.cpu_smoke:
        a.only = "ours"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        default = "--load-format dummy --dtype float32 --max-model-len 512 --enforce-eager --gpu-memory-utilization 0.2"
    else:
        default = ("--load-format dummy --dtype bfloat16 --max-model-len 4096 --max-num-seqs 128 "
                   f"--no-enable-prefix-caching --kv-cache-memory-bytes {24 * 2 ** 30} "
                   "-cc {\"cudagraph_capture_sizes\":[1,2,4,8,16,32,64,128]} "
                   "--kernel-config {\"enable_jit_warmup\":false,\"enable_flashinfer_autotune\":false}")
    a.extra = (a.serve_args if a.serve_args is not None else default).split()
    model = Path(a.model) if a.model else protocol_model(out, a.cpu_smoke)
    path = out / "cold_start.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for impl in [a.only] if a.only else ["ours", "intree"]:
        results[impl] = {phase: launch(impl, phase, model, a, out) for phase in ("cold", "warm")}
        results[impl]["serve_args"] = a.extra
        path.write_text(json.dumps(results, indent=1))
    print("\n" + table(results))
    return 0 if all(r[ph]["first_token_s"] is not None for r in results.values() for ph in ("cold", "warm")) else 1


if __name__ == "__main__":
    sys.exit(main())
