#!/usr/bin/env bash
# Every CUDA test of the project, on a machine with a GPU (under 8 minutes): the pytest
# `gpu` marker (the KV store's copies to and from a GPU against their CPU twin, CUDA IPC,
# GPU block tables, and the shared offload tier's worker-side transfers through vLLM's
# CPUOffloadingWorker), then the GPU benchmark's transfer table (benchmarks/bench_gpu.py:
# its JSON lines also go to benchmarks/results/gpu_transfers.jsonl). Builds the C kernel
# first so the checkout's code is what runs.
#
#   bash scripts/gpu_check.sh [PYTHON] [PYTEST ARGS...]      # default: python
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${1:-python}"
[ $# -gt 0 ] && shift
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" setup.py build_ext --inplace -q
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 120 tests "$@"
mkdir -p benchmarks/results
echo "== benchmarks/bench_gpu.py --part transfers"
rm -f benchmarks/results/gpu_transfers.jsonl
timeout 150 "$PY" benchmarks/bench_gpu.py --part transfers --layouts block_major,layer_major \
    --json benchmarks/results/gpu_transfers.jsonl | grep -v '^{'

