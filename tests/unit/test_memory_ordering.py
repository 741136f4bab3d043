"""Memory ordering (issue 15, item 9): the stores that publish other stores are ordered
in C (release stores, compiler barriers) and in the Python paths (a C full fence).

x86-64 keeps stores in order, so no run on it can show a missing barrier; these tests
check, in the sources, that every publishing store goes through the ordered form (each
failed before the fix), and that the Python fence is the C kernel's barrier. The orders
themselves are written down in shmkv/pool/layout.py, "Memory ordering"."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import shmkv.pool
from shmkv.messages import Channel
from shmkv.pool import barriers
from shmkv.pool.block_pool import _ckernel
from shmkv.ranks.block_table import SharedBlockTables

C_SOURCE = (Path(shmkv.pool.__file__).parent / "_ckernel.c").read_text()


def test_c_publishing_stores_are_release_stores():
    """No plain store to journal_len, the holder record, lock_seq or lock_phase is left in
    the C kernel: each is a STORE_REL (release) store."""
    plain = re.compile(
        r"hdr64\[(H_JOURNAL_LEN|l->h_holder|l->h_incarnation|l->h_since|H_LOCK_SEQ)\]\s*(\+?=)(?!=)"
        r"|\*l->phase\s*=(?!=)"
    )
    bad = [line.strip() for line in C_SOURCE.splitlines() if plain.search(line)]
    assert bad == [], f"plain stores that publish: {bad}"


def test_c_journaled_stores_have_a_compiler_barrier_before_the_data():
    """J32/J64: journal_save (entry, then journal_len), a compiler barrier, then the data
    store; without it the compiler may move the data store before journal_len."""
    for name in ("J32", "J64"):
        body = C_SOURCE.split(f"#define {name}(k, lvalue, value)", 1)[1].split("while (0)", 1)[0]
        save, barrier, store = (body.find(s) for s in ("journal_save(", "COMPILER_BARRIER();",
                                                       "*p_ = v_;"))
        assert -1 < save < barrier < store, f"{name}: {body}"


def _order(fn, *needles: str) -> list[int]:
    src = inspect.getsource(fn)
    return [src.find(n) for n in needles]


@pytest.mark.parametrize("fn, before, fence_then", [
    (Channel.send_bytes, "data[pos + 4:pos + 4 + len(payload)] = payload", "self._tail[0] ="),
    (Channel.poll_bytes, "tail = int(self._tail[0])", "length = int.from_bytes"),
    (Channel.poll_bytes, "payload = bytes(", "self._head[0] ="),
    (SharedBlockTables.commit, "self._begin_write()", "self._swords[_STEP_WORD] = step"),
    (SharedBlockTables._wait_even, "seq = int(self._words[_SEQ_WORD])", "return seq"),
    (SharedBlockTables.read, "index_select(1, idx)", "step = int(self._swords"),
])
def test_python_publishers_fence_between_data_and_index(fn, before, fence_then):
    """Each Python path that publishes (or reads what is published) fences between the data
    and the word that publishes it."""
    src = inspect.getsource(fn)
    a, b = src.find(before), src.find(fence_then)
    assert -1 < a < b, (before, fence_then)
    assert "_fence()" in src[a:b], \
        f"{fn.__qualname__}: no fence between {before!r} and {fence_then!r}"


@pytest.mark.skipif(_ckernel is None, reason="shmkv.pool._ckernel is not built")
def test_the_python_fence_is_the_c_barrier():
    assert barriers.HAVE_FENCE and barriers.fence is _ckernel.fence
    assert barriers.fence() is None
