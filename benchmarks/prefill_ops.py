"""Torch ops and CPU wall time of one prefill forward of the tiny checkpoints (batched-prefill work).

Usage: PYTHONPATH=$PWD python benchmarks/prefill_ops.py [--arch v4.1-flash] [--shapes 1x2048,8x256,16x128]

One in-process engine (fp32, eager, prefix caching off, a 2048-token step); for each shape NxL it
generates one token for N random prompts of L tokens (one prefill step plus one sampling), first
unprofiled (warm-up), then timed (median of --repeat), then under torch.profiler: the op count is
the number of `aten::` events of that call (sampling and detokenisation are the same for both sides).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="v4.1-flash")
    p.add_argument("--shapes", default="1x2048,8x256,16x128")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model", default=None, help="checkpoint dir (default: generate the tiny one)")
    a = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_deepinfer.tools.make_checkpoint import make_checkpoint

    model = a.model or make_checkpoint(a.arch, "tiny", os.path.join(tempfile.mkdtemp(), a.arch), seed=0)
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=4096,
              max_num_batched_tokens=2048, max_num_seqs=16, enable_prefix_caching=False, seed=0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for shape in a.shapes.split(","):
        n, length = (int(v) for v in shape.split("x"))

        def call():
            prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, vocab, (length,), generator=gen).tolist())
                       for _ in range(n)]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t0

        call()
        wall = statistics.median(call() for _ in range(a.repeat))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        n_ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
        print(f"{a.arch} {shape}: aten ops {n_ops}, wall {wall * 1e3:.0f} ms (median of {a.repeat})", flush=True)


if __name__ == "__main__":
    main()
