"""``shmkv/pool/siblings.py`` without other processes: where the owner record lies in each
sibling header, and cleanup's rules for half-made pools, stray pool files and doorbells."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time

import numpy as np

from shmkv import BlockPool
from shmkv.messages import create_doorbell, unlink_doorbell
from shmkv.pool import layout as L
from shmkv.pool import siblings


def _verdict(entry: str, now: float | None = None) -> siblings.Verdict:
    return next(v for v in siblings.plan(now) if v.entry == entry)


def _dead_pid() -> int:
    p = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    return p.pid


def test_owner_records_lie_in_padding_of_every_sibling_header():
    from shmkv import publisher, stats
    from shmkv.ranks import block_table as bt

    end = L.OWNER_DTYPE.itemsize
    assert L.CHANNEL_HEADER_DTYPE.fields["doorbell"][1] + L.MAX_DOORBELL_NAME_BYTES \
        <= L.CHANNEL_OWNER_OFFSET
    assert L.CHANNEL_OWNER_OFFSET + end <= L.CHANNEL_HEADER_DTYPE.itemsize
    bt_used = max(off + dt.itemsize for name, (dt, off) in bt.BT_HEADER_DTYPE.fields.items()
                  if name != "_pad")
    assert bt_used <= L.BT_OWNER_OFFSET and L.BT_OWNER_OFFSET + end <= bt.BT_HEADER_DTYPE.itemsize
    assert bt.KV_HEADER_DTYPE.itemsize <= L.KV_OWNER_OFFSET
    assert L.KV_OWNER_OFFSET + end <= bt.KV_HEADER_BYTES
    assert stats._HEADER_DTYPE.fields["owner"][1] == L.STATS_OWNER_OFFSET
    assert L.STATS_OWNER_OFFSET + end <= stats._HEADER_BYTES
    assert publisher._STATE_DTYPE.itemsize <= L.PUBLISHER_OWNER_OFFSET
    assert L.PUBLISHER_OWNER_OFFSET + end <= publisher._STATE_BYTES
    for kind in L.SIBLING_KINDS.values():
        assert kind.owner_offset % 8 == 0


def test_owner_record_names_this_process_and_the_pool(pool_name):
    rec = siblings.owner_record(None)[0]
    assert int(rec["creator_pid"]) == os.getpid() and int(rec["creator_start_ticks"]) > 0
    assert bytes(rec["pool_name"]) == b"" and int(rec["owner_magic"]) == L.OWNER_MAGIC
    with BlockPool.create(pool_name, 8):
        rec = siblings.owner_record(pool_name, creator=False)[0]
        ino = os.stat(f"/dev/shm{L.segment_name(pool_name)}").st_ino
    assert int(rec["creator_pid"]) == 0 and bytes(rec["pool_name"]) == pool_name.encode()
    assert (int(rec["pool_creator_pid"]), int(rec["pool_ino"])) == (os.getpid(), ino)


def test_a_half_made_pool_stays_while_its_creator_lives(pool_name):
    BlockPool.create(pool_name, 8).close()
    entry = L.segment_name(pool_name)[1:]
    path = f"/dev/shm/{entry}"
    with open(path, "r+b") as f:  # back to INITIALIZING, as if its creator were at it
        f.seek(L.HEADER_DTYPE.fields["state"][1])
        f.write(struct.pack("<I", L.STATE_INITIALIZING))
    v = _verdict(entry)
    assert not v.remove and v.reason == f"being created by pid {os.getpid()}"
    dead = _dead_pid()
    with open(path, "r+b") as f:
        f.seek(L.HEADER_DTYPE.fields["creator_pid"][1])
        f.write(struct.pack("<I", dead))
    v = _verdict(entry)  # its creator may be of another pid namespace: the .alive file tells
    assert not v.remove and v.reason.startswith(f"being created by pid {dead} (its liveness")
    made = time.time() - siblings.CREATING_GRACE_S - 1
    os.utime(f"{path}.alive", (made, made))
    v = _verdict(entry)
    assert v.remove and v.reason == f"its creator pid {dead} died while creating it"
    lock = _verdict(f"sem.{entry}.lock")
    assert lock.remove and lock.reason == f"goes with its pool {pool_name}"
    done = {w.entry: ok for w, ok in siblings.remove(siblings.plan(prefix=pool_name))}
    assert done[entry] and done[f"sem.{entry}.lock"] and done[f"{entry}.alive"]
    assert not os.path.exists(path) and not os.path.exists(f"{path}.alive")


def test_a_pools_stray_liveness_file_goes_unless_someone_holds_it(pool_name):
    from shmkv.pool.liveness import AliveLocks

    entry = L.segment_name(pool_name)[1:] + ".alive"
    locks = AliveLocks(f"/dev/shm/{entry}", create=True)
    try:
        assert locks.claim(3)
        v = _verdict(entry)
        assert not v.remove and v.reason == "a live process holds a lock on it"
        locks.release(3)
        v = _verdict(entry)
        assert v.remove and v.reason == f"its pool {pool_name} is gone"
    finally:
        locks.close()
        os.unlink(f"/dev/shm/{entry}")


def test_a_doorbell_no_channel_names_goes_after_the_grace_period(pool_name):
    bell = create_doorbell(pool_name)
    try:
        entry = f"sem.{bell[1:]}"
        v = _verdict(entry)
        assert not v.remove and "no channel names it yet" in v.reason
        later = time.time() + siblings.DOORBELL_GRACE_S + 1
        v = _verdict(entry, later)
        assert v.remove and "no channel names it" in v.reason
    finally:
        unlink_doorbell(bell)


def test_a_sibling_with_a_torn_owner_record_is_left_alone(pool_name):
    from shmkv.messages import Channel, channel_segment_name

    Channel.create(pool_name, 4096).close()
    path = f"/dev/shm{channel_segment_name(pool_name)}"
    try:
        with open(path, "r+b") as f:
            f.seek(L.CHANNEL_OWNER_OFFSET)
            f.write(np.zeros(8, np.uint8).tobytes())  # owner_magic gone
        v = _verdict(path[len("/dev/shm/"):])
        assert not v.remove and v.reason == "corrupt owner record: left alone"
    finally:
        Channel.unlink(pool_name)


def test_a_sibling_of_another_pool_of_the_same_name_pid_and_inode_goes(pool_name):
    """Issue 15, item 7: the owner record names its pool by the header's random pool_id
    too. A sibling whose record matches the live pool's name, creator pid and inode but
    not its pool_id (a pool re-created by a reused pid on a reused inode) belongs to a pool
    that is gone: cleanup removes it. It used to be kept as the live pool's."""
    from shmkv.stats import PoolStats, stats_segment_name

    with BlockPool.create(pool_name, 8) as pool:
        stats = PoolStats.open(pool)
        entry = stats_segment_name(pool_name).lstrip("/")
        mine = [v for v in siblings.plan() if v.entry == entry]
        assert len(mine) == 1 and not mine[0].remove, mine
        rec = np.ndarray((1,), L.OWNER_DTYPE, buffer=stats._seg.mem,
                         offset=L.STATS_OWNER_OFFSET)
        assert bytes(rec[0]["pool_id"]) == bytes(pool.header_snapshot()["pool_id"])
        rec[0]["pool_id"] = bytes(16)  # another pool's identity, all else the same
        del rec
        mine = [v for v in siblings.plan() if v.entry == entry]
        assert len(mine) == 1 and mine[0].remove, mine
        assert "a pool of that name now is another one" in mine[0].reason
        stats.close()
    assert not os.path.exists(f"/dev/shm{stats_segment_name(pool_name)}")  # went with it


# ---------------------------------------------------------------- pools meant to stay

def _set_header(pool_name: str, field: str, fmt: str, value) -> None:
    with open(f"/dev/shm{L.segment_name(pool_name)}", "r+b") as f:
        f.seek(L.HEADER_DTYPE.fields[field][1])
        f.write(struct.pack(fmt, value))


def _pool_verdict(pool_name: str, **kwargs) -> siblings.Verdict:
    entry = L.segment_name(pool_name)[1:]
    return next(v for v in siblings.plan(prefix=pool_name, **kwargs) if v.entry == entry)


def test_a_pool_nobody_holds_is_an_orphan_unless_marked_to_stay(pool_name):
    """A pool lives while a process holds it: once its processes and its creator are dead,
    it is an orphan. Marked to stay, it is kept (idle, with the way to remove it) and goes
    only with include_idle, its lock and liveness file with it."""
    dead = _dead_pid()
    BlockPool.create(pool_name, 8).close()
    _set_header(pool_name, "creator_pid", "<I", dead)
    v = _pool_verdict(pool_name)
    assert v.remove and v.lifetime == "orphan" and not v.idle
    assert v.reason == (f"no live process attached (0 dead), creator pid {dead} dead; it was "
                        "never marked to stay")
    BlockPool.unlink(pool_name)

    pool = BlockPool.create(pool_name, 8)
    assert pool.stays_by is None
    pool.mark_stays("test run")
    assert pool.stays_by == "test run"
    pool.close()
    _set_header(pool_name, "creator_pid", "<I", dead)
    v = _pool_verdict(pool_name)
    assert not v.remove and v.lifetime == "stays" and v.idle
    assert v.reason.startswith("stays (made by test run); idle: no live process attached")
    assert f"`shmkv unlink {pool_name}` or `shmkv cleanup --include-idle`" in v.reason
    lock = next(w for w in siblings.plan(prefix=pool_name) if w.kind == "lock")
    assert not lock.remove and lock.reason == f"its pool {pool_name} stays"
    v = _pool_verdict(pool_name, include_idle=True)
    assert v.remove and v.reason.endswith("(--include-idle)")
    entry = L.segment_name(pool_name)[1:]
    done = {w.entry: ok for w, ok in
            siblings.remove(siblings.plan(include_idle=True, prefix=pool_name))}
    assert done == {entry: True, f"sem.{entry}.lock": True, f"{entry}.alive": True}
    assert not os.path.exists(f"/dev/shm/{entry}")


def test_a_pool_that_stays_is_kept_while_held_and_says_so(pool_name):
    """A pool marked to stay with a live process: kept, its reason says both."""
    with BlockPool.create(pool_name, 8) as pool:
        pool.mark_stays("shmkv create")
        v = _pool_verdict(pool_name, include_idle=True)
        assert not v.remove and v.lifetime == "stays" and not v.idle
        assert v.reason == (f"stays (made by shmkv create); 1 live process(es) attached "
                            f"(pid {os.getpid()})")


def test_a_pool_made_before_pools_recorded_it_is_kept_as_staying(pool_name):
    """A pool whose header records nothing (made by a shmkv from before `retention`) is
    read the safe way: it stays, and the reason says why."""
    dead = _dead_pid()
    BlockPool.create(pool_name, 8).close()
    _set_header(pool_name, "creator_pid", "<I", dead)
    _set_header(pool_name, "retention", "<I", L.RETENTION_UNRECORDED)
    v = _pool_verdict(pool_name)
    assert not v.remove and v.lifetime == "stays" and v.idle
    assert v.reason.startswith("stays (made by a shmkv that did not record whether a pool "
                               "stays: kept, to be safe); idle:")
    assert _pool_verdict(pool_name, include_idle=True).remove


def test_mark_stays_refuses_bad_input_and_keeps_the_first_mark(pool_name):
    """A bad `by` is refused, naming the rule, and writes nothing; marking again keeps the
    first mark."""
    import pytest

    from shmkv.errors import UsageError

    with BlockPool.create(pool_name, 8) as pool:
        before = pool.header_snapshot().tobytes()
        for bad in ("", "x" * 13, "caf\u00e9", "a\nb", None, 3):
            with pytest.raises(UsageError, match="1 to 12 printable ASCII characters"):
                pool.mark_stays(bad)
        assert pool.header_snapshot().tobytes() == before
        pool.mark_stays("first")
        pool.mark_stays("second")
        assert pool.stays_by == "first"
        hdr = pool.header_snapshot()
        assert int(hdr["retention"]) == L.RETENTION_STAYS and bytes(hdr["stays_by"]) == b"first"


def test_a_tier_stays_with_the_pool_it_is_the_tier_of(pool_name):
    """HiSparse's host tier of a pool that stays is kept with it (not taken for an orphan of
    its own); removed with it by include_idle."""
    dead = _dead_pid()
    with BlockPool.create(pool_name, 8) as pool:
        pool.mark_stays("test run")
        pool.tier("host", 8, enable_caching=True)
        pool._owner = False  # leave it, as a creator that exits without unlinking
    for name in (pool_name, f"{pool_name}.host"):
        _set_header(name, "creator_pid", "<I", dead)
    tier = _pool_verdict(f"{pool_name}.host")
    assert not tier.remove and tier.lifetime == "stays"
    assert tier.reason.startswith(f"a tier of pool {pool_name}, which stays (stays (made by")
    assert _pool_verdict(f"{pool_name}.host", include_idle=True).remove


def test_a_scoped_plan_sees_only_its_names(pool_name):
    """plan(prefix=...) gives only the objects whose name (or pool's name) starts with the
    prefix, each with the verdict of the whole plan; an empty prefix is refused."""
    import pytest

    from shmkv.errors import UsageError
    from tests.conftest import unique_pool_name

    dead = _dead_pid()
    other = unique_pool_name("other")
    try:
        for name in (pool_name, other):
            BlockPool.create(name, 8).close()
            _set_header(name, "creator_pid", "<I", dead)
        scoped = siblings.plan(prefix=pool_name)
        assert {v.entry for v in scoped} == {
            e for e in os.listdir("/dev/shm") if pool_name in e}
        whole = {v.entry: (v.remove, v.reason) for v in siblings.plan()}
        assert all(whole[v.entry] == (v.remove, v.reason) for v in scoped)
        siblings.remove(scoped)
        assert not [e for e in os.listdir("/dev/shm") if pool_name in e]
        assert os.path.exists(f"/dev/shm{L.segment_name(other)}")
        with pytest.raises(UsageError, match="prefix ''"):
            siblings.plan(prefix="")
        # in scope by its own name, or by its pool's
        stray = siblings.Verdict("x", "stats", f"{pool_name}-s", True, "", pool=other)
        assert siblings.in_scope(stray, pool_name)
        run = siblings.Verdict("x", "channel", other, True, "", pool=f"{pool_name}-q")
        assert siblings.in_scope(run, pool_name) and not siblings.in_scope(run, "zz")
    finally:
        BlockPool.unlink(other)


def test_unlink_says_what_it_frees(pool_name):
    """unlink_pool returns the /dev/shm memory of every file it removed."""
    from shmkv.stats import PoolStats

    with BlockPool.create(pool_name, 64) as pool:
        PoolStats.open(pool).close()
        pool._owner = False
    files = [e for e in os.listdir("/dev/shm") if pool_name in e]
    expected = sum(os.lstat(f"/dev/shm/{e}").st_blocks * 512 for e in files)
    assert len(files) == 4 and expected > 0  # segment, lock, liveness, stats
    found, removed, freed = siblings.unlink_pool(pool_name, BlockPool.TIERS)
    assert found and removed == ["stats"] and freed == expected
    assert siblings.human_bytes(freed).endswith("KiB")
    assert [siblings.human_bytes(n) for n in (0, 1023, 1536, 5 << 20, 3 << 30, 1 << 42)] == [
        "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB", "4096.0 GiB"]


def _make_and_close(name: str, stays: bool, stats: bool) -> None:
    from shmkv.stats import PoolStats

    pool = BlockPool.create(name, 8)
    if stays:
        pool.mark_stays("a test")
    if stats:
        PoolStats.open(pool).close()
    pool.close()


def _orphan(name: str, stays: bool = False, stats: bool = False) -> None:
    """Makes a pool whose creator closed it and exited: an orphan, or with ``stays`` one
    meant to stay (as ``shmkv create`` makes); with ``stats``, with its stats segment."""
    p = mp.get_context("spawn").Process(target=_make_and_close, args=(name, stays, stats))
    p.start()
    p.join(60)
    assert p.exitcode == 0


def test_a_pool_made_again_between_plan_and_remove_is_left_alone(pool_name):
    # An orphan is judged; before the plan is carried out it is removed (another cleanup)
    # and made again under its name, meant to stay: the plan must not remove the new pool.
    _orphan(pool_name)
    entry = L.segment_name(pool_name)[1:]
    plan = siblings.plan(prefix=pool_name)
    judged = next(v for v in plan if v.entry == entry)
    assert judged.remove and judged.lifetime == "orphan" and judged.pool_id
    BlockPool.unlink(pool_name)
    _orphan(pool_name, stays=True)
    new_id = siblings.pool_identity(pool_name)[2]
    assert new_id != judged.pool_id
    done = {v.entry: (ok, v.reason) for v, ok in siblings.remove(plan)}
    assert done[entry] == (False, siblings.CHANGED)
    assert done[f"sem.{entry}.lock"][0] is False and done[f"{entry}.alive"][0] is False
    assert all(os.path.exists(p) for p in (f"/dev/shm/{entry}", f"/dev/shm/{entry}.alive",
                                           f"/dev/shm/sem.{entry}.lock"))
    assert siblings.pool_identity(pool_name)[2] == new_id
    # judged afresh, the new pool stays
    assert not _verdict(entry).remove


def test_a_pool_attached_to_between_plan_and_remove_is_left_alone(pool_name):
    _orphan(pool_name)
    entry = L.segment_name(pool_name)[1:]
    plan = siblings.plan(prefix=pool_name)
    assert next(v for v in plan if v.entry == entry).remove
    with BlockPool.attach(pool_name):
        done = {v.entry: (ok, v.reason) for v, ok in siblings.remove(plan)}
        assert done[entry] == (False, siblings.CHANGED)
        assert os.path.exists(f"/dev/shm/{entry}")


def test_a_pool_without_a_header_is_left_to_shmkv_unlink(pool_name):
    # Its creator was killed before writing the header: cleanup cannot tell it from a pool
    # being made, so it keeps it and names the command that removes it.
    entry = L.segment_name(pool_name)[1:]
    fd = os.open(f"/dev/shm/{entry}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    v = _verdict(entry)
    assert not v.remove and v.reason.endswith(f"`shmkv unlink {pool_name}` removes it")
    assert siblings.unlink_pool(pool_name, ()).found
    assert not os.path.exists(f"/dev/shm/{entry}")


def test_a_sibling_made_again_between_plan_and_remove_is_left_alone(pool_name):
    # The same with a pool's stats segment: the plan judged the orphan's; the new pool's,
    # under the same name, stays.
    _orphan(pool_name, stats=True)
    stats = L.sibling_segment_name("stats", pool_name, L.STATS_VERSION)[1:]
    plan = siblings.plan(prefix=pool_name)
    assert next(v for v in plan if v.entry == stats).remove
    siblings.unlink_pool(pool_name, ())
    _orphan(pool_name, stays=True, stats=True)
    done = {v.entry: (ok, v.reason) for v, ok in siblings.remove(plan)}
    assert done[stats] == (False, siblings.CHANGED)
    assert os.path.exists(f"/dev/shm/{stats}")
    assert not _verdict(stats).remove
    siblings.unlink_pool(pool_name, ())


# ---------------------------------------------------------------- idle for how long

def _age(pool_name: str, seconds: float) -> float:
    """Sets back the record of the last join or leave of ``pool_name`` (the times of its
    liveness file and replica lock file, ``lifecycle.presence_paths``) by ``seconds``, as if
    it had been idle that long; returns that time."""
    from shmkv.pool import lifecycle as LC

    then = time.time() - seconds
    for path in LC.presence_paths(pool_name):
        if os.path.exists(path):
            os.utime(path, (then, then))
    return then


def test_idle_for_removes_a_pool_meant_to_stay_once_idle_that_long(pool_name):
    """A pool meant to stay whose creator exited is idle since its last join or leave: with
    idle_for it is kept while younger, removed once idle that long; a process that joins and
    leaves makes it young again, also between the plan and its removal."""
    _orphan(pool_name, stays=True)
    entry = L.segment_name(pool_name)[1:]
    v = _pool_verdict(pool_name, idle_for=3600)
    assert not v.remove and v.idle and v.stays_by == "a test"
    assert time.time() - 60 < v.idle_since <= time.time()
    assert ", less than --idle-for 60 min; `shmkv unlink" in v.reason
    assert not _pool_verdict(pool_name).remove  # without idle_for: kept, as always
    then = _age(pool_name, 2 * 3600)
    v = _pool_verdict(pool_name, idle_for=3600)
    assert v.remove and abs(v.idle_since - then) < 1e-3 and not v.idle_since_is_lower_bound
    assert v.reason.startswith("stays (made by a test); idle: no live process attached "
                               "(0 dead)")
    assert v.reason.endswith("; idle for 2.0 h, at least --idle-for 60 min")
    assert not _pool_verdict(pool_name).remove
    plan = siblings.plan(idle_for=3600, prefix=pool_name)
    with BlockPool.attach(pool_name, label="look") as pool:  # a join and a leave
        pool.check_invariants()
    assert time.time() - 60 < _pool_verdict(pool_name, idle_for=3600).idle_since
    done = {w.entry: (ok, w.reason) for w, ok in siblings.remove(plan)}
    assert done[entry] == (False, siblings.CHANGED)
    assert os.path.exists(f"/dev/shm/{entry}")
    _age(pool_name, 2 * 3600)
    done = {w.entry: ok for w, ok in
            siblings.remove(siblings.plan(idle_for=3600, prefix=pool_name))}
    assert done == {entry: True, f"sem.{entry}.lock": True, f"{entry}.alive": True}
    assert not [e for e in os.listdir("/dev/shm") if pool_name in e]


def test_idle_for_refuses_what_is_not_a_time(pool_name):
    """A negative, infinite, NaN or non-number idle_for, or one with include_idle, is
    refused, naming it, before anything is read."""
    import pytest

    from shmkv.errors import UsageError

    for bad in (-1, float("inf"), float("nan"), "1h", True):
        with pytest.raises(UsageError, match="idle_for .*: give the seconds"):
            siblings.plan(idle_for=bad, prefix=pool_name)
    with pytest.raises(UsageError, match="give one"):
        siblings.plan(idle_for=60, include_idle=True, prefix=pool_name)
    assert [siblings.duration_text(s) for s in (0, 119, 120, 7199, 7200, 2 * 86400)] == [
        "0 s", "119 s", "2 min", "120 min", "2.0 h", "2.0 d"]
