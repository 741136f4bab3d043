#!/usr/bin/env bash
# Installs one vLLM release's own KV-cache layer (BlockPool, KVCacheManager, coordinators, specs,
# Request, KV events) into the CURRENT Python environment, CPU only, without vLLM's heavy
# dependency list, so shmkv's differential tests and benchmarks can run it side by side.
# Install torch 2.13.0 first, a CPU build (never a CUDA one); without torch, the script
# installs PyPI's default build.
#
#   bash benchmarks/vllm_peer/install.sh [PYTHON]      # default: python
#   VLLM_VERSION=0.34.0 bash benchmarks/vllm_peer/install.sh [PYTHON]
#
# VLLM_VERSION picks the release (default 0.33.0); each tested one is listed in
# shmkv/vllm/compat.py. requirements.txt holds what every release needs;
# requirements-<release>.txt, where present, adds what that release needs beyond it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${1:-python}"
pip_install() { "$PY" -m pip install --no-deps --disable-pip-version-check -q "$@"; }
"$PY" -c "import torch" >/dev/null 2>&1 || pip_install "torch==2.13.0"
VERSION="${VLLM_VERSION:-0.33.0}"
pip_install "vllm==$VERSION"
pip_install -r "$HERE/requirements.txt"
if [ -f "$HERE/requirements-$VERSION.txt" ]; then
    pip_install -r "$HERE/requirements-$VERSION.txt"
fi
"$PY" -W ignore "$HERE/check_imports.py"
