"""Offline inference with vLLM's `LLM()` on DeepInfer's embedded tiny DeepSeek-V4.1-Flash model.

The checkpoint (random weights, real DeepSeek format) is generated on first use; no download.

    python examples/offline_inference.py [--model DIR] [--max-tokens N]
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny V4.1 model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_deepinfer.tools.make_checkpoint import ensure_demo_checkpoint

    model = args.model or str(ensure_demo_checkpoint())
    llm = LLM(model=model, gpu_memory_utilization=0.2, max_model_len=4096, enforce_eager=True)
    prompts = ["The capital of France is", "DeepSeek-V4.1 runs on vLLM because"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params):
        print(f"prompt: {out.prompt!r}\noutput: {out.outputs[0].text!r}\n")
    chat = llm.chat([{"role": "user", "content": "Say hello."}], params)
    print(f"chat output: {chat[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
