"""A real vLLM engine (``vllm.LLM``) with or without the shared tier, driven by JSON lines on
stdin; runs in the vLLM environment (``scripts/install_vllm_cpu.sh``), never in the process
that drives it (``bench_vllm_engine.py``, ``tests/vllm_engine/``). One command per line, one
JSON answer per line on stdout (vLLM's logs go to stderr):

    {"op": "generate", "prompts": [[token ids]], "max_tokens": 8}
        -> {"tokens": [[ids]], "num_cached_tokens": [n], "ttft_s": [seconds]}
    {"op": "pids"}    -> {"engine_core": pid, "workers": [pids]}
    {"op": "metrics"} -> {"name{labels}": value} of the shared tier's and vLLM's counters
    {"op": "exit"}

Usage: python engine_driver.py MODEL_DIR '{"tier": "POOL" or null, "engine_id": ...,
    "block_size": 16, "num_gpu_blocks": 48, "cpu_bytes": N, "executor": "mp"|"uni"}'

Also: ``python vllm_engine_driver.py --make-model DIR [hidden [layers [vocab]]]`` writes a
random Llama (default: hidden 256, 2 layers, vocab 512).
"""

from __future__ import annotations

import json
import os
import sys

ENGINE_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # with a connector vLLM CPU reserves a core
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
}


def engine_env(root: str) -> dict[str, str]:
    """The environment a driver process runs in: one torch thread, every core vLLM's,
    quiet logs, shmkv importable from ``root`` (the repository)."""
    return {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(root)}


def make_model(path: str, hidden: int = 256, layers: int = 2, vocab: int = 512) -> int:
    """A random Llama (no tokenizer: prompts are token ids; head size 64), seeded, saved
    to ``path``; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = hidden // 64
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=
                         8 * hidden // 3 // 64 * 64, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=4096, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def make_llm(model: str, opts: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if opts.get("tier"):
        extra = {"spec_name": "SharedCPUOffloadingSpec", "spec_module_path": "shmkv.vllm",
                 "cpu_bytes_to_use": int(opts["cpu_bytes"]), "shmkv_pool": opts["tier"]}
        kv_transfer = KVTransferConfig(
            kv_connector="SharedOffloadingConnector", kv_connector_module_path="shmkv.vllm",
            kv_role="kv_both", engine_id=opts.get("engine_id"),
            kv_connector_extra_config=extra)
    return LLM(
        model=model, skip_tokenizer_init=True, dtype=opts.get("dtype", "float32"),
        block_size=opts.get("block_size", 16), max_model_len=opts.get("max_model_len", 2048),
        num_gpu_blocks_override=opts.get("num_gpu_blocks"), enforce_eager=True,
        enable_prefix_caching=True, max_num_seqs=opts.get("max_num_seqs", 8),
        max_num_batched_tokens=opts.get("max_num_batched_tokens", 2048),
        distributed_executor_backend=opts.get("executor", "mp"),
        kv_transfer_config=kv_transfer, disable_log_stats=False, seed=0,
    )


def generate(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
            "ttft_s": [float(o.metrics.first_token_latency) if o.metrics else None
                       for o in outs]}


def pids() -> dict:
    """The engine core (this process's child) and the workers under it."""
    import psutil

    me = psutil.Process()
    children = me.children(recursive=True)
    core = [c for c in children if c.ppid() == me.pid and "EngineCore" in " ".join(
        [c.name()] + c.cmdline())]
    core_pid = core[0].pid if core else (children[0].pid if children else None)
    workers = [c.pid for c in children if c.pid != core_pid and "Worker" in c.name()]
    return {"engine_core": core_pid, "workers": workers,
            "all": [(c.pid, c.name()) for c in children]}


def metrics() -> dict:
    """The shared tier's Prometheus samples in this process's registry (vLLM's offline
    ``get_metrics`` lists only ``vllm:`` names), and vLLM's offload and prefix counters."""
    from prometheus_client import REGISTRY

    out = {}
    for family in REGISTRY.collect():
        if not (family.name.startswith("shmkv") or "kv_offload" in family.name
                or "prefix_cache" in family.name):
            continue
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def main() -> None:
    if sys.argv[1] == "--make-model":
        print(json.dumps({"parameters": make_model(sys.argv[2],
                                                   *(int(a) for a in sys.argv[3:]))}))
        return
    model, opts = sys.argv[1], json.loads(sys.argv[2])
    # The answers keep the original stdout; everything else (vLLM logs to stdout, and the
    # engine core and workers inherit it) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    llm = make_llm(model, opts)
    print(json.dumps({"ready": True, "pid": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            answer = generate(llm, cmd["prompts"], cmd.get("max_tokens", 8))
        elif op == "pids":
            answer = pids()
        elif op == "metrics":
            answer = metrics()
        elif op == "exit":
            break
        else:
            answer = {"error": f"unknown op {op!r}"}
        print(json.dumps(answer), file=out, flush=True)
    del llm


if __name__ == "__main__":
    main()
