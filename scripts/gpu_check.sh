#!/usr/bin/env bash
# Every CUDA test of the project, on a machine with a GPU (under 8 minutes): the pytest
# `gpu` marker (pinned KV store copies, CUDA IPC, GPU block tables, and the shared offload
# tier's worker-side transfers through vLLM's CPUOffloadingWorker). Builds the C kernel
# first so the checkout's code is what runs.
#
#   bash scripts/gpu_check.sh [PYTHON]      # default: python
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${1:-python}"
[ $# -gt 0 ] && shift
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" setup.py build_ext --inplace -q
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 450 "$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 120 tests "$@"
