"""Graph keys for trimmed verification steps (`patches/varlen_graphs.py`) on vLLM's own dispatcher and engine
config: the plain-decode keys sit beside vLLM's uniform 1 + k keys, and every decode-only step (at most 1 + k
tokens per request) up to the largest key finds the smallest graph that holds it. The capture and replay
themselves need CUDA (`tests/gpu/test_spec_decode_gpu.py` runs varlen with graphs on the H200)."""

from __future__ import annotations

import itertools

from tests.conftest import tiny_checkpoint

K = 2  # speculative tokens: uniform verification steps have 3 tokens per request
MAX_SEQS = 16


def _dispatcher(ckpt):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cfg = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=256, gpu_memory_utilization=0.2,
                     max_num_seqs=MAX_SEQS, speculative_config={"method": "dspark", "num_speculative_tokens": K},
                     ).create_engine_config()
    cc = cfg.compilation_config
    cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    cc.cudagraph_capture_sizes = [3, 6, 12, 24, 48]  # vLLM's sizes with speculation: multiples of 1 + k
    cc.max_cudagraph_capture_size = 48
    d = CudagraphDispatcher(cfg)
    d.initialize_cudagraph_keys(CUDAGraphMode.FULL_DECODE_ONLY, 1 + K)
    return d


def test_plain_decode_sizes():
    from vllm_deepinfer.patches.varlen_graphs import plain_decode_sizes

    assert plain_decode_sizes(16) == [1, 2, 4, 8, 16]
    assert plain_decode_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert plain_decode_sizes(3) == [1, 2, 3]


def test_every_decode_only_step_finds_the_smallest_graph(ckpt_root):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from vllm_deepinfer.patches.varlen_graphs import add_plain_keys, pick_graph, plain_decode_sizes

    d = _dispatcher(tiny_checkpoint(ckpt_root, "v4.1-flash", 0, drafter="reproduce"))
    vllm_keys = set(d.cudagraph_keys[CUDAGraphMode.FULL])
    assert BatchDescriptor(num_tokens=12, num_reqs=4, uniform=True) in vllm_keys  # vLLM's 4 x (1 + k)
    added = add_plain_keys(d, plain_decode_sizes(MAX_SEQS))
    keys = set(d.cudagraph_keys[CUDAGraphMode.FULL])
    assert added == {BatchDescriptor(num_tokens=s, num_reqs=s, uniform=True) for s in (1, 2, 4, 8, 16)}
    assert keys == vllm_keys | added
    # every decode-only step of r requests with 1..1 + k tokens each
    for r in range(1, MAX_SEQS + 1):
        for t in range(r, r * (1 + K) + 1):
            desc = pick_graph(keys, t, r)
            assert desc is not None and desc.num_tokens >= t and desc.num_reqs >= r, (t, r)
            smaller = [b for b in keys if t <= b.num_tokens < desc.num_tokens and b.num_reqs >= r]
            assert not smaller, (t, r, desc, smaller)
    # all drafts trimmed: the plain-decode graph of the batch size (rounded up), as without speculation
    assert pick_graph(keys, 1, 1) == BatchDescriptor(num_tokens=1, num_reqs=1, uniform=True)
    assert pick_graph(keys, 5, 5) == BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True)
    # 16 requests, 40 tokens: only vLLM's 48 = 16 x 3 key holds 16 requests
    assert pick_graph(keys, 40, 16) == BatchDescriptor(num_tokens=48, num_reqs=16, uniform=True)
    assert pick_graph(keys, 49, 16) is None and pick_graph(keys, 8, 17) is None
    # LoRA keys are never picked
    lora = BatchDescriptor(num_tokens=2, num_reqs=2, uniform=True, has_lora=True, num_active_loras=1)
    assert pick_graph(itertools.chain(keys, [lora]), 2, 2) == BatchDescriptor(num_tokens=2, num_reqs=2, uniform=True)
