"""Two Pareto plots from a `vllm bench sweep serve` experiment directory.

    python benchmarks/plot_sweep.py EXPERIMENT_DIR

Reads every `SERVE-<s>-BENCH-<b>/run=N.json` (averaging runs of one combination) and writes
* `pareto_prefill.png`: uncached input throughput (input tok/s) vs latency (mean TTFT, ms), for bench
  combinations named `prefill*` (output length 1, random prompts: nothing is prefix-cached);
* `pareto_decode.png`: output throughput per device (tok/s) vs per-user speed
  (output throughput / max_concurrency, tok/s/user), for combinations named `decode*`.
Each serve configuration is one colour; its Pareto frontier is drawn as a step line.
Also writes `points.csv` with the plotted numbers.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DIR_RE = re.compile(r"SERVE-+(?P<serve>.+?)-BENCH-+(?P<bench>.+)")


def load(exp: Path) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for f in sorted(exp.rglob("run=*.json")):
        m = DIR_RE.fullmatch(f.parent.name)
        if not m:
            continue
        groups[(m["serve"], m["bench"])].append(json.loads(f.read_text()))
    points = []
    for (serve, bench), runs in groups.items():
        def avg(key: str) -> float:
            vals = [float(r[key]) for r in runs if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        users = runs[0].get("max_concurrency") or 1
        devices = 1
        for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            devices *= int(runs[0].get(k) or 1)
        input_tput = avg("total_input_tokens") / avg("duration")
        points.append({
            "serve": serve, "bench": bench, "runs": len(runs), "max_concurrency": users, "devices": devices,
            "input_tok_s": input_tput, "mean_ttft_ms": avg("mean_ttft_ms"),
            "output_tok_s_per_device": avg("output_throughput") / devices,
            "tok_s_per_user": avg("output_throughput") / users,
            "mean_tpot_ms": avg("mean_tpot_ms"), "completed": avg("completed"),
        })
    return points


def frontier(xs, ys, maximize_x: bool, maximize_y: bool):
    """Pareto-optimal points (sorted by x)."""
    pts = sorted(zip(xs, ys), key=lambda p: (p[0] if maximize_x else -p[0]), reverse=True)
    best, out = None, []
    for x, y in pts:
        if best is None or (y > best if maximize_y else y < best):
            out.append((x, y))
            best = y
    return sorted(out)


def plot(points, kind: str, out: Path) -> None:
    if kind == "prefill":
        xk, yk = "input_tok_s", "mean_ttft_ms"
        xl, yl, title = "uncached input throughput (tok/s)", "mean TTFT (ms)", "Prefill Pareto"
        maxx, maxy = True, False
    else:
        xk, yk = "tok_s_per_user", "output_tok_s_per_device"
        xl, yl, title = "per-user speed (output tok/s/user)", "output throughput (tok/s per device)", "Decode Pareto"
        maxx, maxy = True, True
    sel = [p for p in points if p["bench"].startswith(kind)]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    for i, serve in enumerate(sorted({p["serve"] for p in sel})):
        ps = [p for p in sel if p["serve"] == serve]
        color = f"C{i}"
        ax.scatter([p[xk] for p in ps], [p[yk] for p in ps], color=color, label=serve, zorder=3)
        for p in ps:
            ax.annotate(p["bench"].removeprefix(kind + "_"), (p[xk], p[yk]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
        fr = frontier([p[xk] for p in ps], [p[yk] for p in ps], maxx, maxy)
        if len(fr) > 1:
            ax.step([x for x, _ in fr], [y for _, y in fr], where="post", color=color, alpha=0.6)
    ax.set_xlabel(xl)
    ax.set_ylabel(yl)
    ax.set_title(f"{title} ({len(sel)} points)")
    ax.grid(alpha=0.3)
    if sel:
        ax.legend(title="serve config")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str]) -> int:
    exp = Path(argv[1] if len(argv) > 1 else ".")
    points = load(exp)
    if not points:
        print(f"no run=*.json results under {exp}", file=sys.stderr)
        return 1
    with open(exp / "points.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(points[0]))
        w.writeheader()
        w.writerows(points)
    for kind in ("prefill", "decode"):
        plot(points, kind, exp / f"pareto_{kind}.png")
        print(f"wrote {exp / f'pareto_{kind}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
