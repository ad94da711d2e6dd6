"""Where a decode step's small device ops come from: the torch ops the model issues outside its kernel interface.

Usage: PYTHONPATH=$PWD python benchmarks/decode_glue.py [--arch v4.1-flash] [--batch 4] [--top 40]

On CUDA each `vllm_deepinfer.ops` call that `kernels_nvidia` implements is one kernel; everything else the model
runs is a torch op, i.e. (mostly) one small kernel each: index arithmetic, masks, copies, cos/sin. On the H100 at
batch 64 those were ~0.4 ms of a 6.4 ms step (`benchmarks/results/gpu-1207c/compact_profile_b64.out`). This runs
the tiny checkpoint on vLLM's CPU engine (in-process, fp32, eager), records every aten op of the decode forwards
of --batch requests with a TorchDispatchMode, and attributes each to the innermost `vllm_deepinfer` source line;
ops inside an interface call that has a `kernels_nvidia` kernel count as that one kernel instead. Printed: per
decode step, the op count by source line (the lines to fuse or remove first), and the totals.
Caveat: vLLM's own layers (fused MoE, parallel linears) run their CPU forms here, counted at our line that calls them.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

PKG = os.sep + "vllm_deepinfer" + os.sep
INTERFACE = os.path.join("vllm_deepinfer", "ops", "__init__.py")
FREE = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
        "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::slice", "aten::select", "aten::as_strided",
        "aten::detach", "aten::alias", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk",
        "aten::narrow", "aten::flatten", "aten::unflatten", "aten::view_as", "aten::_reshape_alias",
        "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::lift_fresh",
        "aten::sym_size", "aten::sym_stride", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
        "aten::numel", "aten::dim", "aten::size", "aten::stride", "aten::contiguous", "aten::diagonal"}


def _site(kernel_ops: frozenset[str]) -> tuple[str, str] | None:
    """(kind, source) of the op being dispatched now: ("kernel", interface function) when inside an
    interface call that kernels_nvidia implements, ("ours", file:line function) for our model code (and
    for vLLM code reached from it); None outside the model."""
    f = sys._getframe(2)
    ours = None
    while f is not None:
        name = f.f_code.co_filename
        if name.endswith(INTERFACE) and f.f_code.co_name in kernel_ops:
            return "kernel", f"ops.{f.f_code.co_name}"
        if PKG in name and ours is None:
            rel = name[name.index(PKG) + 1:]
            if not rel.startswith(os.path.join("vllm_deepinfer", "ops")):
                ours = f"{rel}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return None if ours is None else ("ours", ours)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="v4.1-flash")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--tokens", type=int, default=6, help="decode steps recorded (after the first)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--model", default=None, help="checkpoint dir (default: generate the tiny one)")
    a = p.parse_args()
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kernels_nvidia.ops import OPS
    from vllm_deepinfer.models.deepseek import DeepseekModel
    from vllm_deepinfer.tools.make_checkpoint import make_checkpoint

    import vllm_deepinfer.ops as ops

    kernel_ops = frozenset(OPS)
    counts: collections.Counter = collections.Counter()
    steps, recording = [0], [False]

    def counted(name, fn):
        def call(*args, **kwargs):
            if recording[0]:
                counts[("kernel", f"ops.{name}", "")] += 1
            return fn(*args, **kwargs)
        return call

    for name in kernel_ops:
        if hasattr(ops, name):
            setattr(ops, name, counted(name, getattr(ops, name)))

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = f"aten::{func.overloadpacket.__name__}"
            if name not in FREE and not (args and out is args[0] and name == "aten::to"):  # a cast to its own dtype
                site = _site(kernel_ops)
                if site is not None and site[0] == "ours":
                    counts[(site[0], site[1], name)] += 1
            return out

    forward = DeepseekModel.forward

    def recorded(self, input_ids, positions):
        if input_ids.shape[0] != a.batch or not steps[0] < a.tokens + 1:
            return forward(self, input_ids, positions)
        steps[0] += 1
        if steps[0] == 1:  # the first decode step builds caches of metadata: not counted
            return forward(self, input_ids, positions)
        recording[0] = True
        try:
            with Record():
                return forward(self, input_ids, positions)
        finally:
            recording[0] = False

    DeepseekModel.forward = recorded
    model = a.model or make_checkpoint(a.arch, "tiny", os.path.join(tempfile.mkdtemp(), a.arch), seed=0)
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, gpu_memory_utilization=0.2,
              max_num_batched_tokens=2048, max_num_seqs=a.batch, enable_prefix_caching=False, seed=0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(a.prompt_len)])
               for i in range(a.batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=a.tokens + 3, ignore_eos=True), use_tqdm=False)
    n = max(1, steps[0] - 1)
    kinds: collections.Counter = collections.Counter()
    for (kind, _, _), c in counts.items():
        kinds[kind] += c
    print(f"{a.arch}, batch {a.batch}, {n} decode steps recorded: per step "
          + ", ".join(f"{k} {v / n:.0f}" for k, v in sorted(kinds.items()))
          + "  (kernel: interface calls that kernels_nvidia implements; ours: other torch ops in our code)")
    by_site: collections.Counter = collections.Counter()
    ops_at: dict = collections.defaultdict(collections.Counter)
    for (kind, src, op), c in counts.items():
        if kind == "ours":
            by_site[src] += c
            ops_at[src][op] += c
    print(f"\ntop {a.top} source lines by torch ops per decode step:")
    for src, c in by_site.most_common(a.top):
        ops = ", ".join(f"{o.removeprefix('aten::')} {v / n:.0f}" for o, v in ops_at[src].most_common(4))
        print(f"  {c / n:6.1f}  {src}  [{ops}]")


if __name__ == "__main__":
    main()
