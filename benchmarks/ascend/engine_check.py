"""End-to-end checks of the Ascend 950 platform in vLLM (run by validate.sh; needs the NPU).

    python benchmarks/ascend/engine_check.py --json OUT.json

1. vLLM resolved `current_platform` to our Ascend950Platform (the entry point is installed and active).
2. ACL graphs: the tiny V4.1 checkpoint (bf16) generates 32 greedy tokens for three prompts eagerly and
   with decode graphs (FULL_DECODE_ONLY, capture sizes 1/2/4); the tokens must be identical.
Correctness against independent references is the fidelity test suite (validate.sh runs it on the NPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.conftest import engine, tiny_checkpoint  # noqa: E402
from tests.fidelity import prompt_ids  # noqa: E402


def _greedy(model: Path, prompts: list[list[int]], **overrides) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with engine(model, dtype="bfloat16", **overrides) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    from vllm.platforms import current_platform

    from kernels_ascend.platform import PLATFORM_QUALNAME

    got = f"{type(current_platform).__module__}.{type(current_platform).__name__}"
    rows = [dict(check="vLLM platform", ok=got == PLATFORM_QUALNAME, detail=got)]
    if rows[0]["ok"]:
        root = Path(tempfile.mkdtemp(prefix="ascend-check-"))
        model = tiny_checkpoint(root, "v4.1-flash", 0, index_topk=16, candidate_topk_blocks=4, candidate_block_size=8)
        prompts = [prompt_ids(model, n, 0) for n in (37, 300, 1000)]
        eager = _greedy(model, prompts)
        graphs = _greedy(model, prompts, enforce_eager=False,
                         compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})
        same = sum(e == g for e, g in zip(eager, graphs))
        rows.append(dict(check="ACL graphs: decode tokens == eager (bf16, 3 prompts x 32)",
                         ok=same == len(prompts), detail=f"{same}/{len(prompts)} identical"))
    for r in rows:
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['check']}: {r['detail']}")
    with open(a.json, "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
