"""One tier, one generation (``shmkv/pool/lifecycle.py``): wherever one object of a vLLM
offload tier is removed, remade or replaced while the others stay, no replica loads bytes
other than what its key's producer wrote. Each test drives the seam with real processes
(spawned workers, ``shmkv cleanup`` as a command, an earlier release of shmkv built from
git history) and byte-compares what a replica loads against what was stored under its key.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from shmkv.errors import LayoutMismatchError  # noqa: E402
from shmkv.pool import lifecycle as LC  # noqa: E402
from shmkv.pool.segment import Segment  # noqa: E402
from shmkv.vllm import SharedCPUOffloadingManager  # noqa: E402
from shmkv.vllm.lifecycle import join_as_worker  # noqa: E402
from shmkv.vllm.region import region_path  # noqa: E402
from shmkv.vllm.replicas import ReplicaLocks, replica_locks_path  # noqa: E402
from shmkv.vllm.tier import tier_table_name  # noqa: E402
from tests.conftest import unique_pool_name  # noqa: E402
from tests.multiprocess import tier_generation_workers as workers  # noqa: E402
from tests.multiprocess.conftest import join_processes  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
HIT, MISS = LookupResult.HIT, LookupResult.MISS
NUM_CHUNKS = 4
CHUNK_BYTES = os.sysconf("SC_PAGE_SIZE")
DATA_BYTES = NUM_CHUNKS * CHUNK_BYTES
CTX = ReqContext("gen")
EARLIER_RELEASE = "d1248c4^"  # the tree before the tier counters: tier table v2, pool v8
TIER_V4_RELEASE = "3080ff5"  # the last tree of tier table v4 (pool v9), before the replica labels


def key(i: int):
    return make_offload_key(str(i).encode(), 0)


def shmkv(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "shmkv.cli", *args], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    return out


class Replica:
    """One replica in this process: its GPU worker's join (and its mapping of the region),
    then its engine core's manager, as vLLM builds them."""

    def __init__(self, pool: str, replica: str) -> None:
        self.locks, binding = join_as_worker(pool, NUM_CHUNKS, 16, replica, DATA_BYTES)
        self.tag, self.generation = binding.tag, binding.generation
        self.region = np.memmap(region_path(pool), np.uint8, "r+", 0, (NUM_CHUNKS, CHUNK_BYTES))
        self.core: SharedCPUOffloadingManager | None = None
        self.pool, self.replica = pool, replica

    def start_core(self) -> SharedCPUOffloadingManager:
        self.core = SharedCPUOffloadingManager(self.pool, NUM_CHUNKS, replica_id=self.replica)
        return self.core

    def store(self, i: int, value: int) -> None:
        """Stores key ``i``, its worker writing ``value`` into every byte of the chunk."""
        out = self.core.prepare_store([key(i)], CTX)
        assert out is not None and out.keys_to_store == [key(i)]
        self.region[int(out.store_spec.block_ids[0]), :] = value
        self.core.complete_store(out.keys_to_store, CTX)

    def load(self, i: int) -> bytes | None:
        """Key ``i``'s bytes as this replica loads them (None: a miss)."""
        if self.core.lookup(key(i), CTX) != HIT:
            return None
        chunk = int(self.core.prepare_load([key(i)], CTX).block_ids[0])
        data = self.region[chunk, :].tobytes()
        self.core.complete_load([key(i)], CTX)
        return data

    def close(self) -> None:
        if self.core is not None and self.core.pool is not None:
            self.core.pool.check_invariants()
            self.core.close()
        self.region = None
        self.locks.close()


@pytest.fixture
def tier():
    name = unique_pool_name("gen")
    replicas: list[Replica] = []

    def replica(which: str, core: bool = True) -> Replica:
        r = Replica(name, which)
        replicas.append(r)
        if core:
            r.start_core()
        return r

    yield name, replica
    for r in reversed(replicas):
        r.close()
    SharedCPUOffloadingManager.unlink(name)
    assert not [e for e in os.listdir("/dev/shm") if name in e]


def _tier_objects(name: str) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if name in e and ".making-" not in e)


@pytest.mark.timeout(120)
def test_cleanup_keeps_a_tier_whose_starting_replica_holds_it(spawn_ctx, tier):
    """Replica A's worker makes the tier and dies during warm-up; replica B's worker has
    joined and mapped the region, its engine core not up yet (it holds the tier by its
    replica lock file alone, attached to no pool). ``shmkv cleanup`` keeps every object of
    the tier, naming the hold; B's core then stores, and replica C loads B's bytes."""
    name, replica = tier
    proc = spawn_ctx.Process(target=workers.worker_that_dies,
                             args=(name, NUM_CHUNKS, DATA_BYTES, "A"))
    proc.start()
    assert join_processes([proc]) == [0]
    b = replica("B", core=False)
    before = _tier_objects(name)
    assert len(before) >= 5, before  # pool, its lock and liveness file, table, locks, region
    dry = shmkv("cleanup", "--dry-run", "--prefix", name)
    assert "hold" in dry.stdout and replica_locks_path(name) in dry.stdout, dry.stdout
    out = shmkv("cleanup", "--prefix", name)
    assert out.returncode == 0, out.stderr
    assert _tier_objects(name) == before, out.stdout
    b.start_core()
    b.store(1, ord("B"))
    c = replica("C")
    assert c.load(1) == b"B" * CHUNK_BYTES


@pytest.mark.timeout(120)
def test_cleanup_leaves_a_region_being_made(spawn_ctx, tier):
    """A worker is making the tier's data region (the maker's byte of the replica lock file
    taken, the file under its temporary name) while the pool's maker has died: cleanup
    removes neither the region being made nor anything else of the tier."""
    name, replica = tier
    proc = spawn_ctx.Process(target=workers.worker_that_dies,
                             args=(name, NUM_CHUNKS, DATA_BYTES, "A"))
    proc.start()
    assert join_processes([proc]) == [0]
    from shmkv.pool.block_pool import BlockPool

    with BlockPool.attach(name) as pool:
        generation = pool.generation
        with pool.lock():
            locks = ReplicaLocks(name, generation)
    try:
        assert locks.try_region_maker()
        making = f"{region_path(name)}.making-feedc0de"
        with open(making, "wb") as f:
            f.truncate(DATA_BYTES)
        before = _tier_objects(name)
        out = shmkv("cleanup", "--prefix", name)
        assert out.returncode == 0, out.stderr
        assert os.path.exists(making), out.stdout
        assert _tier_objects(name) == before, out.stdout
    finally:
        locks.close()
        os.unlink(making)


@pytest.mark.timeout(120)
def test_a_table_removed_alone_never_lets_the_pool_answer_hit(tier):
    """Replica B stores key 1 and stops; the tier table alone is removed (by hand, a tmp
    cleaner). The next replica makes the table again and the pool forgets every key: key 1
    is a miss, never zeros. While a replica still holds the tier, removing the table again
    refuses every newcomer, naming the table, and the running replica goes on."""
    name, replica = tier
    b = replica("B")
    b.store(1, ord("B"))
    b.close()
    assert Segment.unlink(tier_table_name(name))
    c = replica("C")
    assert c.load(1) is None
    c.store(2, ord("C"))
    assert Segment.unlink(tier_table_name(name))
    with pytest.raises(LayoutMismatchError, match=r"tier table .* was removed while the tier "
                                                  r"is in use"):
        replica("D")
    assert c.load(2) == b"C" * CHUNK_BYTES


@pytest.mark.timeout(120)
def test_unlink_refuses_a_tier_in_use_and_force_says_what_is_lost(tier):
    """`shmkv unlink` of a tier whose replica's worker holds it is refused (exit 1), naming
    the hold, and removes nothing; with --force the tier goes whole, root first, the command
    saying what the running replicas lose; a replica started afterwards makes a new
    generation, and the old replica's bytes are never its hits."""
    name, replica = tier
    a = replica("A")
    a.store(1, ord("A"))
    before = _tier_objects(name)
    out = shmkv("unlink", name)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "is a shared tier in use" in out.stderr and "--force" in out.stderr
    assert _tier_objects(name) == before
    forced = shmkv("unlink", "--force", name)
    assert forced.returncode == 0, forced.stderr
    assert "while in use" in forced.stderr and "next restart" in forced.stderr
    assert _tier_objects(name) == []
    b = replica("B")
    assert b.generation != a.generation
    assert b.load(1) is None
    a.store(2, ord("A"))  # the old replica goes on alone, on its own generation
    assert a.load(2) == b"A" * CHUNK_BYTES and b.load(2) is None


def _earlier_release(tmp_path: Path, release: str = EARLIER_RELEASE) -> Path:
    """The tree of ``release`` (default ``EARLIER_RELEASE``: shmkv before tier generations),
    unpacked."""
    import vllm

    if not vllm.__version__.startswith("0.33."):
        pytest.skip(f"the earlier release runs on vLLM 0.33 only (this is {vllm.__version__})")
    try:
        data = subprocess.run(["git", "-C", str(ROOT), "archive", release, "shmkv"],
                              capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the earlier release {release} is not in this checkout's git "
                    f"history ({exc}); a full clone has it")
    tree = tmp_path / "earlier"
    tree.mkdir()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _run_earlier(tree: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, str(tree), *args], cwd=tree,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_an_earlier_release_never_meets_this_tier(tier, tmp_path):
    """A replica of an earlier shmkv (tier table v2 on a v8 pool: no generations), started
    on the same pool name after a current replica stored key 1, finds nothing of this tier:
    it misses key 1 (it would load zeros: its worker makes its own region), and what it
    stores is not a hit here. Each side loads exactly its own bytes, and a current replica
    started afterwards maps this tier's region, not the earlier release's. Once the earlier
    replica has stopped, this release's unlink removes the earlier tier whole, its v8 pool
    first (the fixture's teardown finds nothing of the name left)."""
    tree = _earlier_release(tmp_path)
    name, replica = tier
    new = replica("N")
    new.store(1, ord("N"))
    out = _run_earlier(tree, workers.EARLIER_RELEASE_REPLICA, name, str(NUM_CHUNKS),
                       str(DATA_BYTES))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"lookup_1": "MISS"}, seen
    later = replica("M")
    assert later.load(1) == b"N" * CHUNK_BYTES
    assert later.load(2) is None
    assert os.path.exists(f"/dev/shm/shmkv-{name}-v8")  # the earlier tier, idle, kept


@pytest.mark.timeout(300)
def test_a_tier_v4_release_never_meets_this_tier(tier, tmp_path):
    """The release before tier table v5 (tier v4, pool v9) and this one, taking turns on one
    pool name, each find only their own keys, and load each key's own bytes: the v4 replica
    misses key 2, which this release stored after it (sharing the pool, as a bump of the
    tier's version alone left them, it would hit and load its own region's bytes of key 1),
    and this release misses key 1. This release's unlink then removes the v4 tier whole
    (the fixture's teardown finds nothing of the name left)."""
    tree = _earlier_release(tmp_path, TIER_V4_RELEASE)
    name, replica = tier

    def v4(action: str, i: int, value: int = 0) -> dict:
        out = _run_earlier(tree, workers.TIER_V4_REPLICA, name, str(NUM_CHUNKS),
                           str(DATA_BYTES), action, str(i), str(value))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert v4("store", 1, ord("O"))["lookup"] == "MISS"
    new = replica("N")
    assert new.load(1) is None
    new.store(2, ord("N"))
    seen = v4("load", 2)
    assert seen["region"].endswith(f"offload4_data-{name}.mmap"), seen
    assert seen == {"region": seen["region"], "lookup": "MISS"}, seen
    assert v4("load", 1) == {"region": seen["region"], "lookup": "HIT", "loaded": ord("O")}
    assert new.load(2) == b"N" * CHUNK_BYTES
    assert os.path.exists(f"/dev/shm/shmkv-{name}-v9")  # the v4 tier, idle, kept
    assert os.path.exists(seen["region"])


@pytest.mark.timeout(120)
def test_a_stale_lock_file_of_another_generation(tier):
    """The replica lock file at the tier's path records another generation (a removed tier's):
    nobody holding it, it is made again for this generation; held, a newcomer is refused
    naming the file and both generations."""
    name, replica = tier
    path = replica_locks_path(name)
    LC.make_lock_file(path, b"\x01" * LC.GENERATION_BYTES)
    first = replica("A")  # makes the pool: the stale file goes
    with open(path, "rb") as f:
        assert f.read(LC.GENERATION_BYTES) == first.generation
    first.close()
    SharedCPUOffloadingManager.unlink(name)
    LC.make_lock_file(path, b"\x02" * LC.GENERATION_BYTES)
    holder = os.open(path, os.O_RDWR)
    try:
        import fcntl

        fcntl.fcntl(holder, fcntl.F_OFD_SETLK, LC._FLOCK.pack(fcntl.F_RDLCK, 0, 5, 1, 0))
        with open(path, "rb") as f:
            planted = f.read()
        with pytest.raises(LayoutMismatchError, match=r"generation 020202020202, the pool"):
            replica("B")
        # the refused start made the pool and table, and took them back: only the
        # planted file is left, as it was
        assert _tier_objects(name) == [os.path.basename(path)]
        with open(path, "rb") as f:
            assert f.read() == planted
    finally:
        os.close(holder)
        os.unlink(path)
