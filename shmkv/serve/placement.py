"""Where a run's KV cache lives (``--kv``), and the rank's view of it.

Block ids of the pool name the slots in both placements; what differs is where the bytes
are and who copies them.

``device`` (``DeviceKV``): ONE KV tensor per pool, ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_size]``, a block id being its row. The front end creates it once; every
rank of the pool opens the same memory and attends over it in place, so a prefix one rank
computed is read by the others with no copy, and the pool's blocks are the memory budget.
On a GPU the tensor is in device memory, exported by the front end and opened by each rank
through CUDA IPC (``export_device_tensor`` / ``open_device_tensor``); on the CPU it is the
``KVStore``'s shared-memory tensor, which every rank maps (the CPU twin: the same rows, the
same code above them).

``host`` (``HostCache``): the node-wide ``KVStore`` in shared memory (page-locked on a GPU
node) holds every block; each rank keeps a cache on its device for the requests it runs,
``[num_layers, 2, rows, ...]`` with ``rows = max_num_reqs x sum of the groups' table widths
+ 1`` (row 0 stands for the null block), and per step:

1. maps each scheduled request's blocks to cache rows (``_Held``: per group, block index ->
   block id, row, valid positions, loaded-from-host), keeping those it already has with
   the same block id and enough valid positions, and picks fresh rows for the others;
2. copies in, in one ``KVStore.load_blocks`` call, every fresh block that holds context
   (positions before the step's first): a prefix hit, which the host store holds, because
   whoever filled the block stored it before its scheduler cached it;
3. runs the model over the cache through block tables translated to rows;
4. copies out, in one ``KVStore.store_blocks`` call (which returns once the store holds
   them), every block the step completed (its last position written now, not loaded):
   before the rank answers, so before its scheduler may cache it. That keeps the step
   handshake's rule: a block another process can hit already holds its K/V in the store.

A request whose table row is taken by another was finished or preempted: its rows are
freed. Rows never move while a request runs (``shmkv/serve/scheduler.py``); a preempted
request comes back with its context as prefix hits, starting before where its last step
ended: its rows are freed then, and the hits are copied in like any request's. (Kept, the
rank's copy of the hit holding the last prompt token, which a request whose every prompt
block hits computes again, would be stored again: a cached block written while other ranks
may be copying it in.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shmkv.errors import UsageError
from shmkv.pool.layout import NULL_BLOCK_ID
from shmkv.ranks.block_table import (
    KVStore,
    compute_slot_mapping,
    export_device_tensor,
    open_device_tensor,
)

__all__ = ["DeviceKV", "HostCache", "KVPlacement", "PoolKV", "open_rank_kv"]


@dataclass(frozen=True)
class KVPlacement:
    """What a rank needs to open its pool's KV (a process argument, pickled)."""

    kind: str  # "device" or "host"
    device: str  # "cpu" or "cuda:N": where the rank computes
    dtype: str
    store_name: str | None = None  # the KVStore (host; device on the CPU)
    handle: bytes | None = None  # CUDA IPC handle of the pool's tensor (device on a GPU)


def _torch():
    import torch

    return torch


class PoolKV:
    """The front end's side: one pool's KV memory, made once, removed by ``close``."""

    def __init__(self, name: str, model_config, num_blocks: int, block_size: int, run,
                 pool: str | None = None) -> None:
        torch = _torch()
        c = model_config
        self.store: KVStore | None = None
        self.tensor = None
        self.name = name
        handle = None
        if run.kv == "device" and run.device != "cpu":
            self.tensor = torch.zeros(
                (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_size),
                dtype=getattr(torch, run.dtype), device=run.device)
            handle = export_device_tensor(self.tensor)
        else:
            self.store = KVStore.create(
                name, num_layers=c.num_layers, num_blocks=num_blocks, block_size=block_size,
                num_kv_heads=c.num_kv_heads, head_size=c.head_size, dtype=run.dtype, pool=pool,
                # the host tier moves whole blocks (one copy per run of ids); a device
                # placement on the CPU attends over the store in place, layer by layer
                layout="block_major" if run.kv == "host" else "layer_major")
        self.placement = KVPlacement(run.kv, run.device, run.dtype,
                                     None if self.store is None else name, handle)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            KVStore.unlink(self.name)
            self.store = None
        self.tensor = None


class DeviceKV:
    """The rank's view in the device placement: the pool's tensor, attended in place."""

    def __init__(self, placement: KVPlacement) -> None:
        self.store = None
        if placement.handle is not None:
            kv = open_device_tensor(placement.handle)
        else:
            self.store = KVStore.attach(placement.store_name)
            kv = self.store.kv
        self._set(kv)

    def _set(self, kv) -> None:
        self.kv = kv
        self.num_layers, _, self.num_blocks, self.block_size, self.num_kv_heads, \
            self.head_size = kv.shape
        self.dtype = kv.dtype
        self.key_cache = [kv[i, 0] for i in range(self.num_layers)]
        self.value_cache = [kv[i, 1] for i in range(self.num_layers)]

    def prepare(self, requests, snap, req_indices, positions):
        """(kv to attend over, block tables, slot mappings) of a step: the pool's own."""
        return self, snap.block_tables, snap.slot_mappings(req_indices, positions)

    def finish(self) -> None:
        """Nothing to copy: the step wrote the pool's tensor itself."""

    def close(self) -> None:
        self.kv = self.key_cache = self.value_cache = None
        if self.store is not None:
            self.store.close()


@dataclass
class _Entry:
    block_id: int
    row: int
    valid_tokens: int  # positions of the block, from its first, that the row holds
    from_host: bool


@dataclass
class _Held:
    table_row: int
    groups: list[dict[int, _Entry]] = field(default_factory=list)
    end: int = 0  # the positions its last step ran up to


class HostCache(DeviceKV):
    """The rank's view in the host placement (see the module docstring)."""

    def __init__(self, placement: KVPlacement, max_num_reqs: int,
                 widths: list[int]) -> None:
        torch = _torch()
        self.store = KVStore.attach(placement.store_name)
        try:
            if placement.device != "cpu":
                self.store.pin()
            num_rows = max_num_reqs * sum(widths) + 1
            self._set(self.store.allocate_device_cache(placement.device, num_rows))
        except BaseException:
            self.store.close()
            raise
        self.num_groups = len(widths)
        self._free_rows = list(range(num_rows - 1, 0, -1))  # row 0: the null block
        self._held: dict[str, _Held] = {}
        self._row_owner: dict[int, str] = {}
        self._stores: list[tuple[int, int]] = []
        self.num_loaded_blocks = self.num_stored_blocks = 0
        self._torch = torch

    # -------------------------------------------------------------- bookkeeping

    def _release(self, entry: _Entry) -> None:
        self._free_rows.append(entry.row)

    def _drop(self, req_id: str) -> None:
        held = self._held.pop(req_id, None)
        if held is None:
            return
        for group in held.groups:
            for entry in group.values():
                self._release(entry)
        if self._row_owner.get(held.table_row) == req_id:
            del self._row_owner[held.table_row]

    def _forget(self, held: _Held) -> None:
        """Frees the rows a preempted request held: back, it loads its prefix hits from the
        store (cached blocks, which it must never write again) like any other request."""
        for group in held.groups:
            for entry in group.values():
                self._release(entry)
            group.clear()

    def _own(self, req_id: str, table_row: int) -> _Held:
        owner = self._row_owner.get(table_row)
        if owner is not None and owner != req_id:
            self._drop(owner)  # finished or preempted: its row is another's now
        held = self._held.get(req_id)
        if held is None:
            held = self._held[req_id] = _Held(table_row, [{} for _ in range(self.num_groups)])
        elif held.table_row != table_row:  # readmitted after a preemption
            if self._row_owner.get(held.table_row) == req_id:
                del self._row_owner[held.table_row]
            held.table_row = table_row
        self._row_owner[table_row] = req_id
        return held

    @property
    def num_rows_in_use(self) -> int:
        return self.kv.shape[2] - 1 - len(self._free_rows)

    # -------------------------------------------------------------- one step

    def prepare(self, requests, snap, req_indices, positions):
        torch = self._torch
        bs = self.block_size
        tables = [torch.zeros_like(t) for t in snap.block_tables]
        loads: list[tuple[int, int]] = []
        self._stores = []
        for i, r in enumerate(requests):
            held = self._own(r.req_id, r.row)
            start, end = r.start_position, r.start_position + len(r.token_ids)
            if start < held.end:  # preempted and back: what it holds is from before
                self._forget(held)
            held.end = end
            num_table_blocks = -(-end // bs)
            for g, table in enumerate(snap.block_tables):
                if num_table_blocks > table.shape[1]:
                    raise UsageError(f"request {r.req_id}: {end} tokens need "
                                     f"{num_table_blocks} blocks, the table has "
                                     f"{table.shape[1]}")
                ids = table[i, :num_table_blocks].tolist()
                entries = held.groups[g]
                for j, block_id in enumerate(ids):
                    entry = entries.get(j)
                    context = max(0, min(start, (j + 1) * bs) - j * bs)
                    if entry is not None and (block_id == NULL_BLOCK_ID or (
                            entry.block_id != block_id or entry.valid_tokens < context)):
                        self._release(entries.pop(j))
                        entry = None
                    if block_id == NULL_BLOCK_ID:
                        continue
                    if entry is None:
                        if not self._free_rows:
                            raise UsageError("the rank's device cache has no free row "
                                             f"({self.kv.shape[2] - 1} rows)")
                        entry = entries[j] = _Entry(block_id, self._free_rows.pop(), 0,
                                                    context > 0)
                        if context:
                            loads.append((block_id, entry.row))
                            entry.valid_tokens = bs
                    tables[g][i, j] = entry.row
                    last = (j + 1) * bs - 1
                    if start <= last < end and not entry.from_host:
                        self._stores.append((block_id, entry.row))
                    entry.valid_tokens = max(entry.valid_tokens, min(bs, end - j * bs))
        if loads:
            self.store.load_blocks(self.kv, [h for h, _ in loads], [d for _, d in loads])
            self.num_loaded_blocks += len(loads)
        slots = [compute_slot_mapping(t, req_indices, positions, bs) for t in tables]
        return self, tables, slots

    def finish(self) -> None:
        """Copies out the blocks the step completed; the store holds them on return."""
        if self._stores:
            self.store.store_blocks(self.kv, [h for h, _ in self._stores],
                                    [d for _, d in self._stores])
            self.num_stored_blocks += len(self._stores)
            self._stores = []

    def close(self) -> None:
        self.kv = self.key_cache = self.value_cache = None
        self.store.close()


def open_rank_kv(placement: KVPlacement | str, tables):
    """The rank's view of its pool's KV: a ``KVPlacement``, or (as before placements
    existed) the name of a CPU ``KVStore`` to attend over in place."""
    if isinstance(placement, str):
        placement = KVPlacement("device", "cpu", "float32", placement)
    if placement.kind == "host":
        return HostCache(placement, tables.max_num_reqs, list(tables.max_num_blocks_per_req))
    if placement.kind != "device":
        raise UsageError(f"--kv must be device or host, got {placement.kind!r}")
    return DeviceKV(placement)
