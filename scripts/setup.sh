#!/usr/bin/env bash
# Installs everything the project needs on a fresh CPU machine (2 cores, no GPU).
# torch is pinned to the local CPU build first, so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]" 2>/dev/null || python -m pip install -q -e .
python -c "import torch, triton, transformers; print('setup: torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
