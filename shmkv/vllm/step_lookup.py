"""A scheduler step's lookups of one request, answered from one hold of the node-wide lock.

vLLM's connector asks the manager about a request's keys one at a time, in order: its
prefix lookup walks the request's chunks from the first one not computed, and stops at the
first MISS (a HIT_PENDING counts as a hit and the walk goes on). Taking the pool lock for
each key makes a step's lookups as many holds, and as many waits behind the other replicas'
holds, as the request has cached chunks.

Inside the step region (the manager's ``lock``) the first lookup of a key therefore looks up
a run: that key and the request's next keys of its KV-cache group, by the positions the
scheduler gave them (``ReqContext``), up to ``MAX_RUN`` keys and up to the first MISS. The
run's HITs are pinned in the same hold (the lookup pins the step region keeps until their
``prepare_load`` or the region's end), and every answer of the run is kept for the rest of
the region, so the lookups that follow take no lock. An answer stays true while it is kept:

- a HIT is pinned, so no replica evicts it; a ``complete_load`` of the key in the same
  region (which gives its pin back) drops the answer;
- a HIT_PENDING or MISS was true at the hold; vLLM defers a HIT_PENDING request and asks
  again next step, and a MISS ends its walk. This process's own ``prepare_store`` or
  ``complete_store`` of the key drops the answer, so it reads what vLLM's manager would.

The run reads the request's key positions through ``ReqContext``'s position table (vLLM
0.33.0's ``_offload_key_positions``; without it, a run is the one key asked). A run may pin
keys past the ones vLLM asks about in this step (its walk is bounded by the tokens it may
load); those pins go back at the region's end, like any lookup pin no ``prepare_load``
took.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

MAX_RUN = 64  # keys looked up in one hold


class StepLookups:
    """This process's lookup answers and request key orders for the current step region
    (cleared when the region ends)."""

    __slots__ = ("answers", "_orders")

    def __init__(self) -> None:
        self.answers: dict[OffloadKey, object] = {}  # key -> its LookupResult
        # (id of the request context, group suffix) -> (context, #positions, keys, index)
        self._orders: dict[tuple[int, bytes], tuple] = {}

    def clear(self) -> None:
        self.answers.clear()
        self._orders.clear()

    def forget(self, keys) -> None:
        """Drops the answers of keys whose state this process just changed."""
        answers = self.answers
        for key in keys:
            answers.pop(key, None)

    def run_from(self, key: OffloadKey, req_context: ReqContext) -> list[OffloadKey]:
        """``key``, then the request's keys of its group that follow it by position, up to
        ``MAX_RUN`` keys and up to the first key already answered."""
        positions = getattr(req_context, "_offload_key_positions", None)
        if not isinstance(positions, dict) or key not in positions:
            return [key]
        group = key[-4:]
        slot = (id(req_context), group)
        entry = self._orders.get(slot)
        if entry is None or entry[0] is not req_context or entry[1] != len(positions):
            order = sorted((k for k in positions if k[-4:] == group), key=positions.__getitem__)
            entry = (req_context, len(positions), order, {k: i for i, k in enumerate(order)})
            self._orders[slot] = entry
        order, index = entry[2], entry[3]
        start = index[key]
        run = [key]
        answers = self.answers
        for later in order[start + 1:start + MAX_RUN]:
            if later in answers:
                break
            run.append(later)
        return run
