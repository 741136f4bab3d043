"""vLLM's OpenAI server with ``--data-parallel-size 2`` and the shared tier, on vLLM's CPU
build: data-parallel rank 1 loads a prefix rank 0 stored (its /metrics count the chunks as
cross-replica hits) and generates the tokens rank 0 computed cold; a SIGKILLed engine core
takes the whole server down (vLLM's behaviour), the tier survives it, and the restarted
server is warm; SIGTERM stops it cleanly, leaving no chunk held."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.vllm_engine.engines import ROOT, end_process_group, engine_env
from tests.vllm_engine.test_engine_tier import BLOCK, FULL_BLOCK_TOKENS, P
from tests.vllm_engine.tier_check import tier_report

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900), pytest.mark.long]
START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, python: str, model: str, pool: str, log_path) -> None:
        self.port = _free_port()
        self.model = model
        extra = {"spec_name": "SharedCPUOffloadingSpec", "spec_module_path": "shmkv.vllm",
                 "cpu_bytes_to_use": 64 << 20, "shmkv_pool": pool}
        kv = {"kv_connector": "SharedOffloadingConnector",
              "kv_connector_module_path": "shmkv.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}
        self._log = open(log_path, "ab")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), "--data-parallel-size", "2",
             "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BLOCK),
             "--max-model-len", "736", "--num-gpu-blocks-override", "24", "--enforce-eager",
             "--enable-prompt-tokens-details", "--max-num-seqs", "4",
             "--kv-transfer-config", json.dumps(kv)],
            stdout=self._log, stderr=subprocess.STDOUT, env=engine_env(), cwd=str(ROOT),
            start_new_session=True)

    def _get(self, path: str, timeout: float = 10) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                    timeout=timeout) as r:
            return r.read()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log_tail()}"
            try:
                self._get("/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        raise TimeoutError(f"server not healthy in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def complete(self, prompt: list[int], rank: int) -> tuple[list[int], int]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": 8,
                           "temperature": 0.0, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", data=body,
            headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        details = answer["usage"].get("prompt_tokens_details") or {}
        return answer["choices"][0]["token_ids"], int(details.get("cached_tokens") or 0)

    def metric(self, prefix: str) -> dict[str, float]:
        text = self._get("/metrics").decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith(prefix)}

    def engine_core_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid), "-f", "EngineCore"],
                             capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = open(self.log_path, errors="replace").read().splitlines()
        return "\n".join(line[:400] for line in text[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.returncode
        end_process_group(self.proc)
        if not self._log.closed:
            self._log.close()
        return code


def test_dp_rank1_hits_what_rank0_stored_and_a_restart_is_warm(vllm_cpu, tiny_model,
                                                               tier_pool, tmp_path):
    server = Server(vllm_cpu, tiny_model, tier_pool, tmp_path / "server.log")
    try:
        server.wait_healthy()
        cold, cached0 = server.complete(P, rank=0)
        assert cached0 == 0
        time.sleep(1.0)  # rank 0's store completes within a step or two
        loaded, cached1 = server.complete(P, rank=1)
        assert cached1 == FULL_BLOCK_TOKENS, server.log_tail()
        assert loaded == cold
        cross = server.metric("shmkv_cross_replica_hit_chunks_total")
        rank1 = sum(v for k, v in cross.items() if 'engine="1"' in k)
        assert rank1 >= FULL_BLOCK_TOKENS // BLOCK, cross

        cores = server.engine_core_pids()
        assert len(cores) == 2, cores
        os.kill(cores[-1], signal.SIGKILL)
        server.proc.wait(timeout=120)  # vLLM stops the whole server when a core dies
    finally:
        server.stop(signal.SIGKILL, timeout=0)

    again = Server(vllm_cpu, tiny_model, tier_pool, tmp_path / "server2.log")
    try:
        again.wait_healthy()
        warm, cached = again.complete(P, rank=0)
        assert cached == FULL_BLOCK_TOKENS, again.log_tail()
        assert warm == cold
        assert again.stop(signal.SIGTERM) == 0, again.log_tail()
    finally:
        again.stop(signal.SIGKILL, timeout=0)
    report = tier_report(tier_pool)
    assert report["held_chunks"] == 0 and report["quarantined_chunks"] == 0, report
    assert report["invariants"] == "ok", report
