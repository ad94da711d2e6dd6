"""vllm-deepinfer: DeepSeek-V4.1-Flash / V4-Flash engine features for stock vLLM 0.32, as plugins.

`from vllm_deepinfer import SamplingParams` gives vLLM's SamplingParams plus DeepInfer's `so_args`
(imported lazily, so the plugin entry point stays cheap).
"""


def __getattr__(name: str):
    if name == "SamplingParams":
        from vllm_deepinfer.serving.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'vllm_deepinfer' has no attribute {name!r}")
