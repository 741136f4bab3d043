"""Whose is each shmkv object in /dev/shm, and which ones ``shmkv cleanup`` may remove.

Ownership comes only from what the objects record (``shmkv/pool/layout.py``, "Sibling
segments"): a pool's process table and creator pid; a sibling segment's owner record (its
creator's pid and start time, and the pool it belongs to: name, creator pid and inode); a
channel's header, which names its doorbell. A name says only where to look, never whose an
object is.

The rules (issue 15, item 6, and issue 21):

- a pool is removed only when every process attached to it is dead and its creator is dead
  (or died creating it), and it is not meant to stay; a pool being created, in use, or
  POISONED with a live process (``shmkv recover`` can fix it) stays. Its lock and ``.alive``
  file go with it;
- a pool is meant to stay when its header's ``retention`` says so (``BlockPool.mark_stays``:
  ``shmkv create``, the vLLM offload tier, the SGLang page store, once each is complete), or
  says nothing (a pool made before pools recorded it: kept, to be safe). Such a pool goes
  only by name (``shmkv unlink``), with ``include_idle`` (``shmkv cleanup
  --include-idle``), or with ``idle_for`` once it has been idle that long (``shmkv cleanup
  --idle-for``: idle since a process last joined or left it, ``lifecycle.idle_since``), and
  then only while no live process holds it, whatever its age. A tier (HiSparse's host pool)
  stays while the very pool it is the tier of stays;
- a sibling segment stays while its creator lives, and while the very pool it names stays;
  it is removed once both are gone (its pool gone, re-created under the same name, or
  removed in the same cleanup);
- a channel's doorbell goes with the channel(s) naming it; one no channel names is removed
  after ``DOORBELL_GRACE_S`` (a doorbell is made just before its channels);
- an object of another user, not a regular file, too short, with a torn or foreign header,
  or of another layout version is listed with the reason and left alone.

- a process of another pid namespace is never taken for dead: a slot is judged by its
  lock on the ``.alive`` file (kernel-arbitrated, valid across namespaces), else by its
  pid only when its row records this process's namespace; a pool being created stays while
  its ``.alive`` file is missing, locked, or younger than ``CREATING_GRACE_S``; a sibling's
  creator is alive unless its owner record names this namespace and that pid is gone.

:func:`plan` decides without changing anything (``--dry-run`` and ``shmkv ls`` use it);
:func:`remove` carries a plan out, judging each object again right before removing it (the
same inode, a pool's same ``pool_id``, still to go; otherwise it is left alone). A process
attaching in the instant between that check and the removal keeps working on the unlinked
pool (as after ``shmkv unlink``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import posix_ipc

from shmkv.errors import SegmentNotFoundError, UsageError
from shmkv.pool import layout as L
from shmkv.pool import lifecycle as LC
from shmkv.pool.liveness import own_pid_namespace, pid_alive, process_gone, process_start_ticks

SHM_DIR = "/dev/shm"
DOORBELL_GRACE_S = 60.0
# A pool being created whose liveness file no process holds a lock on: its creator (in any
# pid namespace) may be between making the file and taking its slot for this long.
CREATING_GRACE_S = 60.0
_FLOCK = struct.Struct("hhqqi4x")  # struct flock, as in liveness.py
_DOORBELL_FIELD = L.CHANNEL_HEADER_DTYPE.fields["doorbell"][1]


# ------------------------------------------------------------------ the owner record

def owner_record(pool_name: str | None = None, *, creator: bool = True) -> np.ndarray:
    """The owner record of a new sibling segment made by this process: its pid and start
    time (``creator=False``: none, the segment lives as long as its pool), and the pool it
    belongs to, identified by the pool segment's creator pid and inode.

    Raises:
        SegmentNotFoundError: ``pool_name`` names no pool.
    """
    rec = np.zeros((1,), L.OWNER_DTYPE)
    if creator:
        pid = os.getpid()
        rec["creator_pid"] = pid
        rec["creator_start_ticks"] = process_start_ticks(pid)
        rec["creator_pid_ns"] = own_pid_namespace()
    if pool_name is not None:
        identity = pool_identity(pool_name)
        if identity is None:
            raise SegmentNotFoundError(f"no pool named {pool_name!r} to record as the owner")
        rec["pool_name"] = pool_name.encode()
        rec["pool_creator_pid"], rec["pool_ino"], rec["pool_id"] = identity
    rec["owner_magic"] = L.OWNER_MAGIC
    return rec


# Every read-only open of a path in /dev/shm: never through a link, never blocking (a FIFO
# planted at the path would block a plain O_RDONLY open until a writer came).
_NOBLOCK_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def write_owner(buf, offset: int, record: np.ndarray) -> None:
    """Stores ``record`` at ``offset`` of a sibling segment (before its ``magic``)."""
    np.ndarray((1,), L.OWNER_DTYPE, buffer=buf, offset=offset)[:] = record


def _pool_header(pool_name: str) -> tuple[os.stat_result, np.void] | None:
    """(stat, header) of a pool's segment, read without following a link; None if there is
    none or it is too short for a header."""
    try:
        fd = os.open(SHM_DIR + L.segment_name(pool_name), _NOBLOCK_READ)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a planted FIFO or device: not a pool
            return None
        head = os.pread(fd, L.HEADER_DTYPE.itemsize, 0)
    finally:
        os.close(fd)
    if len(head) < L.HEADER_DTYPE.itemsize:
        return None
    return st, np.frombuffer(head, L.HEADER_DTYPE, count=1)[0]


def pool_identity(pool_name: str) -> tuple[int, int, bytes] | None:
    """(creator pid, inode, ``pool_id``) of a pool's segment now; None if there is no such
    pool."""
    found = _pool_header(pool_name)
    if found is None:
        return None
    st, hdr = found
    return int(hdr["creator_pid"]), int(st.st_ino), bytes(hdr["pool_id"])


# ------------------------------------------------------------------ the plan

@dataclass
class Verdict:
    """One object of /dev/shm and what cleanup does with it."""

    entry: str  # its name in /dev/shm
    kind: str  # pool, lock, liveness, channel, block tables, ..., doorbell, unknown
    name: str  # the pool name, or the sibling's name
    remove: bool
    reason: str
    pool: str | None = None  # the pool it belongs to, if any
    doorbell: str | None = field(default=None, repr=False)  # a channel's, as recorded
    # a pool's: "stays" (marked to stay, or made before pools recorded it), "scoped" (lives
    # while a process holds it), "orphan" (cleanup removes it); "" when it is left alone
    lifetime: str = ""
    idle: bool = False  # a pool meant to stay that no live process holds
    # an idle pool's: when a process last joined or left it (``lifecycle.idle_since``), and
    # whether rows of dead processes say that time may be older than the truth
    idle_since: float | None = None
    idle_since_is_lower_bound: bool = field(default=False, repr=False)
    stays_by: str = ""  # a pool meant to stay: what made it so ("vllm tier", ...)
    memory_bytes: int = 0  # what it takes in /dev/shm (allocated, not its nominal size)
    # what was judged: the object's inode, and a pool's header ``pool_id`` (``remove``
    # removes an object only while the one at its name is still this one, still to go)
    ino: int = field(default=0, repr=False)
    pool_id: bytes = field(default=b"", repr=False)
    # a pool's: the idle time it was judged under (None: idle pools stay; 0: --include-idle)
    idle_for: float | None = field(default=None, repr=False)
    # a doorbell's: the entries of the channels naming it (it goes with them)
    channels: tuple[str, ...] = field(default=(), repr=False)

    @property
    def path(self) -> str:
        return f"{SHM_DIR}/{self.entry}"


def foreign_reason(st: os.stat_result) -> str | None:
    """Why an object at a shmkv name is not this user's shmkv object (not a regular file,
    or another user's), or None if it may be."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file: left alone"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): refused"
    return None


def _any_lock_held(path: str) -> bool:
    """Whether some process holds an OFD (or POSIX) lock on any byte of ``path``."""
    try:
        fd = os.open(path, _NOBLOCK_READ)
    except OSError:
        return False
    try:
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 0, 0))
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK
    except OSError:
        return True  # cannot tell: keep it
    finally:
        os.close(fd)


class _Pool:
    """What cleanup learnt of one pool segment."""

    def __init__(self, verdict: Verdict, creator_pid: int = 0, ino: int = 0,
                 pool_id: bytes = b"", tier_of: bytes = b"") -> None:
        self.verdict = verdict
        self.creator_pid = creator_pid
        self.ino = ino
        self.pool_id = pool_id
        self.tier_of = tier_of
        self.live_pids: list[int] = []  # live processes attached


def _stays_by(retention: int, stays_by: bytes) -> str:
    """What made a pool meant to stay so, in a word or two ("vllm tier", "shmkv create")."""
    if retention == L.RETENTION_STAYS:
        return stays_by.rstrip(bytes(1)).decode(errors="replace")
    return "an older shmkv"


def stays_text(retention: int, stays_by: bytes) -> str | None:
    """Why a pool stays, from its header's `retention` and `stays_by`; None for a pool
    that lives only while a process holds it."""
    if retention == L.RETENTION_STAYS:
        return f"stays (made by {stays_by.rstrip(bytes(1)).decode(errors='replace')})"
    if retention == L.RETENTION_SCOPED:
        return None
    return ("stays (made by a shmkv that did not record whether a pool stays: kept, to be "
            "safe)")


def human_bytes(n: int) -> str:
    """``1.5 GiB``: a size as people read it."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def duration_text(seconds: float) -> str:
    """``45 s``, ``20 min``, ``3.5 h``, ``2.0 d``: a time span as people read it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _idle_text(seconds: float, dead: int) -> str:
    """How long an idle pool has been idle; "up to" when rows of dead processes say its
    last holder may have died after the time recorded (``lifecycle.py``, rule 6)."""
    if dead:
        return (f"idle for up to {duration_text(seconds)} (a process died without leaving: "
                "when is not recorded)")
    return f"idle for {duration_text(seconds)}"


def _assess_pool(entry: str, name: str, st: os.stat_result, include_idle: bool,
                 idle_for: float | None = None, now: float | None = None) -> _Pool:
    pool_id = tier_of = b""

    def keep(reason: str, creator: int = 0, lifetime: str = "") -> _Pool:
        return _Pool(Verdict(entry, "pool", name, False, reason, lifetime=lifetime), creator,
                     st.st_ino, pool_id, tier_of)

    problem = foreign_reason(st)
    if problem:
        return keep(problem)
    try:
        fd = os.open(f"{SHM_DIR}/{entry}", _NOBLOCK_READ)
    except OSError as exc:
        return keep(f"cannot be opened ({exc.strerror}): left alone")
    try:
        head = os.pread(fd, L.HEADER_DTYPE.itemsize, 0)
        if len(head) < L.HEADER_DTYPE.itemsize:
            return keep(f"corrupt: {len(head)} bytes, smaller than a pool header: left alone")
        hdr = np.frombuffer(head, L.HEADER_DTYPE, count=1)[0]
        if int(hdr["magic"]) != L.MAGIC:
            if int(hdr["magic"]) == 0:
                return keep("no header yet (being created, or its creator died making it): "
                            f"left alone; `shmkv unlink {name}` removes it")
            return keep(f"corrupt header (magic {int(hdr['magic']):#x}): left alone")
        if int(hdr["layout_version"]) != L.LAYOUT_VERSION:
            return keep(f"corrupt header: layout_version {int(hdr['layout_version'])} in a "
                        f"v{L.LAYOUT_VERSION} name: left alone")
        creator = int(hdr["creator_pid"])
        pool_id = bytes(hdr["pool_id"])
        tier_of = bytes(hdr["tier_of"]) if any(bytes(hdr["tier_of"])) else b""
        state = int(hdr["state"])
        stays = stays_text(int(hdr["retention"]), bytes(hdr["stays_by"]))
        made_by = _stays_by(int(hdr["retention"]), bytes(hdr["stays_by"]))
        if state == L.STATE_INITIALIZING:
            creating = _creating(entry, name, creator)
            if creating:
                return keep(creating, creator, "scoped")
            return _Pool(Verdict(entry, "pool", name, True,
                                 f"its creator pid {creator} died while creating it",
                                 lifetime="orphan"),
                         creator, st.st_ino, pool_id, tier_of)
        if state not in (L.STATE_READY, L.STATE_POISONED):
            return keep(f"corrupt header: state {state}: left alone", creator)
        from shmkv.pool.segment import Segment, read_config

        try:
            segment = Segment.open(f"/{entry}")
        except Exception as exc:  # noqa: BLE001  (whatever it is, the pool is not ours to judge)
            return keep(f"cannot be mapped ({exc}): left alone", creator)
        try:
            try:
                layout = read_config(segment, allow_poisoned=True)
            except Exception as exc:  # noqa: BLE001
                return keep(f"corrupt header ({exc}): left alone", creator)
            procs = layout.view(segment.buf, "proc_table").copy()
        finally:
            segment.close()
    finally:
        os.close(fd)
    active = np.flatnonzero(procs["state"] == L.SLOT_ACTIVE).tolist()
    live = [s for s in active if _slot_alive(entry, s, procs)]
    poisoned = state == L.STATE_POISONED
    lifetime = "stays" if stays else "scoped"
    said = f"{stays}; " if stays else ""
    if live:
        pids = ", ".join(str(int(procs[s]["pid"])) for s in live)
        kept = keep(f"{said}{len(live)} live process(es) attached (pid {pids})"
                    + ("; POISONED: `shmkv recover` can repair it" if poisoned else ""),
                    creator, lifetime)
        kept.live_pids = [int(procs[s]["pid"]) for s in live]
        return kept
    held = LC.holders(name)  # a tier's workers hold it without attaching (lifecycle rule 4)
    if held:
        return keep(f"{said}{'; '.join(held)}", creator, lifetime)
    creator_row = [s for s in active if int(procs[s]["pid"]) == creator]
    ticks = int(procs[creator_row[0]]["start_ticks"]) if creator_row else 0
    if pid_alive(creator, ticks):
        return keep(f"{said}no process attached, but its creator pid {creator} is alive",
                    creator, lifetime)
    dead = len(active)
    idle = (f"no live process attached ({dead} dead), creator pid {creator} dead"
            + ("; it was POISONED" if poisoned else ""))
    if stays:
        since = LC.idle_since(name, st.st_mtime)
        age = max(0.0, (time.time() if now is None else now) - since)
        idle += "; " + _idle_text(age, dead)
        if include_idle:
            go, why = True, " (--include-idle)"
        elif idle_for is None:
            go, why = False, f"; `shmkv unlink {name}` or `shmkv cleanup --include-idle` removes it"
        elif age >= idle_for:
            go, why = True, f", at least --idle-for {duration_text(idle_for)}"
        else:
            go, why = False, (f", less than --idle-for {duration_text(idle_for)}; `shmkv "
                              f"unlink {name}` removes it now")
        return _Pool(Verdict(entry, "pool", name, go, f"{stays}; idle: {idle}{why}",
                             lifetime=lifetime, idle=True, idle_since=since,
                             idle_since_is_lower_bound=bool(dead), stays_by=made_by,
                             idle_for=0.0 if include_idle else idle_for),
                     creator, st.st_ino, pool_id, tier_of)
    return _Pool(Verdict(entry, "pool", name, True,
                         f"{idle}; it was never marked to stay", lifetime="orphan"),
                 creator, st.st_ino, pool_id, tier_of)


def _creating(entry: str, name: str, creator: int) -> str | None:
    """Why a pool in state INITIALIZING may still be being created, or None when its
    creator provably died creating it. The header records the creator's pid but not its pid
    namespace, so a pid test alone proves nothing (the creator may be in a container); the
    proof is the liveness file: the creator makes it, then holds a lock on it (its slot)
    until it exits. Kept: while a process has the creator's pid here, while the liveness
    file is missing (not made yet, or the creator died before: ``shmkv unlink`` removes the
    pool), while a process holds a lock on it, and for ``CREATING_GRACE_S`` after it was
    made."""
    if pid_alive(creator):
        return f"being created by pid {creator}"
    path = f"{SHM_DIR}/{entry}.alive"
    try:
        st = os.lstat(path)
    except OSError:
        return (f"being created by pid {creator} (of another pid namespace?), or its creator "
                f"died before making its liveness file: left alone; `shmkv unlink {name}` "
                "removes it")
    if _any_lock_held(path):
        return f"being created by pid {creator} (a live process holds its liveness file)"
    age = time.time() - st.st_mtime
    if age < CREATING_GRACE_S:
        return f"being created by pid {creator} (its liveness file is {age:.0f} s old)"
    return None


def _slot_alive(entry: str, slot: int, procs: np.ndarray) -> bool:
    """A slot is live by the liveness rule (``AliveLocks.is_alive``); without the pool's
    ``.alive`` file, unless its row's process is provably gone (``process_gone``: a row of
    another pid namespace counts as alive)."""
    from shmkv.errors import SegmentError
    from shmkv.pool.liveness import AliveLocks, recorded_process_gone

    path = f"{SHM_DIR}/{entry}.alive"
    try:
        locks = AliveLocks(path, create=False, procs=procs)
    except SegmentError:
        return not recorded_process_gone(procs[slot])
    try:
        return locks.is_alive(slot)
    finally:
        locks.close()


def _assess_sibling(entry: str, st: os.stat_result, pools: dict[str, _Pool]) -> Verdict:
    base = entry
    head, _, version = base.rpartition("-v")
    kind_name, _, name = head[len("shmkv_"):].partition("-")
    spec = L.SIBLING_KINDS.get(kind_name)
    if spec is None or not version.isdigit():
        return Verdict(entry, "unknown", base, False, "not a kind this shmkv knows: left alone")
    v = Verdict(entry, spec.what, name, False, "")
    problem = foreign_reason(st)
    if problem:
        v.reason = problem
        return v
    need = max(spec.owner_offset + L.OWNER_DTYPE.itemsize, _DOORBELL_FIELD + 88)
    try:
        fd = os.open(f"{SHM_DIR}/{entry}", _NOBLOCK_READ)
    except OSError as exc:
        v.reason = f"cannot be opened ({exc.strerror}): left alone"
        return v
    try:
        head_bytes = os.pread(fd, need, 0)
        running = False
        if kind_name == "pub":
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                running = True
    finally:
        os.close(fd)
    magic = struct.unpack_from("<Q", head_bytes, 0)[0] if len(head_bytes) >= 8 else 0
    if kind_name == "ch" and magic == L.CHANNEL_MAGIC and len(head_bytes) >= 128:
        # Where every channel version keeps it: its doorbell stays while it does.
        v.doorbell = head_bytes[_DOORBELL_FIELD:_DOORBELL_FIELD + 88].rstrip(b"\0").decode(
            errors="replace")
    if int(version) != spec.version:
        v.reason = f"version {version}, not this shmkv's v{spec.version}: left alone"
        if kind_name in L.POOL_NAMED_SIBLINGS and int(version) in spec.past_versions:
            v.reason += f" (`shmkv unlink {name}` removes it with its pool)"
        return v
    if len(head_bytes) < spec.owner_offset + L.OWNER_DTYPE.itemsize:
        v.reason = f"corrupt: {st.st_size} bytes, too small for a {spec.what} header: left alone"
        return v
    magic, hversion = struct.unpack_from("<QI", head_bytes, 0)
    if magic != spec.magic:
        v.reason = ("no header yet (being created, or its creator died making it): left alone"
                    if magic == 0 else f"corrupt header (magic {magic:#x}): left alone")
        return v
    if hversion != spec.version:
        v.reason = f"corrupt header: version {hversion} in a v{spec.version} name: left alone"
        return v
    rec = np.frombuffer(head_bytes, L.OWNER_DTYPE, count=1, offset=spec.owner_offset)[0]
    if int(rec["owner_magic"]) != L.OWNER_MAGIC:
        v.reason = "corrupt owner record: left alone"
        return v
    creator, ticks = int(rec["creator_pid"]), int(rec["creator_start_ticks"])
    creator_ns = int(rec["creator_pid_ns"])
    try:
        pool_name = bytes(rec["pool_name"]).decode()
        if pool_name:
            L.validate_pool_name(pool_name)
    except Exception:  # noqa: BLE001
        v.reason = "corrupt owner record (pool name): left alone"
        return v
    v.pool = pool_name or None
    if running:
        v.reason = "a publisher is running on it"
        return v
    if creator > 0 and not process_gone(creator, ticks, creator_ns):
        v.reason = (f"its creator pid {creator} is alive" if pid_alive(creator, ticks)
                    and creator_ns == own_pid_namespace() else
                    f"its creator pid {creator} is of another pid namespace (or of one not "
                    "recorded): it may be alive")
        return v
    who = f"its creator pid {creator} is dead" if creator > 0 else ""
    if not pool_name:
        if creator <= 0:
            v.reason = "no owner recorded: left alone"
            return v
        v.remove, v.reason = True, who
        return v
    pool = pools.get(pool_name)
    same = (pool is not None and pool.ino == int(rec["pool_ino"])
            and pool.creator_pid == int(rec["pool_creator_pid"])
            and pool.pool_id == bytes(rec["pool_id"]))
    if same and not pool.verdict.remove:
        v.reason = f"its pool {pool_name} stays ({pool.verdict.reason})"
        return v
    if same:
        gone = f"its pool {pool_name} is removed too"
    elif pool is not None:
        gone = f"its pool {pool_name} is gone (a pool of that name now is another one)"
    else:
        gone = f"its pool {pool_name} is gone"
    v.remove, v.reason = True, gone + (f", {who}" if who else "")
    return v


def plan(now: float | None = None, *, include_idle: bool = False,
         idle_for: float | None = None, prefix: str | None = None) -> list[Verdict]:
    """What cleanup would do with every shmkv object in /dev/shm, in listing order.

    Args:
        now: the time doorbells' and idle pools' ages are counted to (default: now).
        include_idle: also remove the pools meant to stay (``BlockPool.mark_stays``, or
            made before pools recorded it) that no live process holds, with what is theirs.
        idle_for: as ``include_idle``, but only the pools idle at least this many seconds
            (since a process last joined or left them: ``lifecycle.idle_since``); None:
            none. A pool a live process holds stays whatever its age.
        prefix: only the objects whose name, or whose pool's name, starts with it
            (``in_scope``: a prefix of names, which may match several pools). Every object
            is still read, so each verdict is the one an unscoped plan gives, except that
            nothing in scope goes because something out of scope goes: an object whose
            removal rests on its pool's (or a doorbell on its channels') is kept when that
            pool (or one of those channels) is out of scope.

    Raises:
        UsageError: an empty ``prefix``; an ``idle_for`` that is not a finite number of
            seconds >= 0, or given with ``include_idle``.
    """
    if idle_for is not None:
        if isinstance(idle_for, bool) or not isinstance(idle_for, int | float) or not (
                0 <= idle_for < float("inf")):
            raise UsageError(f"idle_for {idle_for!r}: give the seconds a pool meant to stay "
                             "must have been idle, a finite number >= 0")
        if include_idle:
            raise UsageError("idle_for with include_idle: give one (include_idle removes "
                             "every idle pool, as idle_for=0)")
    if prefix is not None and not (isinstance(prefix, str) and prefix):
        raise UsageError(f"prefix {prefix!r}: give the start of the names to clean up (of "
                         "every pool and sibling whose name starts with it; `shmkv unlink "
                         "NAME` removes one pool), or no prefix at all for every object")
    verdicts = _plan(time.time() if now is None else now, include_idle, idle_for)
    if prefix is None:
        return verdicts
    scoped = [v for v in verdicts if in_scope(v, prefix)]
    entries = {v.entry for v in scoped}
    for v in scoped:
        if not v.remove:
            continue
        if v.pool and not v.pool.startswith(prefix) and "removed too" in v.reason:
            v.remove, v.reason = False, (f"its pool {v.pool} is to go, but its name does not "
                                         f"start with {prefix!r}: left alone")
    gone = {v.entry for v in scoped if v.remove}
    for v in scoped:
        if v.remove and v.channels and not set(v.channels) <= (entries & gone):
            v.remove, v.reason = False, (
                "its channel(s) are to go, but not all of them with this cleanup: left alone")
    return scoped


def in_scope(v: Verdict, prefix: str) -> bool:
    """Whether a scoped cleanup (``--prefix``) or listing may touch ``v``: its own name
    starts with ``prefix``, or the name of the pool it belongs to does (so a pool's
    siblings named after a serving run go with it)."""
    return (v.name or "").startswith(prefix) or bool(v.pool and v.pool.startswith(prefix))


def _plan(now: float, include_idle: bool, idle_for: float | None) -> list[Verdict]:
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    stats: dict[str, os.stat_result] = {}
    for entry in entries:
        base = entry[len("sem."):] if entry.startswith("sem.") else entry
        if base.startswith(("shmkv-", "shmkv_")) or L.offload_data_region_pool(entry):
            try:
                stats[entry] = os.lstat(f"{SHM_DIR}/{entry}")
            except FileNotFoundError:
                continue
    pools: dict[str, _Pool] = {}
    out: dict[str, Verdict] = {}
    suffix = f"-v{L.LAYOUT_VERSION}"
    # 1. pools
    for entry, st in stats.items():
        if entry.startswith("shmkv-") and not entry.endswith(".alive"):
            head, sep, version = entry.rpartition("-v")
            name = head[len("shmkv-"):] if sep else entry[len("shmkv-"):]
            if not entry.endswith(suffix):
                out[entry] = Verdict(entry, "pool", name, False,
                                     f"layout v{version or '?'}, not this shmkv's "
                                     f"v{L.LAYOUT_VERSION}: left alone (remove it with the "
                                     "shmkv that made it, or by hand)")
                continue
            pools[name] = _assess_pool(entry, name, st, include_idle, idle_for, now)
            out[entry] = pools[name].verdict
    for name, pool in pools.items():  # a tier stays with the very pool it is the tier of
        owner = pools.get(name.rpartition(".")[0]) if pool.tier_of else None
        if (pool.verdict.remove and owner is not None and owner.pool_id == pool.tier_of
                and not owner.verdict.remove):
            pool.verdict.remove, pool.verdict.lifetime = False, owner.verdict.lifetime
            pool.verdict.reason = (f"a tier of pool {owner.verdict.name}, which stays "
                                   f"({owner.verdict.reason})")
    # 2. a pool's lock and liveness file
    for entry, st in stats.items():
        if entry.startswith("sem.shmkv-") and entry.endswith(".lock"):
            seg, kind = entry[len("sem."):-len(".lock")], "lock"
        elif entry.startswith("shmkv-") and entry.endswith(".alive"):
            seg, kind = entry[:-len(".alive")], "liveness"
        else:
            continue
        name = seg[len("shmkv-"):].rpartition("-v")[0] or seg[len("shmkv-"):]
        v = Verdict(entry, kind, name, False, "", pool=name)
        if seg in out:
            owner = out[seg]
            v.remove = owner.remove  # BlockPool.unlink removes it with the pool
            v.reason = f"goes with its pool {name}" if owner.remove else f"its pool {name} stays"
        elif problem := foreign_reason(st):
            v.reason = problem
        elif kind == "liveness" and _any_lock_held(f"{SHM_DIR}/{entry}"):
            v.reason = "a live process holds a lock on it"
        else:
            v.remove, v.reason = True, f"its pool {name} is gone"
        out[entry] = v
    # 3. sibling segments, then the offload tier's replica lock files beside their tables
    for entry, st in stats.items():
        if entry.startswith("shmkv_") and not entry.endswith(L.OFFLOAD_REPLICAS_SUFFIX):
            out[entry] = _assess_sibling(entry, st, pools)
    for entry, st in stats.items():
        if entry.startswith("shmkv_") and entry.endswith(L.OFFLOAD_REPLICAS_SUFFIX):
            table = out.get(entry[:-len(L.OFFLOAD_REPLICAS_SUFFIX)])
            v = Verdict(entry, "offload replica locks", table.pool if table else "", False, "",
                        pool=table.pool if table else "")
            if problem := foreign_reason(st):
                v.reason = problem
            elif table is not None and table.remove and _any_lock_held(f"{SHM_DIR}/{entry}"):
                v.reason = "a live process holds a lock on it (a replica of a removed tier)"
            elif table is not None:
                v.remove = table.remove
                v.reason = ("goes with its tier table" if table.remove
                            else "its tier table stays")
            elif _any_lock_held(f"{SHM_DIR}/{entry}"):
                v.reason = "a live process holds a lock on it"
            else:
                v.remove, v.reason = True, "its tier table is gone"
            out[entry] = v
    # 4. vLLM offload data regions: with the pool they are named after (vLLM's file holds
    #    no owner record, so its name is all there is; another user's file stays)
    for entry, st in stats.items():
        pool_name = L.offload_data_region_pool(entry)
        if pool_name is None:
            continue
        v = Verdict(entry, "offload data region", pool_name, False, "", pool=pool_name)
        out[entry] = v
        kept = [o for o in out.values()
                if o.kind == "pool" and o.name == pool_name and not o.remove]
        if problem := foreign_reason(st):
            v.reason = problem
        elif kept:
            v.reason = f"its pool {pool_name} stays ({kept[0].reason})"
        else:
            v.remove = True
            v.reason = (f"its pool {pool_name} is removed too" if pool_name in pools
                        else f"its pool {pool_name} is gone")
    # 5. doorbells: with the channels that name them
    naming: dict[str, list[Verdict]] = {}
    for v in out.values():
        if v.doorbell:
            naming.setdefault(v.doorbell, []).append(v)
    for entry, st in stats.items():
        if not entry.startswith("sem.shmkv_"):
            continue
        bell = "/" + entry[len("sem."):]
        v = Verdict(entry, "doorbell" if bell.startswith(L.DOORBELL_PREFIX) else "unknown",
                    bell[len(L.DOORBELL_PREFIX):] if bell.startswith(L.DOORBELL_PREFIX)
                    else bell[1:], False, "")
        out[entry] = v
        if v.kind == "unknown":
            v.reason = "not a kind this shmkv knows: left alone"
            continue
        if problem := foreign_reason(st):
            v.reason = problem
            continue
        channels = naming.get(bell, [])
        if channels:
            v.pool = next((c.pool for c in channels if c.pool), None)
            v.channels = tuple(c.entry for c in channels)
            kept = [c.name for c in channels if not c.remove]
            if kept:
                v.reason = f"its channel(s) {', '.join(kept)} stay"
            else:
                v.remove = True
                v.reason = f"goes with its channel(s) {', '.join(c.name for c in channels)}"
            continue
        age = now - st.st_mtime
        if age < DOORBELL_GRACE_S:
            v.reason = (f"no channel names it yet (made {age:.0f} s ago: its channels may be "
                        "being made)")
        else:
            v.remove, v.reason = True, f"no channel names it (made {age:.0f} s ago)"
    for entry, v in out.items():
        v.memory_bytes = stats[entry].st_blocks * 512
        v.ino = stats[entry].st_ino
    for pool in pools.values():
        pool.verdict.pool_id = pool.pool_id
    return [out[e] for e in stats if e in out]


def tier_in_use(pool: str, generation: bytes | None = None) -> list[str]:
    """Why the shared tier of ``pool`` (a vLLM offload tier, an SGLang page store) is in
    use, one phrase each: processes attached to its pool, replica processes holding its
    replica lock file (of ``generation``, if given), a data region being made
    (``lifecycle.holders``). Empty when the pool has no tier or nothing holds it. ``shmkv
    unlink`` refuses a tier in use."""
    tier_paths = (SHM_DIR + LC.table_name(pool), LC.lock_file_path(pool),
                  SHM_DIR + L.sibling_segment_name("sglang", pool, L.SGLANG_STORE_VERSION))
    if not any(os.path.lexists(p) for p in tier_paths):
        return []
    reasons = []
    entry = L.segment_name(pool)[1:]
    try:
        st = os.lstat(f"{SHM_DIR}/{entry}")
    except OSError:
        st = None
    if st is not None:
        judged = _assess_pool(entry, pool, st, True)
        if judged.live_pids:
            reasons.append(f"{len(judged.live_pids)} process(es) attached to its pool (pid "
                           f"{', '.join(map(str, judged.live_pids))})")
    return reasons + LC.holders(pool, generation)


def discard_unused_tier(pool: str, generation: bytes, tiers: tuple[str, ...]) -> bool:
    """Removes the tier of ``pool`` that this process made (``generation``: its pool's
    ``pool_id``) and was then refused for, so that a refused start leaves /dev/shm as it
    found it; a tier that another process joined meanwhile (attached, or holding its
    replica lock file) stays, as does a pool of the name made again since. Returns whether
    it was removed. Call it with this process's own handles closed."""
    identity = pool_identity(pool)
    if identity is None or identity[2] != generation or tier_in_use(pool, generation):
        return False
    return unlink_pool(pool, tiers).found


def memory_of(verdicts: list[Verdict], pool: str) -> int:
    """The /dev/shm memory of a pool and of what goes with it (its lock, liveness file,
    siblings, data region: the verdicts naming it as their pool)."""
    return sum(v.memory_bytes for v in verdicts
               if (v.kind == "pool" and v.name == pool) or v.pool == pool)


def unlink_offload_data_region(pool: str) -> list[str]:
    """Removes a pool's vLLM offload data region (one file per rank); returns the paths
    removed. Workers that have it mapped keep their mapping."""
    L.validate_pool_name(pool)
    removed = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for entry in sorted(entries):
        if L.offload_data_region_pool(entry) == pool:
            try:
                os.unlink(f"{SHM_DIR}/{entry}")
                removed.append(f"{SHM_DIR}/{entry}")
            except FileNotFoundError:
                pass
    return removed


def unlink_pool_files(pool: str) -> bool:
    """Removes a pool's segment, lock and liveness file (nothing else it owns). False if
    the segment did not exist. Processes that have it mapped keep working until they close
    it."""
    from shmkv.pool.liveness import alive_path
    from shmkv.pool.lock import unlink_semaphore

    shm_name = L.segment_name(pool)
    try:
        posix_ipc.unlink_shared_memory(shm_name)
        found = True
    except posix_ipc.ExistentialError:
        found = False
    unlink_semaphore(shm_name)
    try:
        os.unlink(alive_path(shm_name))
    except FileNotFoundError:
        pass
    return found


def tier_of(pool_name: str) -> bytes | None:
    """The ``pool_id`` of the pool whose tier ``pool_name`` is (its header's ``tier_of``);
    None when it is a pool of its own, or not a readable shmkv pool of this user and layout
    version (then it is nobody's tier: left alone)."""
    found = _pool_header(pool_name)
    if found is None or foreign_reason(found[0]):
        return None
    hdr = found[1]
    if int(hdr["magic"]) != L.MAGIC or int(hdr["layout_version"]) != L.LAYOUT_VERSION:
        return None
    owner = bytes(hdr["tier_of"])
    return owner if any(owner) else None


def unlink_tiers(pool: str, tiers: tuple[str, ...], *, keep_of: bytes | None = None) -> list[str]:
    """Removes the tiers of ``pool`` (the pools ``<pool>.<tier>`` whose header says they
    are a tier, of this pool or of an earlier one of its name), except a tier of the pool
    ``keep_of`` (a ``pool_id``). A pool of its own named ``<pool>.<tier>`` is never
    removed. Returns the names of the tiers removed."""
    removed = []
    for tier in tiers:
        name = f"{pool}.{tier}"
        if len(name) > L.MAX_POOL_NAME_CHARS:
            continue
        owner = tier_of(name)
        if owner is not None and owner != keep_of and unlink_pool_files(name):
            removed.append(name)
    return removed


class Unlinked(NamedTuple):
    """What ``unlink_pool`` did."""

    found: bool  # the pool's segment existed
    removed: list[str]  # what else went: "host tier", "stats", ...
    memory_bytes: int  # the /dev/shm memory of every file that went (allocated bytes)


def _pool_paths(pool: str, tiers: tuple[str, ...]) -> list[str]:
    """Every path in /dev/shm that ``unlink_pool`` may remove."""
    from shmkv.pool.liveness import alive_path
    from shmkv.pool.lock import lock_name

    names = [pool] + [f"{pool}.{t}" for t in tiers
                      if len(f"{pool}.{t}") <= L.MAX_POOL_NAME_CHARS]
    paths = []
    for name in names:
        seg = L.segment_name(name)
        paths += [SHM_DIR + seg, f"{SHM_DIR}/sem.{lock_name(seg)[1:]}", alive_path(seg)]
    paths += [SHM_DIR + L.sibling_segment_name(kind, pool, L.SIBLING_KINDS[kind].version)
              for kind in L.POOL_NAMED_SIBLINGS]
    paths.append(L.offload_replicas_path(pool))
    paths += [path for path, _ in _past_versions(pool)]
    for seg, _ in _earlier_pools(pool):  # an earlier release's pool, removed with its tier
        paths += [SHM_DIR + seg, f"{SHM_DIR}/sem.{lock_name(seg)[1:]}", alive_path(seg)]
    for prefix in L.PAST_OFFLOAD_DATA_REGION_PREFIXES:
        paths += LC.region_paths(pool, prefix)
    try:
        paths += [f"{SHM_DIR}/{e}" for e in sorted(os.listdir(SHM_DIR))
                  if L.offload_data_region_pool(e) == pool]
    except OSError:
        pass
    return paths


def _files(paths: list[str]) -> dict[str, tuple[int, int]]:
    """(inode, allocated bytes) of each path that exists."""
    out = {}
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        out[path] = (st.st_ino, st.st_blocks * 512)
    return out


def unlink_pool(pool: str, tiers: tuple[str, ...]) -> Unlinked:
    """Removes a pool and everything it owns: its segment, lock and liveness file, its
    ``tiers`` (``unlink_tiers``), and what is named after it alone
    (``unlink_pool_siblings``), whether it is meant to stay or not. Returns whether its
    segment existed, what else was removed ("host tier", "stats", ...), and the memory of
    /dev/shm that the removed files took."""
    L.validate_pool_name(pool)
    before = _files(_pool_paths(pool, tiers))
    identity = pool_identity(pool)
    found = unlink_pool_files(pool)
    generation = identity[2] if identity is not None and found else None
    extras = [f"{name.rpartition('.')[2]} tier" for name in unlink_tiers(pool, tiers)]
    extras += unlink_pool_siblings(pool, generation)
    after = _files(list(before))
    freed = sum(nbytes for path, (ino, nbytes) in before.items()
                if after.get(path, (None, 0))[0] != ino)
    return Unlinked(found, extras, freed)


def _past_versions(pool: str) -> list[tuple[str, str]]:
    """(path, what) of the earlier versions of each sibling named after ``pool`` alone
    (``SiblingKind.past_versions``), with the offload tier table's replica lock file."""
    out = []
    for kind in L.POOL_NAMED_SIBLINGS:
        spec = L.SIBLING_KINDS[kind]
        for version in spec.past_versions:
            path = SHM_DIR + L.sibling_segment_name(kind, pool, version)
            out.append((path, f"{spec.what} v{version}"))
            if kind == "offload":
                out.append((path + L.OFFLOAD_REPLICAS_SUFFIX,
                            f"offload replica locks v{version}"))
    return out


def unlink_past_versions(pool: str) -> list[str]:
    """Removes what an earlier shmkv named after ``pool`` (``_past_versions``), as a whole
    and root first: its pools of an earlier layout version (with their lock and liveness
    file), then its siblings, each only if it is a regular file of this user; and nothing
    while that release's tier runs (a process attached to its pool, or holding its replica
    lock file), since removing a piece of a running tier is what lets it load another's
    bytes. Returns what each removed object is (``"pool v8"``, ``"offload tier table v2"``,
    ...)."""
    from shmkv.pool.liveness import alive_path
    from shmkv.pool.lock import unlink_semaphore

    if earlier_release_running(pool):
        return []
    removed = []
    for seg, version in _earlier_pools(pool):
        try:
            posix_ipc.unlink_shared_memory(seg)
            removed.append(f"pool v{version}")
        except posix_ipc.ExistentialError:
            pass
        unlink_semaphore(seg)
        try:
            os.unlink(alive_path(seg))
        except FileNotFoundError:
            pass
    for path, what in _past_versions(pool):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if foreign_reason(st):  # a link, FIFO, directory or another user's file: left alone
            continue
        try:
            os.unlink(path)
            removed.append(what)
        except FileNotFoundError:
            pass
    return removed


def _earlier_pools(pool: str) -> list[tuple[str, int]]:
    """(segment name, layout version) of the pools of an earlier layout version named
    ``pool`` that are regular files of this user."""
    out = []
    for version in range(1, L.LAYOUT_VERSION):
        seg = f"/shmkv-{pool}-v{version}"
        try:
            st = os.lstat(SHM_DIR + seg)
        except OSError:
            continue
        if not foreign_reason(st):
            out.append((seg, version))
    return out


def earlier_release_running(pool: str) -> bool:
    """Whether an earlier release's tier named after ``pool`` runs: a process attached to
    one of its pools (a lock on the pool's liveness file), or holding the replica lock file
    of one of its offload tier tables."""
    from shmkv.pool.liveness import alive_path

    if earlier_tiers_running(pool):
        return True
    return any(_any_lock_held(alive_path(seg)) for seg, _ in _earlier_pools(pool))


def earlier_tiers_running(pool: str) -> list[str]:
    """The paths of the earlier offload tier tables named after ``pool`` whose replica lock
    file a process holds: an earlier release's tier, running."""
    tables = [SHM_DIR + L.sibling_segment_name("offload", pool, version)
              for version in L.SIBLING_KINDS["offload"].past_versions]
    return [t for t in tables if _any_lock_held(t + L.OFFLOAD_REPLICAS_SUFFIX)]


def unlink_pool_siblings(pool: str, generation: bytes | None = None) -> list[str]:
    """Removes what is named after ``pool`` alone besides the pool itself
    (``layout.POOL_NAMED_SIBLINGS``, their earlier versions (``unlink_past_versions``), and
    the offload tier's objects of ``generation``: ``lifecycle.remove_objects``; None: of
    any); returns what each removed object is (``"stats"``, ``"offload data region"``, ...).
    Call it once the pool is gone (a tier goes root first)."""
    L.validate_pool_name(pool)
    removed = []
    for kind in L.POOL_NAMED_SIBLINGS:
        if kind == "offload":
            continue  # with the tier's other objects, by generation, below
        spec = L.SIBLING_KINDS[kind]
        try:
            posix_ipc.unlink_shared_memory(L.sibling_segment_name(kind, pool, spec.version))
            removed.append(spec.what)
        except posix_ipc.ExistentialError:
            pass
    removed += LC.remove_objects(pool, generation, past=not earlier_release_running(pool))
    removed += unlink_past_versions(pool)
    return removed


CHANGED = "changed since it was judged: left alone"
# The objects of a vLLM offload tier besides its pool (their verdicts' kinds).
_TIER_KINDS = ("offload tier table", "offload replica locks", "offload data region")


def _now_ino(path: str) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


class _Recheck:
    """Whether an object a plan said to remove is, right before its removal, still the very
    object judged (its inode, a pool's ``pool_id``) and still to go, as judged afresh."""

    def __init__(self, verdicts: list[Verdict]) -> None:
        self.planned = {v.entry: v for v in verdicts}
        self.pools = {v.name: v for v in verdicts
                      if v.kind == "pool" and v.entry.endswith(f"-v{L.LAYOUT_VERSION}")}

    def pool_now(self, name: str) -> _Pool | None:
        """The pool named ``name`` judged now (under the idle time the plan removed it
        under, if it did: a process that joined and left meanwhile keeps it); None if there
        is none of this layout version."""
        try:
            entry = L.segment_name(name)[1:]
            st = os.lstat(f"{SHM_DIR}/{entry}")
        except (OSError, UsageError):
            return None
        planned = self.pools.get(name)
        idle_for = planned.idle_for if planned and planned.idle and planned.remove else None
        return _assess_pool(entry, name, st, False, idle_for)

    def pool_as_planned(self, name: str) -> bool:
        """The pool at ``name`` is now what the plan saw: the same pool, still to go, or
        none, as the plan found none."""
        planned = self.pools.get(name)
        now = self.pool_now(name)
        if planned is None or not planned.ino:
            return now is None
        return (now is not None and now.ino == planned.ino and now.pool_id == planned.pool_id
                and now.verdict.remove)

    def still(self, v: Verdict) -> bool:
        if _now_ino(v.path) != v.ino:
            return False
        if v.kind == "pool":
            return self.pool_as_planned(v.name)
        if v.kind in ("lock", "liveness") or v.kind == "offload data region":
            return self.pool_as_planned(v.pool or v.name)
        if v.entry.startswith("shmkv_") and v.entry.endswith(L.OFFLOAD_REPLICAS_SUFFIX):
            table = v.entry[:-len(L.OFFLOAD_REPLICAS_SUFFIX)]  # it goes with its table
            if _now_ino(f"{SHM_DIR}/{table}") is None:
                return not _any_lock_held(v.path)
            return self.sibling_to_go(table)
        if v.entry.startswith("shmkv_"):
            return self.sibling_to_go(v.entry)
        return True  # a doorbell: the very semaphore judged (its inode)

    def sibling_to_go(self, entry: str) -> bool:
        """The sibling segment ``entry`` judged now is to go."""
        try:
            st = os.lstat(f"{SHM_DIR}/{entry}")
        except OSError:
            return False
        first = _assess_sibling(entry, st, {})
        pools = {}
        if first.pool and (pool := self.pool_now(first.pool)) is not None:
            pools[first.pool] = pool
        return _assess_sibling(entry, st, pools).remove if pools else first.remove


def remove(verdicts: list[Verdict]) -> list[tuple[Verdict, bool]]:
    """Removes what ``verdicts`` say to remove: siblings, then doorbells, then pools (with
    their lock and liveness file). Right before each removal the object is judged again:
    one that is no longer the object the plan judged (removed and made again meanwhile,
    e.g. by ``shmkv create``), or no longer to go (a process attached meanwhile), is left
    alone, its verdict turned to kept with the reason ``CHANGED``. Returns (verdict,
    removed) for each, False when the object had gone meanwhile or was left alone."""
    done = []
    # A tier goes root first (``lifecycle.py``, rule 5): its pool, then its other objects,
    # each only if it records the removed pool's generation.
    order = {"doorbell": 1, "pool": 2, "lock": 3, "liveness": 3, **dict.fromkeys(_TIER_KINDS, 4)}
    pools_removed: dict[str, bytes] = {}
    tiers_removed: dict[str, list[str]] = {}
    pools_kept = set()
    check = _Recheck(verdicts)
    for v in sorted((v for v in verdicts if v.remove), key=lambda v: order.get(v.kind, 0)):
        if v.kind in ("lock", "liveness") and v.pool in pools_removed:
            done.append((v, not os.path.exists(v.path)))  # went with its pool
            continue
        if v.kind in _TIER_KINDS and v.pool in pools_removed:
            if v.pool not in tiers_removed:
                tiers_removed[v.pool] = LC.remove_objects(v.pool, pools_removed[v.pool] or None,
                                                          past=False)
            gone = not os.path.lexists(v.path)
            if not gone:
                v.remove, v.reason = False, CHANGED  # a tier made again meanwhile: its own
            done.append((v, gone))
            continue
        if (v.kind in ("lock", "liveness") and v.pool in pools_kept) or not check.still(v):
            if v.kind == "pool":
                pools_kept.add(v.name)
            if os.path.lexists(v.path):
                v.remove, v.reason = False, CHANGED
            done.append((v, False))
            continue
        if v.kind == "pool":  # with its lock and liveness file; each tier has its verdict
            ok = unlink_pool_files(v.name)
            pools_removed[v.name] = v.pool_id
        elif v.kind == "doorbell" or v.entry.startswith("sem."):
            try:
                posix_ipc.unlink_semaphore("/" + v.entry[len("sem."):])
                ok = True
            except posix_ipc.ExistentialError:
                ok = False
        else:
            try:
                os.unlink(v.path)
                ok = True
            except FileNotFoundError:
                ok = False
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                ok = False
        done.append((v, ok))
    return done


__all__ = ["CHANGED", "DOORBELL_GRACE_S", "Unlinked", "Verdict", "discard_unused_tier",
           "duration_text", "foreign_reason", "human_bytes",
           "in_scope", "memory_of", "owner_record", "plan", "pool_identity", "remove",
           "stays_text", "tier_in_use", "tier_of", "unlink_offload_data_region",
           "unlink_past_versions", "unlink_pool", "unlink_pool_files", "unlink_pool_siblings",
           "unlink_tiers", "write_owner"]
