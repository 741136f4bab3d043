"""The linearizability checker: multi-process histories of one shmkv pool, replayed through
vLLM 0.33.0's own ``BlockPool`` in lock order.

Each process of a run records its calls (``shmkv/pool/recorder.py``): every call's
arguments, answer and KV events, and the number of the lock hold it ran in (the header's
``lock_seq``, bumped inside every hold), plus every slot release (a dead process reaped, a
process's own references given back at ``close``) with its hold. The checker

1. reads every history; one without an ``Opened`` record (emptied by a recorder that
   stopped, or not a history) is a difference, and so are histories of different pools
   (name or config); a hold number seen in two processes is a difference at once (two
   processes in one hold: the lock did not exclude them);
2. settles which holds took effect. A hold of a process followed by another hold of the
   same process committed (the commit is the release). A process that never wrote
   ``Closed`` died: its last hold is rolled back if a call in it has no ``Exit`` (it died
   before the release, and the next holder rolled the hold back from the undo journal);
   if every call of it finished, it may have committed or not, and both are tried;
3. merges the records of the holds that took effect by (hold, call number) and replays them
   one at a time through one vLLM ``BlockPool`` of the same config, block ids mapped one to
   one (vLLM's ``blocks[i]`` for shmkv's block ``i``), and compares:
   - ``get_new_blocks``: the ids handed out, or the capacity error's message;
   - ``get_cached_block``: the hit's ids, or None; ``get_cached_prefix``: the ids of the
     longest run of leading hits (vLLM's managers' loop of ``get_cached_block``);
   - ``reset_prefix_cache``: its bool;
   - the KV events each call queued (vLLM's ``take_events()`` after the call, as builtins);
   - a release: the references the ledger gave back, block by block, against the references
     the replay says that process holds (its ``get_new_blocks`` and ``touch`` minus its
     ``free_blocks``), replayed as vLLM's ``free_blocks`` in the release's order;
   - at the end, given the pool's final state: the free queue, head to tail, and every
     block's ``ref_cnt``, ``block_hash`` and ``block_hash_num_tokens``.
   ``free_blocks``, ``touch``, ``cache_full_blocks`` and ``evict_blocks`` return nothing;
   their effect is what the later answers and the end state check.

A call that shmkv refused for bad input (``UsageError``) changed nothing and is skipped, once
vLLM, run on a copy of its pool, refuses it too (or the call lies outside the ordinary domain,
where shmkv is stricter by design): a valid call shmkv refused is a difference. A
call this checker does not model (``unpin_blocks``...) is a difference.
"""

from __future__ import annotations

import copy
import glob
import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.lora.request import LoRARequest
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

from shmkv.pool.recorder import Closed, Enter, Exit, Opened, Released, read_history

_REFUSED = object()  # vLLM refused the call as shmkv did (the same capacity error)
MAX_AMBIGUOUS = 10  # holds whose commit is unknown: 2**this replays at most


@dataclass
class FinalState:
    """The pool at the end: the free queue and (ref_cnt, block_hash, num_tokens) per block."""

    free_ids: list[int]
    blocks: list[tuple[int, bytes | None, int | None]]
    seq: int  # the hold it was read in: compared after every hold up to this one

    @classmethod
    def of(cls, pool: Any) -> FinalState:
        with pool.lock():
            return cls(pool.get_free_block_ids(),
                       [(b.ref_cnt, b.block_hash, b.block_hash_num_tokens) for b in pool.blocks],
                       int(pool.header_snapshot()["lock_seq"]))


@dataclass(eq=False)
class _Request:
    """What vLLM's BlockPool reads of a request."""

    all_token_ids: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None = None
    lora_request: Any = None
    session_id: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None


@dataclass
class Step:
    seq: int
    proc: int  # the history's index
    who: tuple[int, int]  # (pid, slot) of its pool handle
    n: int
    rec: Enter | Released
    exit: Exit | None = None
    # Replay order: (hold, call, 0 if a release inside that call); key for pool calls (a
    # release comes before the innermost call it ran in), outer_key for calls made around
    # pool calls (before the outermost).
    key: tuple[int, int, int] = (0, 0, 0)
    outer_key: tuple[int, int, int] = (0, 0, 0)


@dataclass
class Report:
    """``calls_replayed``: the calls and releases replayed in the accepted replay;
    ``switches``: how often consecutive holds of it belong to different processes (how
    much the processes interleaved); ``replays``: how many ways of settling the holds of
    unknown outcome were tried."""

    histories: int = 0
    processes: int = 0
    calls_replayed: int = 0
    switches: int = 0
    holds_rolled_back: int = 0
    holds_ambiguous: int = 0
    replays: int = 0
    differences: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.differences


class _Mismatch(Exception):
    pass


def load(paths: list[str]) -> tuple[list[Step], dict[int, bool], list[str]]:
    """Every step of every history (``Step.proc``: the history's index); per history, whether
    its process closed the pool; differences found reading."""
    steps: list[Step] = []
    closed: dict[int, bool] = {}
    problems: list[str] = []
    for proc, path in enumerate(paths):
        records, _cut = read_history(path)
        opened = next((r for r in records if isinstance(r, Opened)), None)
        if opened is None:  # (a reap at attach may come before it)
            problems.append(f"{path}: has no Opened record: not a whole history (its "
                            "recorder stopped, or it is none)")
            continue
        who = (opened.pid, opened.slot)
        closed[proc] = any(isinstance(r, Closed) for r in records)
        by_n: dict[int, Step] = {}
        running: list[Step] = []  # the calls entered and not exited, outermost first
        for r in records:
            if isinstance(r, (Enter, Released)):
                by_n[r.n] = step = Step(r.seq, proc, who, r.n, r, key=(r.seq, r.n, 1),
                                        outer_key=(r.seq, r.n, 1))
                if isinstance(r, Enter):
                    running.append(step)
                elif running:
                    # A release inside a call (a reap when short of blocks) came before it.
                    step.key = (r.seq, running[-1].n, 0)
                    step.outer_key = (r.seq, running[0].n, 0)
                steps.append(step)
            elif isinstance(r, Exit):
                by_n[r.n].exit = r
                if running and running[-1].n == r.n:
                    running.pop()
        seqs = [s.seq for s in by_n.values()]
        if seqs != sorted(seqs):
            problems.append(f"{path}: hold numbers go back within one process")
    owner: dict[int, int] = {}
    for s in steps:
        if owner.setdefault(s.seq, s.proc) != s.proc:
            problems.append(f"hold {s.seq} ran in two processes at once (histories "
                            f"{owner[s.seq]} and {s.proc}): the lock did not exclude them")
    return steps, closed, problems


def _settle(steps: list[Step], closed: dict[int, bool]) -> tuple[set[int], list[int]]:
    """(holds rolled back, holds that may or may not have committed)."""
    rolled_back: set[int] = set()
    ambiguous: list[int] = []
    for proc, did_close in closed.items():
        mine = [s for s in steps if s.proc == proc]
        if did_close or not mine:
            continue
        last = max(s.seq for s in mine)
        in_last = [s for s in mine if s.seq == last]
        if any(isinstance(s.rec, Enter) and s.exit is None for s in in_last):
            rolled_back.add(last)
        else:
            ambiguous.append(last)
    return rolled_back, sorted(ambiguous)


def _events(pool: VllmBlockPool) -> list[Any]:
    return [msgspec.json.decode(msgspec.json.encode(msgspec.to_builtins(e)))
            for e in pool.take_events()]


def _recorded_events(ex: Exit) -> list[Any]:
    return [msgspec.json.decode(msgspec.json.encode(e)) for e in ex.events]


class Replayer:
    """One vLLM BlockPool, and per process the references it holds."""

    def __init__(self, config: Opened) -> None:
        self.pool = VllmBlockPool(config.num_blocks, config.enable_caching,
                                  config.hash_block_size, config.enable_kv_cache_events)
        self.events = config.enable_kv_cache_events
        self.held: dict[tuple[int, int], Counter] = {}  # (pid, slot) -> references
        self.num_blocks = config.num_blocks

    def blocks(self, ids: list[int]) -> list[Any]:
        return [self.pool.blocks[i] for i in ids]

    def step(self, s: Step) -> None:
        where = f"hold {s.seq}, pid {s.who[0]}, call {s.n}"
        if isinstance(s.rec, Released):
            refs = Counter(dict(s.rec.blocks))
            mine = self.held.setdefault((s.rec.pid, s.rec.slot), Counter())
            if +mine != refs:
                raise _Mismatch(f"{where}: released slot {s.rec.slot} (pid {s.rec.pid}) gave back "
                                f"{sorted(refs.items())}; the replay says it held "
                                f"{sorted((+mine).items())}")
            self.pool.free_blocks([self.pool.blocks[b] for b, c in s.rec.blocks
                                   for _ in range(c)])
            mine.clear()
            return
        op, a, ex = s.rec.op, s.rec.args, s.exit
        if ex.error_type == "UsageError":  # refused for bad input: nothing changed
            self._check_refused(s, where)
            return
        got = self._apply(s, where)
        if got is _REFUSED:
            return
        if ex.error_type is not None:
            raise _Mismatch(f"{where}: {op} raised {ex.error_type}: {ex.error} in shmkv; vLLM "
                            f"answered {got!r}")
        if got != ex.result:
            raise _Mismatch(f"{where}: {op}({_short(a)}): shmkv answered {ex.result!r}, vLLM "
                            f"{got!r}")
        if self.events:
            mine_ev, theirs = _recorded_events(ex), _events(self.pool)
            if mine_ev != theirs:
                raise _Mismatch(f"{where}: {op} events: shmkv {mine_ev!r}, vLLM {theirs!r}")

    def _check_refused(self, s: Step, where: str) -> None:
        """A call shmkv refused for bad input must be one vLLM refuses too, or one outside
        the ordinary domain (an id out of ``[0, num_blocks)``, a negative count: shmkv is
        stricter there by design); tried on a copy, since vLLM may change its pool before
        it refuses."""
        a = s.rec.args
        ids = a.get("block_ids", [])
        ordinary = (isinstance(ids, list)
                    and all(type(b) is int and 0 <= b < self.num_blocks for b in ids)
                    and (type(a.get("num_blocks", 0)) is int and a.get("num_blocks", 0) >= 0))
        if not ordinary:
            return
        try:
            copy.deepcopy(self)._apply(s, where)
        except Exception:  # noqa: BLE001  (vLLM, or the checker's ledger, refuses it too)
            return
        raise _Mismatch(f"{where}: shmkv refused {s.rec.op}({_short(a)}) as bad input "
                        f"({s.exit.error}); vLLM accepts it")

    def _apply(self, s: Step, where: str) -> Any:
        """Runs the call on vLLM's pool: its answer (None for calls that answer nothing),
        or _REFUSED for a capacity error equal to shmkv's."""
        op, a, ex = s.rec.op, s.rec.args, s.exit
        held = self.held.setdefault(s.who, Counter())
        got: Any = None
        if op == "get_new_blocks":
            try:
                got = [b.block_id for b in self.pool.get_new_blocks(a["num_blocks"])]
            except ValueError as exc:
                if ex.error != str(exc):
                    raise _Mismatch(f"{where}: get_new_blocks({a['num_blocks']}): vLLM raised "
                                    f"{exc!s}; shmkv answered {ex.result} {ex.error}") from None
                return _REFUSED
            held.update(got)
        elif op == "free_blocks":
            nonnull = [b for b in a["block_ids"] if b != 0]
            held.subtract(nonnull)
            if any(v < 0 for v in held.values()):
                raise _Mismatch(f"{where}: free_blocks({a['block_ids']}) frees blocks this "
                                f"process does not hold")
            self.pool.free_blocks(self.blocks(a["block_ids"]),
                                  **({"evict_first": True} if a.get("evict_first") else {}))
        elif op == "touch":
            held.update(b for b in a["block_ids"] if b != 0)
            self.pool.touch(self.blocks(a["block_ids"]))
        elif op == "cache_full_blocks":
            lora = a["lora"] and LoRARequest(a["lora"][0], a["lora"][1], a["lora"][2])
            request = _Request(a["all_token_ids"] or [], a["block_hashes"], a["cache_salt"],
                               lora, a.get("session_id"))
            self.pool.cache_full_blocks(request, self.blocks(a["block_ids"]),
                                        a["num_cached_blocks"], a["num_full_blocks"],
                                        a["block_size"], a["kv_cache_group_id"],
                                        a["block_mask"])
        elif op == "get_cached_block":
            hit = self.pool.get_cached_block(a["block_hash"], a["kv_cache_group_ids"])
            got = None if hit is None else [b.block_id for b in hit]
        elif op == "get_cached_prefix":
            limit = a["max_num_blocks"]
            hashes = a["block_hashes"] if limit is None else a["block_hashes"][:limit]
            got = []
            for h in hashes:
                hit = self.pool.get_cached_block(h, [a["kv_cache_group_id"]])
                if hit is None:
                    break
                got.append(hit[0].block_id)
        elif op == "evict_blocks":
            self.pool.evict_blocks(a["block_ids"])  # vLLM iterates it: the same order
        elif op == "reset_prefix_cache":
            got = self.pool.reset_prefix_cache()
        else:
            raise _Mismatch(f"{where}: {op} is not modelled by the checker")
        return got

    def compare_final(self, final: FinalState) -> None:
        free = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        if free != final.free_ids:
            raise _Mismatch(f"end: free queue shmkv {final.free_ids}, vLLM {free}")
        for i, (b, mine) in enumerate(zip(self.pool.blocks, final.blocks, strict=True)):
            theirs = (b.ref_cnt, b.block_hash, b.block_hash_num_tokens)
            if i and mine != theirs:  # the null block's ref_cnt is not maintained
                raise _Mismatch(f"end: block {i}: shmkv {mine}, vLLM {theirs}")


def _pool_of(opened: Opened) -> tuple[Any, ...]:
    return (opened.pool, opened.num_blocks, opened.enable_caching, opened.hash_block_size,
            opened.enable_kv_cache_events, opened.none_hash)


def _short(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}"[:80] for k, v in args.items()
                     if k not in ("block_hashes", "all_token_ids"))


def check(paths: list[str] | str, final: FinalState | None = None, *,
          level: str = "pool") -> Report:
    """Checks the histories (files, or a folder of ``*.history`` files) of one pool:
    ``level`` "pool" replays its pool calls through one vLLM ``BlockPool``; "manager"
    replays its ``mgr.*`` calls (``KVCacheManager`` calls recorded around the pool calls
    they made) through one vLLM ``KVCacheManager`` per process, all over ONE vLLM
    ``BlockPool`` (``ManagerReplayer``)."""
    if level not in ("pool", "manager"):
        raise ValueError(f"check(): level must be 'pool' or 'manager', got {level!r}")
    if isinstance(paths, str):
        paths = sorted(glob.glob(os.path.join(paths, "*.history")))
    report = Report(histories=len(paths))
    steps, closed, problems = load(paths)
    report.processes = len(closed)
    if problems:
        report.differences = problems
        return report
    configs = [next(r for r in read_history(p)[0] if isinstance(r, Opened)) for p in paths]
    config = configs[0]
    kinds = {_pool_of(c) for c in configs}
    if len(kinds) > 1:
        report.differences = [f"the histories are of {len(kinds)} pools (name, blocks, caching, "
                              f"tokens per hash, events, NONE_HASH): {sorted(kinds)}"]
        return report
    rolled_back, ambiguous = _settle(steps, closed)
    report.holds_rolled_back, report.holds_ambiguous = len(rolled_back), len(ambiguous)
    if len(ambiguous) > MAX_AMBIGUOUS:
        report.differences = [f"{len(ambiguous)} holds of unknown outcome: too many to try"]
        return report
    if level == "pool":
        steps = [s for s in steps if not getattr(s.rec, "op", "").startswith("mgr.")]
        steps.sort(key=lambda s: s.key)
        make = Replayer
    else:
        from tests.linearizability.manager_replay import ManagerReplayer as make

        steps = [s for s in steps if isinstance(s.rec, Released) or s.rec.op.startswith("mgr.")]
        steps.sort(key=lambda s: s.outer_key)
    first_failure = None
    for drop in itertools.product((False, True), repeat=len(ambiguous)):
        dropped = rolled_back | {seq for seq, d in zip(ambiguous, drop, strict=True) if d}
        replayer = make(config)
        report.replays += 1
        done = switches = 0
        last_proc = None
        compared = final is None
        try:
            for s in steps:
                if not compared and s.seq > final.seq:
                    replayer.compare_final(final)
                    compared = True
                if s.seq not in dropped:
                    try:
                        replayer.step(s)
                    except _Mismatch:
                        raise
                    except Exception as exc:  # vLLM refused the call (an assert...)
                        raise _Mismatch(f"hold {s.seq}: vLLM raised {exc!r} replaying "
                                        f"{getattr(s.rec, 'op', 'a release')}") from exc
                    done += 1
                    switches += last_proc is not None and s.proc != last_proc
                    last_proc = s.proc
            if not compared:
                replayer.compare_final(final)
        except _Mismatch as exc:
            first_failure = first_failure or str(exc)
            continue
        report.calls_replayed, report.switches = done, switches
        return report
    report.differences = [first_failure]
    return report
