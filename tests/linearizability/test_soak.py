"""The seeded soak: 1,000 recorded multi-process histories (2 to 4 processes, both kernels,
one in ten with a SIGKILL), each replayed through vLLM's BlockPool with no difference."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm.v1.core.block_pool")  # the checker replays on vLLM's own code

from tests.linearizability.soak import soak  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SEED = 20261204


def test_thousand_histories_replay_through_vllm():
    logging.disable(logging.WARNING)
    try:
        result = soak(1000, SEED)
    finally:
        logging.disable(logging.NOTSET)
    print(f"soak seed={SEED}: {result.histories} histories, {result.calls_replayed} calls "
          f"replayed ({result.switches} switches between processes), {result.kills} "
          f"SIGKILLs ({result.rolled_back} holds rolled back, "
          f"{result.ambiguous} of unknown outcome tried both ways), "
          f"{len(result.differences)} differences")
    assert result.histories == 1000 and result.kills >= 100
    assert result.switches > 10 * result.histories  # the processes' calls interleaved
    assert not result.differences, result.differences[:5]
