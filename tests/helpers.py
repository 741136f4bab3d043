"""Test helpers: requests with chained block hashes, and a pool that checks itself."""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass, field

from shmkv import BlockPool

ROOT_HASH = hashlib.sha256(b"shmkv-tests-root").digest()


def chain_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """sha256 chained over full blocks, vLLM style: H((parent, tokens, extra_keys))."""
    out: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (salt,) if salt and start == 0 else None
        block = tuple(token_ids[start:start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, extra), protocol=5)).digest()
        out.append(parent)
    return out


@dataclass
class FakeRequest:
    """The part of a vLLM Request that BlockPool reads."""

    all_token_ids: list[int]
    block_size: int = 16
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_hashes = chain_hashes(self.all_token_ids, self.block_size, self.cache_salt)


def make_request(num_tokens: int, first_token: int = 0, block_size: int = 16,
                 cache_salt: str | None = None) -> FakeRequest:
    return FakeRequest(list(range(first_token, first_token + num_tokens)), block_size, cache_salt)


class CheckedPool:
    """Proxies a BlockPool and runs check_invariants() after every public call."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self.num_checks = 0

    def __getattr__(self, name: str):
        attr = getattr(self._pool, name)
        if name.startswith("_") or not callable(attr) or name in ("check_invariants", "close"):
            return attr

        def checked(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self._pool.check_invariants()
                self.num_checks += 1

        return checked

    @property
    def raw(self) -> BlockPool:
        return self._pool


def free_ids(pool) -> list[int]:
    return pool.get_free_block_ids()


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def segment_image(pool: BlockPool) -> bytes:
    """The segment's bytes, for "this call changed nothing" checks. Masked out: the
    header's ``lock_seq``, which every hold bumps (lock bookkeeping, not pool state), and
    the undo journal's entries, scratch space past ``journal_len`` (which is kept)."""
    image = bytearray(pool._segment.buf)
    offset = pool.layout.view(pool._segment.buf, "header").dtype.fields["lock_seq"][1]
    image[offset:offset + 8] = bytes(8)
    start = pool.layout.offsets["journal"]
    size = 16 * pool.layout.config.journal_entries
    image[start:start + size] = bytes(size)
    return bytes(image)


def interrupt_once_serving(cmd: list[str], *, cwd, env: dict, wait_s: float,
                           settle_s: float = 0.0) -> tuple[int, str, str, int]:
    """Starts ``cmd`` in a new session, waits until its progress line ("requests") shows on
    stderr, waits ``settle_s`` more, then sends SIGINT to its whole process group, as Ctrl-C
    does. A process still running after 60 s is SIGKILLed (the caller's assertions fail).

    Returns:
        (exit code, stdout, stderr, pid of the command).
    """
    import os
    import signal
    import subprocess
    import threading
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=cwd, start_new_session=True)
    seen = threading.Event()
    chunks: list[bytes] = []

    def read_stderr():
        while True:
            b = proc.stderr.read1(4096)
            if not b:
                return
            chunks.append(b)
            if b"requests" in b"".join(chunks):
                seen.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert seen.wait(wait_s), b"".join(chunks).decode()
        time.sleep(settle_s)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    reader.join(10)
    return proc.returncode, stdout.decode(), b"".join(chunks).decode(), proc.pid


def run_leftovers(pid: int) -> list[str]:
    """Entries of /dev/shm made by the serving run of process ``pid`` (every name carries
    ``run<pid>-``)."""
    return sorted(e for e in os.listdir("/dev/shm") if f"run{pid}-" in e)


def pid_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
