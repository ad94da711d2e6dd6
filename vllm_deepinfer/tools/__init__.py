"""Command-line tools of vllm-deepinfer (`python -m vllm_deepinfer.tools.make_checkpoint ...`)."""
