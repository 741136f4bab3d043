#!/usr/bin/env bash
# Every CUDA test of the project, on a machine with a GPU (under 8 minutes; 24 with vLLM): the pytest
# `gpu` marker (the KV store's copies to and from a GPU against their CPU twin, CUDA IPC,
# GPU block tables, and the shared offload tier's worker-side transfers through vLLM's
# CPUOffloadingWorker), the GPU benchmark's transfer table (benchmarks/bench_gpu.py: its
# JSON lines also go to benchmarks/results/gpu_transfers.jsonl), `shmkv run` of the small
# model in float32 on the GPU (0 token mismatches or a red run), and the benchmark's serve
# part (shared device placement vs private pools vs the host placement), and, where vLLM
# 0.33.0's CUDA build is installed, the real-engine tests (tests/vllm_engine/: the shared
# tier inside vLLM engines) and the router benchmark's quick run (vLLM servers behind SGLang's
# smg, where sglang-router is installed). Each step has its own time limit (240 + 90 + 60 + 90
# + 600 + 600 s).
# Builds the C kernel first so the checkout's code is what runs.
#
#   bash scripts/gpu_check.sh [PYTHON] [PYTEST ARGS...]      # default: python
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${1:-python}"
[ $# -gt 0 ] && shift
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" setup.py build_ext --inplace -q
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 120 tests "$@"
mkdir -p benchmarks/results
echo "== benchmarks/bench_gpu.py --part transfers"
rm -f benchmarks/results/gpu_transfers.jsonl
timeout 90 "$PY" benchmarks/bench_gpu.py --part transfers --layouts block_major,layer_major \
    --json benchmarks/results/gpu_transfers.jsonl | grep -v '^{'

echo "== shmkv run --device cuda --model small --dtype float32 (0 token mismatches)"
timeout 60 "$PY" -m shmkv run --device cuda --model small --dtype float32 --no-compare \
    --plot '' --json benchmarks/results/gpu_run_fp32.json
echo "== benchmarks/bench_gpu.py --part serve"
rm -f benchmarks/results/gpu_transfers.serve.jsonl
timeout 90 "$PY" benchmarks/bench_gpu.py --part serve --json benchmarks/results/gpu_transfers.jsonl \
    | grep -v '^{'
echo "== tests/vllm_engine: real vLLM engines with the shared tier (vLLM's CUDA build)"
if "$PY" -c "import sys, vllm; sys.exit(vllm.__version__.split('+')[0] != '0.33.0')" 2>/dev/null; then
    SHMKV_VLLM_PYTHON="$(command -v "$PY")" timeout 600 "$PY" -m pytest -q -m engine \
        -p no:cacheprovider tests/vllm_engine "$@"
    echo "== benchmarks/bench_vllm_router.py --quick: vLLM servers behind SGLang's smg, private tiers against one shared tier"
    if "$PY" -c "import sglang_router" 2>/dev/null; then
        timeout 600 "$PY" benchmarks/bench_vllm_router.py --quick --python "$(command -v "$PY")" \
            --plot '' --json benchmarks/results/gpu_vllm_router.jsonl \
            | grep -v '^{'
    else
        echo "skipped: no sglang-router in this Python (pip install sglang-router==0.3.2)"
    fi
else
    echo "skipped: no vLLM 0.33.0 in this Python (pip install vllm==0.33.0 on the GPU machine)"
fi
