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

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
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


def make_scheduler(pool: str, model_dir: str, cpu_bytes: int = 1 << 20) -> Scheduler:
    """vLLM's Scheduler with the OffloadingConnector and shmkv's spec on pool ``pool``."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto",
                                 enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": "SharedCPUOffloadingSpec",
                                       "spec_module_path": "shmkv.vllm",
                                       "cpu_bytes_to_use": cpu_bytes, "shmkv_pool": pool}),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=len(LAYERS) * NUM_GPU_BLOCKS * PAGE_BYTES,
                                        layers=LAYERS, layer_stride=NUM_GPU_BLOCKS * PAGE_BYTES,
                                        block_stride=PAGE_BYTES)],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16, dtype=torch.float16))],
    )
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
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
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


def first_replica(pool: str, model_dir: str, prompt: list[int], to_parent) -> None:
    """Replica 0 (its own process): serves the prompt once, offloading it, then leaves."""
    scheduler = make_scheduler(pool, model_dir)
    result = run_request(scheduler, "replica0-req0", prompt)
    scheduler.connector.shutdown()
    to_parent.put(result)
