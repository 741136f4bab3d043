"""A tier's counters, kept beside its pool where any process can read them: the chunks each
replica stored and loaded, and how many of its loads another replica had stored.

The vLLM offload tier (``shmkv/vllm/tier.py``) and the SGLang page store
(``shmkv/sglang/region.py``) each keep one counter block in their sibling segment. A block is
``num_rows + 1`` rows of ``ROW_WORDS`` int64 words; row 0 counts the whole node for the life
of the segment, row ``r + 1`` one replica (the vLLM tier's replica row ``r``, the SGLang
store's process-table slot ``r``):

    word 0   key: who the row counts (the vLLM replica key, the SGLang process's pid); 0:
             never used. A new key starts the row from zero.
    word 1   live: 1 while the row's replica holds it (vLLM: its replica row; SGLang: the
             process has the store open), 0 once it left
    word 2   stored: chunks (pages) whose store completed
    word 3   loaded: chunks whose load began (pinned for the copy)
    word 4   cross_replica_hits: of those, chunks another row had stored
    5..7     unused (a row is one 64-byte line)

The vLLM tier's table also keeps a label per replica row (``LABEL_DTYPE`` at
``OFFLOAD_LABELS_OFFSET``, after the counter block): the replica's DP rank, vLLM engine id
and engine core pid, which name its row in ``shmkv stats``, ``shmkv inspect`` and the
``shmkv_tier_*`` metrics (``shmkv/vllm/tier.py`` says how it is written).

Written under the pool lock by the row's processes (row 0 by all); read without it by
:func:`read_tier_counts` (aligned 8-byte words: a reader sees each one whole). The producer of a
chunk is advice: a row reused by another replica reads as the same producer.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from dataclasses import dataclass, field

import numpy as np

from shmkv.pool import layout as L
from shmkv.pool.liveness import pid_alive
from shmkv.pool.segment import file_type

ROW_WORDS = 8
ROW_BYTES = 8 * ROW_WORDS
C_KEY, C_LIVE, C_STORED, C_LOADED, C_CROSS = range(5)
COUNTER_NAMES = ("stored", "loaded", "cross_replica_hits")

# Where each tier keeps its block (the layout of both segments is their modules'; these are
# the facts a reader needs, beside their versions and magics in layout.py).
OFFLOAD_COUNTERS_OFFSET = 4096  # right after the tier table's 4 KiB header
OFFLOAD_MAX_REPLICAS = 64
OFFLOAD_REPLICA_KEYS_WORD = 16  # the tier table's replica keys: words 16..79
OFFLOAD_VERSION_WORD = 1  # TIER_VERSION | num_chunks << 32
OFFLOAD_REPLICA_FILE_WORD = 10  # the inode of the tier's replica lock file (shmkv/vllm/tier.py)
SGLANG_HEADER = struct.Struct("<QI4xQQQQ")  # magic, version, pages, page bytes, id len, rows
SGLANG_HEADER_BYTES = 4096
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def block_bytes(num_rows: int) -> int:
    """The bytes of a counter block of ``num_rows`` replica rows (and the node row)."""
    return ROW_BYTES * (num_rows + 1)


# The vLLM offload tier's replica labels, right after its counter block: one record per
# replica row, naming the replica as vLLM does (what each field means, who writes it and how
# an engine id too long for its field is cut: ``shmkv/vllm/tier.py``).
OFFLOAD_LABELS_OFFSET = OFFLOAD_COUNTERS_OFFSET + block_bytes(OFFLOAD_MAX_REPLICAS)
ENGINE_ID_BYTES = 112
NO_DP_RANK = -1  # a label's dp_rank when its replica did not say
LABEL_DTYPE = np.dtype([("key", "<i8"), ("dp_rank", "<i4"), ("core_pid", "<i4"),
                        ("engine_id", f"S{ENGINE_ID_BYTES}")])
assert LABEL_DTYPE.itemsize == 128 and OFFLOAD_LABELS_OFFSET % 64 == 0


def sglang_counters_offset(num_pages: int, page_bytes: int) -> int:
    """Where the SGLang store's counter block starts: after its pages, 64-byte aligned."""
    end = SGLANG_HEADER_BYTES + num_pages * page_bytes
    return (end + 63) // 64 * 64


def reset_row(words, row: int, key: int) -> bool:
    """Gives row ``row`` (1-based: 0 is the node) to ``key``, from zero if it counted
    another (pool lock held), and marks it live; True if it counted another."""
    base = row * ROW_WORDS
    other = words[base + C_KEY] != key
    if other:
        for i in range(ROW_WORDS):
            words[base + i] = 0
        words[base + C_KEY] = key
    words[base + C_LIVE] = 1
    return other


def row_preference(words, free_rows: list[int], key: int) -> list[int]:
    """``free_rows`` (0-based replica rows) in the order a joining ``key`` should take them:
    the row that last counted ``key``, then rows never used, then the others, so a gone
    replica's counts stay shown as long as rows are to spare."""
    def rank(r: int) -> int:
        held = words[(r + 1) * ROW_WORDS + C_KEY]
        return 0 if held == key else 1 if held == 0 else 2
    return sorted(free_rows, key=rank)


def add(words, row: int, what: int, count: int) -> None:
    """Adds ``count`` to counter ``what`` of row ``row`` and of the node (pool lock held)."""
    if count:
        words[what] += count
        words[row * ROW_WORDS + what] += count


@dataclass
class TierCounts:
    """A tier's counters and chunks at one instant (``shmkv stats``, ``shmkv inspect``)."""

    kind: str  # "vLLM offload tier" or "SGLang page store"
    unit: str  # "chunks" or "pages"
    num_chunks: int
    chunks_with_data: int = 0  # holding a key: complete, or being stored
    chunks_storing: int = 0  # of them, still being stored
    chunks_held: int = 0  # pinned for a load, or held by their storer
    stored: int = 0
    loaded: int = 0
    cross_replica_hits: int = 0
    # replica: row, replica (its key in hex; SGLang: "pid N"), dp_rank, engine_id, pid (None:
    # not known), live, counters
    rows: list[dict] = field(default_factory=list)


def _planted(path: str, what: str) -> str:
    return (f"tier: {path} is {what}: not read (not shmkv's: another user or program made "
            "it; its owner, or root, can remove it)")


def _open(path: str) -> tuple[int | None, str | None]:
    """(descriptor, None) of a tier file that is a regular file of this user, opened without
    following a link or blocking; (None, a note naming the path and what it is) for anything
    else at the path; (None, None) if there is nothing there."""
    try:
        fd = os.open(path, _READ)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        try:
            what = file_type(os.lstat(path).st_mode)
        except OSError:
            what = "unreadable"
        return None, _planted(path, f"{what} ({exc.strerror})")
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        return None, _planted(path, f"unreadable ({exc.strerror})")
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None, _planted(path, f"{file_type(st.st_mode)}, not a regular file")
    if st.st_uid != os.geteuid():
        os.close(fd)
        return None, _planted(path, f"owned by uid {st.st_uid}, not by this user "
                                    f"(uid {os.geteuid()})")
    return fd, None


class TierFiles:
    """A pool's tier files (the vLLM offload tier's table, the SGLang page store), opened and
    judged before the pool lock is taken: nothing that could wait runs under the node-wide
    lock, and :func:`read_tier_counts` only reads them. Anything other than a regular file of
    this user at a tier's path (a FIFO, a directory, a link, another user's file: /dev/shm is
    world-writable) is not read; ``notes`` name each. The offload tier's replica lock file is
    opened too: a replica row is live only while a process holds its byte. Close it (or use
    it as a context manager)."""

    def __init__(self, pool_name: str) -> None:
        self.notes: list[str] = []
        self.fds: dict[str, int] = {}
        try:
            for kind, version in (("offload", L.OFFLOAD_TIER_VERSION),
                                  ("sglang", L.SGLANG_STORE_VERSION)):
                fd, note = _open("/dev/shm" + L.sibling_segment_name(kind, pool_name, version))
                if fd is not None:
                    self.fds[kind] = fd
                if note:
                    self.notes.append(note)
            fd, note = _open(L.offload_replicas_path(pool_name))
            if fd is not None:
                self.fds["replicas"] = fd
            if note:
                self.notes.append(note)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> TierFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pread(fd: int | None, size: int, offset: int) -> bytes | None:
    if fd is None:
        return None
    try:
        return os.pread(fd, size, offset)
    except OSError:
        return None


def _owned_by(head: bytes, owner_offset: int, pool_id: bytes) -> bool:
    if len(head) < owner_offset + L.OWNER_DTYPE.itemsize:
        return False
    rec = np.frombuffer(head, L.OWNER_DTYPE, 1, owner_offset)[0]
    return int(rec["owner_magic"]) == L.OWNER_MAGIC and bytes(rec["pool_id"]) == pool_id


def _rows(block: bytes, num_rows: int) -> np.ndarray:
    if len(block) < block_bytes(num_rows):
        return np.zeros((num_rows + 1, ROW_WORDS), np.int64)
    return np.frombuffer(block, np.int64, (num_rows + 1) * ROW_WORDS).reshape(-1, ROW_WORDS)


_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86_64 / aarch64


def _row_held(replicas_fd: int | None, recorded_inode: int):
    """``held(row)``: whether a process holds replica row ``row``'s byte of the tier's replica
    lock file (``F_OFD_GETLK``: the kernel drops a killed process's locks at once); None
    when that cannot be told (no file, or not the one the tier recorded: a replaced file
    never makes a live replica read as gone)."""
    if replicas_fd is None or not recorded_inode:
        return None
    try:
        if os.fstat(replicas_fd).st_ino != recorded_inode:
            return None
    except OSError:
        return None

    def held(row: int) -> bool:
        probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, row, 1, 0)
        answer = fcntl.fcntl(replicas_fd, fcntl.F_OFD_GETLK, probe)
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK

    return held


def _offload(fd: int | None, pool_id: bytes, replicas_fd: int | None = None
             ) -> TierCounts | None:
    labels_end = OFFLOAD_LABELS_OFFSET + OFFLOAD_MAX_REPLICAS * LABEL_DTYPE.itemsize
    head = _pread(fd, labels_end, 0)
    if head is None or len(head) < labels_end:
        return None
    words = np.frombuffer(head, np.int64, OFFLOAD_COUNTERS_OFFSET // 8)
    version = int(words[OFFLOAD_VERSION_WORD])
    if (int(words[0]) & (2**64 - 1) != L.OFFLOAD_TIER_MAGIC
            or version & 0xFFFF_FFFF != L.OFFLOAD_TIER_VERSION
            or not _owned_by(head, L.OFFLOAD_TIER_OWNER_OFFSET, pool_id)):
        return None
    rows = _rows(head[OFFLOAD_COUNTERS_OFFSET:], OFFLOAD_MAX_REPLICAS)
    keys = words[OFFLOAD_REPLICA_KEYS_WORD:OFFLOAD_REPLICA_KEYS_WORD + OFFLOAD_MAX_REPLICAS]
    labels = np.frombuffer(head, LABEL_DTYPE, OFFLOAD_MAX_REPLICAS, OFFLOAD_LABELS_OFFSET)
    out = TierCounts("vLLM offload tier", "chunks", version >> 32)
    held = _row_held(replicas_fd, int(words[OFFLOAD_REPLICA_FILE_WORD]))
    for r in range(OFFLOAD_MAX_REPLICAS):
        row = rows[r + 1]
        if row[C_KEY]:
            # a row stays marked until another replica reaps it; its processes' lock on the
            # row's byte goes with the last of them (a SIGKILL included)
            live = (bool(row[C_LIVE]) and int(keys[r]) == int(row[C_KEY])
                    and (held is None or held(r)))
            entry = _row_dict(r, f"{int(row[C_KEY]) & (2**64 - 1):016x}", live, row)
            label = labels[r]
            if int(label["key"]) == int(row[C_KEY]):  # the label of the replica counted
                dp_rank = int(label["dp_rank"])
                entry["dp_rank"] = None if dp_rank == NO_DP_RANK else dp_rank
                entry["engine_id"] = bytes(label["engine_id"]).decode("utf-8", "replace") or None
                entry["pid"] = int(label["core_pid"]) or None
            out.rows.append(entry)
    _totals(out, rows[0])
    return out


def _sglang(fd: int | None, pool_id: bytes) -> TierCounts | None:
    head = _pread(fd, SGLANG_HEADER_BYTES, 0)
    if head is None or len(head) < SGLANG_HEADER_BYTES:
        return None
    magic, version, num_pages, page_bytes, _, num_rows = SGLANG_HEADER.unpack_from(head, 0)
    if (magic != L.SGLANG_STORE_MAGIC or version != L.SGLANG_STORE_VERSION
            or not _owned_by(head, L.SGLANG_STORE_OWNER_OFFSET, pool_id)):
        return None
    block = _pread(fd, block_bytes(num_rows), sglang_counters_offset(num_pages, page_bytes))
    rows = _rows(block or b"", num_rows)
    out = TierCounts("SGLang page store", "pages", num_pages)
    for r in range(num_rows):
        row = rows[r + 1]
        if row[C_KEY]:
            pid = int(row[C_KEY])
            live = bool(row[C_LIVE]) and pid_alive(pid)
            entry = _row_dict(r, f"pid {pid}", live, row)
            entry["pid"] = pid
            out.rows.append(entry)
    _totals(out, rows[0])
    return out


def _row_dict(row: int, who: str, live: bool, words: np.ndarray) -> dict:
    return {"row": row, "replica": who, "dp_rank": None, "engine_id": None, "pid": None,
            "live": live, "stored": int(words[C_STORED]), "loaded": int(words[C_LOADED]),
            "cross_replica_hits": int(words[C_CROSS])}


def row_name(row: dict) -> str:
    """How ``shmkv stats`` and ``shmkv inspect`` name a replica row: ``dp 1 engine-a_dp1
    pid 4242`` (what its label says: an engine id with spaces or control characters is
    quoted), or its key when it says nothing (an SGLang row: ``pid 4242``)."""
    parts = []
    if row.get("dp_rank") is not None:
        parts.append(f"dp {row['dp_rank']}")
    engine_id = row.get("engine_id")
    if engine_id:
        plain = engine_id.isprintable() and not any(c.isspace() for c in engine_id)
        parts.append(engine_id if plain else repr(engine_id))
    if row.get("pid"):
        parts.append(f"pid {row['pid']}")
    return " ".join(parts) or row["replica"]


def _totals(out: TierCounts, node: np.ndarray) -> None:
    out.stored = int(node[C_STORED])
    out.loaded = int(node[C_LOADED])
    out.cross_replica_hits = int(node[C_CROSS])


def read_tier_counts(pool, files: TierFiles | None = None) -> TierCounts | None:
    """The counters of the tier whose chunks ``pool`` (an attached ``BlockPool``) describes
    (the vLLM offload tier's table, or the SGLang page store), and its chunks by state; None
    when the pool has no tier of this shmkv's version, only one left by an earlier pool of
    its name, or something else at the tier's path (``files.notes`` names it). Reads the
    pool's block rows: call it with the pool lock held for one instant's figures, and with
    ``files`` (the pool's :class:`TierFiles`) opened before the lock was taken; without
    ``files`` it opens (and closes) them itself."""
    if files is None:
        with TierFiles(pool.pool_name) as opened:
            return read_tier_counts(pool, opened)
    pool_id = bytes(pool.header_snapshot()["pool_id"])
    out = (_offload(files.fds.get("offload"), pool_id, files.fds.get("replicas"))
           or _sglang(files.fds.get("sglang"), pool_id))
    if out is None:
        return None
    rows = pool.block_rows()
    keyed = rows["hash_num_tokens"][1:] != L.NO_HASH_TOKENS
    out.chunks_with_data = int(keyed.sum())
    out.chunks_storing = int((keyed & ((rows["group_id"][1:] & L.PENDING_GROUP_BIT) != 0)).sum())
    out.chunks_held = int((rows["ref_cnt"][1:] > 0).sum())
    del rows, keyed
    return out


__all__ = ["COUNTER_NAMES", "ENGINE_ID_BYTES", "LABEL_DTYPE", "NO_DP_RANK", "ROW_WORDS",
           "TierCounts", "TierFiles", "add", "block_bytes", "read_tier_counts", "reset_row",
           "row_name", "row_preference", "sglang_counters_offset"]
