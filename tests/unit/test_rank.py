"""The rank's pieces in one process: ModelRunner steps (the tables must show the step the
message names), and a RankClient talking to a rank over shmkv.messages channels."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from shmkv.errors import ProtocolError, SegmentExistsError, UsageError  # noqa: E402
from shmkv.messages import Channel, ExecuteModel, ModelOutput  # noqa: E402
from shmkv.ranks.block_table import KVStore, SharedBlockTables  # noqa: E402
from shmkv.serve.model import TinyModelConfig, TinyTransformer  # noqa: E402
from shmkv.serve.rank import (  # noqa: E402
    ModelRunner,
    RankClient,
    ScheduledRequest,
    create_rank_channels,
    from_rank_channel,
    to_rank_channel,
    unlink_rank_channels,
)
from tests.conftest import unique_pool_name  # noqa: E402


@pytest.fixture
def name():
    n = unique_pool_name("rank")
    yield n
    unlink_rank_channels(n)
    SharedBlockTables.unlink(n)
    KVStore.unlink(n)
    assert [e for e in os.listdir("/dev/shm") if n in e] == []


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
        step = ExecuteModel(step=0, requests=[ScheduledRequest("r", 1, prompt, 0)])
        first = runner.execute(step)
        assert first == TinyTransformer(config).reference_generate(prompt, 1)
        tables.commit(1)
        with pytest.raises(ProtocolError, match="step 0 was sent but the block tables show step 1"):
            runner.execute(step)
        assert runner.execute(ExecuteModel(step=2, requests=[])) == []
    finally:
        runner.close()
        tables.close()
        kv.close()
    with pytest.raises(UsageError, match="KV-cache groups"):
        ModelRunner(name, name, TinyModelConfig(sliding_window=(None, None, None)))
    with pytest.raises(UsageError, match=r"the KV store has .* the model needs \(3, 1, 16"):
        ModelRunner(name, name, TinyModelConfig(num_heads=4, num_kv_heads=1))


def test_rank_client_sends_steps_and_reports_a_failed_rank(name):
    """RankClient's side of the protocol, with this test playing the rank."""
    create_rank_channels(name)
    with pytest.raises(SegmentExistsError):
        create_rank_channels(name)
    client = RankClient(name)
    inbox, outbox = Channel.open(to_rank_channel(name)), Channel.open(from_rank_channel(name))
    try:
        outbox.send(ModelOutput(step=0, sampled_token_ids=[7, 8]))
        assert client.execute(0, [ScheduledRequest("a", 0, [1], 0)]) == [7, 8]
        got = inbox.recv(5)
        assert isinstance(got, ExecuteModel) and got.requests[0].req_id == "a"
        outbox.send(ModelOutput(step=1, sampled_token_ids=[], error="RuntimeError: boom"))
        with pytest.raises(ProtocolError, match="rank failed at step 1: RuntimeError: boom"):
            client.execute(1, [])
        outbox.send(ModelOutput(step=5, sampled_token_ids=[1]))
        with pytest.raises(ProtocolError, match="expected ModelOutput for step 2"):
            client.execute(2, [])
        with pytest.raises(ProtocolError, match="no answer from the rank to step 3"):
            client.execute(3, [], timeout_s=0.05)
    finally:
        client.close()
        inbox.close()
        outbox.close()
