"""Forked-child bodies for the shared offload tier's crash-point tests (zygote targets)."""

from __future__ import annotations

from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from shmkv.vllm import SharedCPUOffloadingManager

STUCK_AFTER_S = 0.1

# The victim's calls in order, and the pool operations each one makes under its hold.
STEPS = ("prepare_store", "complete_store", "fail_store", "prepare_load", "complete_load")
STEP_OPS = {
    "prepare_store": ("touch", "cache"),  # + "evict" when it evicts (not here: room)
    "complete_store": ("evict", "cache", "free"),
    "fail_store": ("evict", "free"),
    "prepare_load": ("touch",),
    "complete_load": ("free",),
}


def victim_keys(tag: int) -> list:
    return [make_offload_key(b"v" + tag.to_bytes(4, "big") + bytes([i]), 0) for i in range(4)]


def offload_victim(name: str, num_chunks: int, tag: int, step: str, op: str, n: int) -> None:
    """Runs the victim's calls, with a SIGKILL planned before the ``n``-th store of the
    first ``op`` call of ``step``; returns (exit 0) if that call completes first. Exits
    without close(): what it holds is the survivors' to reap."""
    from shmkv.pool import fault

    manager = SharedCPUOffloadingManager(name, num_chunks, label="victim",
                                         stuck_after_s=STUCK_AFTER_S)
    ctx = ReqContext(f"victim-{tag}")
    keys = victim_keys(tag)
    calls = {
        "prepare_store": lambda: manager.prepare_store(keys, ctx),
        "complete_store": lambda: manager.complete_store(keys[:3], ctx),
        "fail_store": lambda: manager.complete_store(keys[3:], ctx, success=False),
        "prepare_load": lambda: manager.prepare_load(keys[:2], ctx),
        "complete_load": lambda: manager.complete_load(keys[:1], ctx),
    }
    for name_ in STEPS:
        if name_ == step:
            fault.arm(op, n)
        out = calls[name_]()
        if name_ == "prepare_store":
            assert out is not None and out.keys_to_store == keys, out
        if name_ == step:
            assert fault.completed, "the planned call ended without counting its stores"
            return
