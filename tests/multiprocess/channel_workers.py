"""Processes for the channel tests (module level, so spawn can import them)."""

from __future__ import annotations

import hashlib
import random
import sys
import traceback

from shmkv.messages import Channel, ExecuteModel, ScheduledRequest


def checked_step(step: int, rng: random.Random) -> ExecuteModel:
    """A step whose request id is the digest of its tokens, so a torn frame cannot pass."""
    tokens = [rng.randrange(1 << 30) for _ in range(rng.randint(0, 400))]
    digest = hashlib.sha256(repr((step, tokens)).encode()).hexdigest()
    return ExecuteModel(step=step, requests=[ScheduledRequest(digest, 0, tokens, step)])


def step_is_intact(msg: ExecuteModel) -> bool:
    req = msg.requests[0]
    return hashlib.sha256(repr((msg.step, req.token_ids)).encode()).hexdigest() == req.req_id


def produce(name: str, seed: int, count: int) -> None:
    """Sends ``count`` self-checking steps (``count`` < 0: until killed)."""
    try:
        rng = random.Random(seed)
        ch = Channel.open(name)
        step = 0
        while count < 0 or step < count:
            ch.send(checked_step(step, rng), timeout_s=60)
            step += 1
        ch.close()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
