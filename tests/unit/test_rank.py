"""The rank's pieces in one process: messages and their transport, and ModelRunner steps
(the tables must show the step the message names)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shmkv.block_table import KVStore, SharedBlockTables  # noqa: E402
from shmkv.errors import ProtocolError, SegmentExistsError, UsageError  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer  # noqa: E402
from shmkv.serve.rank import (  # noqa: E402
    Channel,
    ExecuteStep,
    ModelRunner,
    RankReady,
    ScheduledRequest,
    StepDone,
    decode,
    encode,
)
from tests.conftest import unique_pool_name  # noqa: E402


@pytest.fixture
def name():
    n = unique_pool_name("rank")
    yield n
    Channel.unlink(n)
    SharedBlockTables.unlink(n)
    KVStore.unlink(n)


def test_messages_round_trip_and_bad_bytes_are_a_protocol_error():
    msg = ExecuteStep(3, [ScheduledRequest("r1", 2, [5, 6], 10)])
    assert decode(encode(msg)) == msg
    assert decode(encode(StepDone(3, [7]))) == StepDone(3, [7])
    with pytest.raises(ProtocolError, match="not a rank message"):
        decode(b"\x93garbage")
    with pytest.raises(ProtocolError):
        decode(encode(msg).replace(b"execute_step", b"execute_stop"))


def test_channel_carries_messages_and_refuses_oversized_ones(name):
    tx = Channel.create(name, "torank")
    try:
        with pytest.raises(SegmentExistsError):
            Channel.create(name, "torank")
        rx = Channel.open(name, "torank")
        tx.send(RankReady(42))
        assert rx.recv(timeout_s=5) == RankReady(42)
        with pytest.raises(UsageError, match="encodes to .* bytes"):
            tx.send(ExecuteStep(0, [ScheduledRequest("r", 0, list(range(1000, 5000)), 0)]))
        with pytest.raises(UsageError, match="direction"):
            Channel.open(name, "sideways")
        rx.close()
    finally:
        tx.close()


def test_model_runner_executes_a_step_and_checks_its_number(name):
    config = TinyModelConfig()
    tables = SharedBlockTables.create(name, max_num_reqs=2, max_model_len=32,
                                      block_sizes=[4, 4])
    kv = KVStore.create(name, num_layers=3, num_blocks=20, block_size=4, num_kv_heads=2,
                        head_size=16)
    runner = ModelRunner(name, name, config)
    try:
        prompt = [4, 8, 15, 16, 23, 42]
        tables.add_row(([1, 2], [3, 4]), 1)
        tables.commit(0)
        step = ExecuteStep(0, [ScheduledRequest("r", 1, prompt, 0)])
        first = runner.execute(step)
        assert first == TinyTransformer(config).reference_generate(prompt, 1)
        tables.commit(1)
        with pytest.raises(ProtocolError, match="step 0 was sent but the block tables show step 1"):
            runner.execute(step)
        assert runner.execute(ExecuteStep(2, [])) == []
    finally:
        runner.close()
        tables.close()
        kv.close()
    with pytest.raises(UsageError, match="KV-cache groups"):
        ModelRunner(name, name, TinyModelConfig(sliding_window=(None, None, None)))
    with pytest.raises(UsageError, match=r"the KV store has .* the model needs \(3, 1, 16"):
        ModelRunner(name, name, TinyModelConfig(num_heads=4, num_kv_heads=1))
