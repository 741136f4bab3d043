"""The weights in a vLLM replica's tier identity (``shmkv/vllm/identity.py``), joined to a
real tier table as a GPU worker joins it: a local model directory is named by the digest of
its files, its path shown, not compared, so the same weights at another path share the
tier and other weights of the same sizes and headers are refused; a hub id is compared."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from shmkv.errors import LayoutMismatchError  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm.identity import replica_identity  # noqa: E402
from shmkv.vllm.lifecycle import join_as_worker  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.model_dirs import copy_of, make_model_dir, tuned_copy  # noqa: E402

NUM_CHUNKS = 4
DATA_BYTES = NUM_CHUNKS * os.sysconf("SC_PAGE_SIZE")


def make_identity(model: str) -> dict:
    """The identity of a TP1 replica of ``model`` (a local directory or a hub id), from
    vLLM's config as ``replica_identity`` reads it."""
    group = SimpleNamespace(layer_names=["model.layers.0.self_attn.attn"])
    spec = SimpleNamespace(
        config=SimpleNamespace(groups=[group], model=SimpleNamespace(dtype="float16"),
                               kv_cache_layout="NHD", canonical_layout=False),
        tokens_per_block=[16], tokens_per_hash=16, blocks_per_chunk=1,
        kv_bytes_per_chunk=4096, cpu_page_size_per_worker=4096, num_chunks=NUM_CHUNKS,
        replicated_layout=False)
    model_config = SimpleNamespace(model=model, revision=None, hf_overrides=None,
                                   quantization=None, dtype="float16")
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                               decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               world_size=1)
    cache = SimpleNamespace(block_size=16, prefix_caching_hash_algo="sha256")
    return replica_identity(spec, SimpleNamespace(model_config=model_config,
                                                  cache_config=cache, parallel_config=parallel))


@pytest.fixture
def join():
    """Joins replicas of one tier as their GPU workers do (identity checked, then recorded
    by the first); at teardown every hold is closed and the tier removed."""
    name = unique_pool_name("wid")
    holds: list = []

    def replica(engine_id: str, model: str) -> None:
        locks, _ = join_as_worker(name, NUM_CHUNKS, 16, engine_id, DATA_BYTES,
                                  identity=make_identity(model))
        holds.append(locks)

    yield replica
    for locks in holds:
        locks.close()
    SharedCPUOffloadingManager.unlink(name)
    assert not [e for e in os.listdir("/dev/shm") if name in e]


def test_the_same_weights_at_another_path_join_the_tier(join, tmp_path):
    """A replica serving a copy of the tier's model directory at another path joins."""
    model = make_model_dir(str(tmp_path / "model"))
    join("A", model)
    join("B", copy_of(model, str(tmp_path / "mnt" / "model")))


def test_other_weights_of_the_same_sizes_and_headers_are_refused(join, tmp_path):
    """A copy whose shard differs in a sampled window (same names, sizes and headers) is
    refused naming model_files with both digests; both paths are shown, not compared."""
    model = make_model_dir(str(tmp_path / "model"))
    tuned = tuned_copy(model, str(tmp_path / "tuned"))
    join("A", model)
    with pytest.raises(LayoutMismatchError) as info:
        join("B", tuned)
    text = str(info.value)
    mine, theirs = make_identity(tuned)["model_files"], make_identity(model)["model_files"]
    assert mine != theirs
    assert (f"(model_files: this replica {mine!r}, the tier {theirs!r}; model_dir: this "
            f"replica {tuned!r}, the tier {model!r} (model_dir shown, not compared))") in text


def test_another_hub_id_is_refused(join):
    """A hub id is compared: a replica of another id is refused naming it; the same id
    joins."""
    join("A", "org/base")
    join("B", "org/base")
    with pytest.raises(LayoutMismatchError,
                       match=r"\(model: this replica 'org/instruct', the tier 'org/base'\)"):
        join("C", "org/instruct")
