"""A real vLLM 0.33.0 ``Scheduler`` with the ``OffloadingConnector`` over shmkv's shared
tier, built on CPU from a local model config directory (no weights, no tokenizer).

There is no GPU worker here, so :func:`run_request` plays the worker's part of the
protocol: each step it reports every load and store job of the step's connector metadata
as completed (``OffloadingWorkerMetadata``), loads as received, and samples one token per
scheduled request. No KV bytes move; what the test looks at is the scheduler side: which
prefix chunks the connector loads from the tier, and from which chunk ids.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PAGE_BYTES = 2 * BLOCK_SIZE * 4 * 16 * 2  # K and V, 16 tokens, 4 heads of 16, fp16
EOS_TOKEN_ID = 999


def write_model_dir(path: str) -> str:
    """A two-layer Llama config.json: all vLLM's ModelConfig needs to inspect a model."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
                   "max_position_embeddings": 2048, "torch_dtype": "float16"}, f)
    return path


def make_vllm_config(pool: str, model_dir: str, cpu_bytes: int = 1 << 20, *,
                     engine_id: str | None = None, connector: str = "SharedOffloadingConnector",
                     model: dict | None = None, parallel: dict | None = None,
                     start: str = "0", dp_index: int | None = None) -> VllmConfig:
    """vLLM's config of one replica on shmkv's tier ``pool``: ``model`` and ``parallel``
    are extra ``ModelConfig`` / ``ParallelConfig`` arguments (quantization, hf_overrides,
    tensor_parallel_size, ...); ``engine_id`` names the replica (its workers share it).
    ``dp_index``: the replica's data-parallel rank, set as vLLM's engine core sets it in
    each DP rank's process (``parallel_config.data_parallel_index = dp_rank``; a dense
    model's ranks each run with ``data_parallel_rank`` 0).

    vLLM makes a config's instance id once per engine start and hands that config to the
    engine core and its workers; here the core and its workers build configs of their own
    (in their own processes), so a replica's engine start is named by ``start``, the same
    for its core and workers and another for a restart."""
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=1024, **(model or {})),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto",
                                 enable_prefix_caching=True),
        parallel_config=ParallelConfig(**(parallel or {})),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_role="kv_both", engine_id=engine_id,
            kv_connector_module_path="shmkv.vllm" if connector != "OffloadingConnector"
            else None,
            kv_connector_extra_config={"spec_name": "SharedCPUOffloadingSpec",
                                       "spec_module_path": "shmkv.vllm",
                                       "cpu_bytes_to_use": cpu_bytes, "shmkv_pool": pool,
                                       # its schedulers run without GPU workers, unless a
                                       # test starts them (replica_worker)
                                       "shmkv_scheduler_only": True}),
        device_config=DeviceConfig("cpu"),
    )
    config.instance_id = f"{engine_id}-start-{start}" if engine_id else config.instance_id
    if dp_index is not None:
        config.parallel_config.data_parallel_index = dp_index
    return config


def make_kv_cache_config() -> KVCacheConfig:
    """The replica's GPU KV cache: two full-attention layers of NUM_GPU_BLOCKS blocks."""
    return KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=len(LAYERS) * NUM_GPU_BLOCKS * PAGE_BYTES,
                                        layers=LAYERS, layer_stride=NUM_GPU_BLOCKS * PAGE_BYTES,
                                        block_stride=PAGE_BYTES)],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16, dtype=torch.float16))],
    )


def make_scheduler(pool: str, model_dir: str, cpu_bytes: int = 1 << 20,
                   **config: Any) -> Scheduler:
    """vLLM's Scheduler with shmkv's connector and spec on pool ``pool`` (``config``: see
    :func:`make_vllm_config`)."""
    vllm_config = make_vllm_config(pool, model_dir, cpu_bytes, **config)
    vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    kv_cache_config = make_kv_cache_config()
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=BLOCK_SIZE, log_stats=True)


def run_request(scheduler: Scheduler, request_id: str, prompt: list[int],
                max_tokens: int = 2) -> dict:
    """Runs one request to its end, completing every transfer job at once.

    Returns:
        the chunk ids the connector loaded from the tier and stored to it, in job order.
    """
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                      pooling_params=None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    scheduler.add_request(request)
    loaded, stored = [], []
    for _ in range(64):
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        worker_meta = OffloadingWorkerMetadata()
        for job_id, job in meta.load_jobs.items():
            loaded += job.src_spec.block_ids.tolist()
            worker_meta.mark_completed(job_id)
        for job_id, job in meta.store_jobs.items():
            stored += job.dst_spec.block_ids.tolist()
            worker_meta.mark_completed(job_id)
        ids = list(out.num_scheduled_tokens)
        # vLLM 0.34 derives the index from req_ids (no req_id_to_index argument).
        index = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}
                 if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {})
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, **index,
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving={job.req_id for job in meta.load_jobs.values()} or None,
                kv_connector_worker_meta=worker_meta),
        ))
        if not scheduler.requests:
            break
    else:
        raise AssertionError(f"request {request_id} did not finish in 64 steps")
    return {"loaded": loaded, "stored": stored}


def serving_core(pool: str, model_dir: str, engine_id: str, dp_index: int,
                 prompt: list[int], to_parent, from_parent) -> None:
    """A replica's engine core (DP rank ``dp_index``): serves the prompt once, offloading
    it, reports (its pid, what it loaded and stored) and stays until told "exit"."""
    scheduler = make_scheduler(pool, model_dir, engine_id=engine_id, dp_index=dp_index)
    result = run_request(scheduler, f"{engine_id}-req0", prompt)
    to_parent.put((os.getpid(), result))
    assert from_parent.get(timeout=300) == "exit"
    scheduler.connector.shutdown()


def first_replica(pool: str, model_dir: str, prompt: list[int], to_parent) -> None:
    """Replica 0 (its own process): serves the prompt once, offloading it, then leaves."""
    scheduler = make_scheduler(pool, model_dir)
    result = run_request(scheduler, "replica0-req0", prompt)
    scheduler.connector.shutdown()
    to_parent.put(result)


# ---------------------------------------------------------------------------- half-done jobs


def _report(scheduler: Scheduler, out, worker_meta: OffloadingWorkerMetadata,
            finished_recving: set[str] | None = None) -> None:
    ids = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=KVConnectorOutput(finished_recving=finished_recving or None,
                                              kv_connector_worker_meta=worker_meta),
    ))


def step_until_jobs(scheduler: Scheduler, request_id: str | None, prompt: list[int] = (),
                    want: str = "store", max_steps: int = 16) -> tuple[list[int], list[int]]:
    """Adds a request (unless ``request_id`` is None) and steps until the connector has
    jobs of kind ``want`` ("store" or "load") in flight, reporting none of them done (the
    GPU workers are still moving their bytes); the other kind is reported done at once.

    Returns:
        (the chunk ids of those jobs, their job ids); empty after ``max_steps`` without.
    """
    init_none_hash(sha256)
    if request_id is not None:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
            pooling_params=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256)))
    for _ in range(max_steps):
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        worker_meta = OffloadingWorkerMetadata()
        held = meta.store_jobs if want == "store" else meta.load_jobs
        for job_id in meta.load_jobs if want == "store" else meta.store_jobs:
            worker_meta.mark_completed(job_id)
        chunks = [b for job in held.values()
                  for b in (job.dst_spec if want == "store" else job.src_spec).block_ids.tolist()]
        recving = {j.req_id for j in meta.load_jobs.values()} if want == "store" else None
        _report(scheduler, out, worker_meta, recving)
        if chunks:
            return chunks, list(held)
    return [], []


def step_until_stores(scheduler: Scheduler, request_id: str,
                      prompt: list[int]) -> tuple[list[int], list[int]]:
    """:func:`step_until_jobs` for stores, which must come."""
    chunks, jobs = step_until_jobs(scheduler, request_id, prompt, "store")
    assert chunks, f"request {request_id} stored nothing in 16 steps"
    return chunks, jobs


def report_jobs_done(scheduler: Scheduler, job_ids: list[int]) -> None:
    """One step in which the workers report ``job_ids`` done."""
    out = scheduler.schedule()
    worker_meta = OffloadingWorkerMetadata()
    for job_id in job_ids:
        worker_meta.mark_completed(job_id)
    _report(scheduler, out, worker_meta)


def storing_replica(pool: str, model_dir: str, engine_id: str, prompt: list[int],
                    want: str, cpu_bytes: int, to_parent, from_parent, start: str = "0") -> None:
    """A replica's engine core that starts storing (or loading: ``want``) ``prompt`` and
    leaves the jobs in flight; then, on command: "reset" (vLLM's reset_prefix_cache with
    the connector), "done" (its workers report the jobs done), "exit". ``start``: see
    :func:`make_vllm_config`."""
    scheduler = make_scheduler(pool, model_dir, cpu_bytes, engine_id=engine_id, start=start)
    chunks, jobs = step_until_jobs(scheduler, f"{engine_id}-req0", prompt, want)
    to_parent.put(chunks)
    while (command := from_parent.get(timeout=120)) != "exit":
        if command == "reset":
            to_parent.put(scheduler.reset_prefix_cache(reset_connector=True))
        elif command == "done":
            report_jobs_done(scheduler, jobs)
            to_parent.put("done")
    scheduler.connector.shutdown()


def worker_spec(pool: str, model_dir: str, cpu_bytes: int = 1 << 20, **config: Any):
    """The spec one GPU worker of a replica builds: vLLM's worker-side connector, built as
    vLLM's worker builds it (its config current), over shmkv's spec."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.vllm import SharedOffloadingConnector

    vllm_config = make_vllm_config(pool, model_dir, cpu_bytes, **config)
    with set_current_vllm_config(vllm_config):
        connector = SharedOffloadingConnector(vllm_config, KVConnectorRole.WORKER,
                                              make_kv_cache_config())
    return connector.connector_worker.spec


def replica_worker(pool: str, model_dir: str, engine_id: str, cpu_bytes: int, to_parent,
                   from_parent, rank: int = 0, start: str = "0",
                   dp_index: int | None = None) -> None:
    """A replica's GPU worker: joins the replica, maps the tier's data region (what vLLM's
    create_worker does on a GPU) and, on command, writes or reads chunks of it:
    ("write", chunk ids, one byte value per chunk), ("read", chunk ids) -> the first
    bytes of each, "exit". ``start``, ``dp_index``: see :func:`make_vllm_config`."""
    spec = worker_spec(pool, model_dir, cpu_bytes, engine_id=engine_id, start=start,
                       dp_index=dp_index)
    region = spec.open_data_region(rank)
    view = np.asarray(region.create_kv_memoryview())  # [chunk, byte]
    to_parent.put(("ready", spec.num_chunks, spec.kv_bytes_per_chunk))
    while (command := from_parent.get(timeout=300)) != "exit":
        if command[0] == "write":
            for chunk, value in zip(command[1], command[2], strict=True):
                view[chunk, :] = value
            to_parent.put("written")
        elif command[0] == "read":
            to_parent.put([view[chunk, :16].tobytes() for chunk in command[1]])
    del view
    region.cleanup()
