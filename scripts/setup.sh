#!/usr/bin/env bash
# Installs everything the project needs on a fresh CPU machine (2 cores, no GPU, Debian, Python 3.11).
# torch is pinned to the local CPU build first, so nothing pulls a multi-GB CUDA build.
# Each step says what it installs before it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { echo "setup [$1/4] $2" >&2; }
step 1 "installing torch 2.13.0 (CPU build) with pip"
python -m pip install -q "torch==2.13.0"
step 2 "installing ssm-harness (editable) and its dependencies: triton, transformers, pandas, jinja2, pytest, hypothesis, pytest-benchmark, pytest-xdist"
python -m pip install -q -e .
# pyenv installs need a rehash for the new `harness` console script to be on PATH
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
# Headless Chromium renders the HTML report in the report suite (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    step 3 "installing chromium (Debian package, for the report's browser tests) with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "setup: could not install chromium; the report's browser test will be skipped" >&2
  else
    echo "setup: chromium missing and apt-get unavailable (not root?); the report's browser test will be skipped" >&2
  fi
else
  step 3 "chromium already installed"
fi
step 4 "checking the installed versions"
python -c "import torch, triton, transformers; print('setup: torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
