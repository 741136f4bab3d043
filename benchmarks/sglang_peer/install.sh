#!/usr/bin/env bash
# Installs SGLang 0.5.23's HiCache storage layer (HiCacheStorage, HiCacheFile,
# StorageBackendFactory) into the CURRENT Python environment, CPU only, without SGLang's
# heavy dependency list, so shmkv's SGLang backend tests and benchmark run against it.
# torch 2.13.0 (CPU) must be installed first; this never installs a CUDA build.
#
#   bash benchmarks/sglang_peer/install.sh [PYTHON]      # default: python
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${1:-python}"
pip_install() { "$PY" -m pip install --no-deps --disable-pip-version-check -q "$@"; }
"$PY" -c "import torch" >/dev/null 2>&1 || pip_install "torch==2.13.0"
pip_install "sglang==0.5.23"
# The few packages SGLang's storage layer imports, with their own (small, pure-Python)
# dependencies: IPython needs pygments, jedi, prompt_toolkit, ... and none pulls torch.
"$PY" -m pip install --disable-pip-version-check -q -r "$HERE/requirements.txt"
"$PY" -W ignore "$HERE/check_imports.py"
