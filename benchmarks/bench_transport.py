#!/usr/bin/env python
"""Round trip between two processes: shmkv's shared-memory Channel vs posix_ipc.MessageQueue.

A client sends a scheduler step (``ExecuteModel``, msgspec-encoded) and waits for the echo
server's ``ModelOutput``; the figure is microseconds per round trip (encode, send, wake,
decode, both ways). Two sizes: a decode step (8 requests of one token) and a prefill step
(one request of ``--prompt-tokens`` tokens). A MessageQueue holds at most 8 KiB per message
on this machine's default limits, so a prefill larger than that is not measured for it.

    python benchmarks/bench_transport.py [--round-trips N] [--prompt-tokens T]

Output: one JSON line per (transport, step), then a table with the ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import posix_ipc

from shmkv.messages import (
    Channel,
    ExecuteModel,
    ModelOutput,
    ScheduledRequest,
    Shutdown,
    decode,
    encode,
)


def _steps(prompt_tokens: int) -> dict[str, ExecuteModel]:
    decode_step = ExecuteModel(
        step=0, requests=[ScheduledRequest(f"req-{i}", i, [1000 + i], 300 + i) for i in range(8)]
    )
    prefill = ExecuteModel(
        step=0, requests=[ScheduledRequest("req-p", 0, list(range(500, 500 + prompt_tokens)), 0)]
    )
    return {"decode (8 x 1 token)": decode_step, f"prefill ({prompt_tokens} tokens)": prefill}


def _echo_channel(up: str, down: str) -> None:
    inbox, outbox = Channel.open(up), Channel.open(down)
    while True:
        msg = inbox.recv(timeout_s=60)
        if msg is None or isinstance(msg, Shutdown):
            break
        outbox.send(ModelOutput(step=msg.step, sampled_token_ids=[1] * len(msg.requests)))
    inbox.close()
    outbox.close()


def _echo_mq(up: str, down: str) -> None:
    inbox, outbox = posix_ipc.MessageQueue(up), posix_ipc.MessageQueue(down)
    while True:
        data, _ = inbox.receive(60)
        msg = decode(data)
        if isinstance(msg, Shutdown):
            break
        outbox.send(encode(ModelOutput(step=msg.step, sampled_token_ids=[1] * len(msg.requests))))
    inbox.close()
    outbox.close()


def _measure(transport: str, step: ExecuteModel, round_trips: int) -> float | None:
    ctx = mp.get_context("spawn")
    tag = f"bench-{os.getpid()}-{transport}"
    up, down = f"{tag}-up", f"{tag}-down"
    if transport == "channel":
        a, b = Channel.create(up, 1 << 20), Channel.create(down, 1 << 20)
        send, recv = a.send, (lambda: b.recv(timeout_s=60))
        target = _echo_channel
    else:
        if len(encode(step)) > 8192:
            return None
        a = posix_ipc.MessageQueue("/" + up, posix_ipc.O_CREX, max_messages=10,
                                   max_message_size=8192)
        b = posix_ipc.MessageQueue("/" + down, posix_ipc.O_CREX, max_messages=10,
                                   max_message_size=8192)
        send = lambda m: a.send(encode(m))  # noqa: E731
        recv = lambda: decode(b.receive(60)[0])  # noqa: E731
        target = _echo_mq
    names = (up, down) if transport == "channel" else ("/" + up, "/" + down)
    server = ctx.Process(target=target, args=names)
    server.start()
    try:
        for _ in range(200):  # warm up
            send(step)
            recv()
        t0 = time.perf_counter()
        for _ in range(round_trips):
            send(step)
            recv()
        elapsed = time.perf_counter() - t0
        send(Shutdown())
        server.join(30)
        if server.exitcode != 0:
            raise SystemExit(f"echo server exited with {server.exitcode}")
    finally:
        if server.is_alive():
            server.kill()
            server.join(10)
        if transport == "channel":
            for ch, name in ((a, up), (b, down)):
                ch.close()
                Channel.unlink(name)
        else:
            for q in (a, b):
                q.unlink()
                q.close()
    return elapsed / round_trips * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.round_trips < 1 or args.prompt_tokens < 1:
        parser.error("--round-trips and --prompt-tokens must be positive")
    rows = []
    for label, step in _steps(args.prompt_tokens).items():
        for transport in ("channel", "mqueue"):
            us = _measure(transport, step, args.round_trips)
            row = {"transport": transport, "step": label, "bytes": len(encode(step)),
                   "us_per_round_trip": None if us is None else round(us, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'step':<26} {'bytes':>7} {'Channel us':>11} {'MessageQueue us':>16} "
          f"{'MQ/Channel':>11}")
    for label in _steps(args.prompt_tokens):
        ch, mq = (next(r for r in rows if r["step"] == label and r["transport"] == t)
                  for t in ("channel", "mqueue"))
        c, m = ch["us_per_round_trip"], mq["us_per_round_trip"]
        ratio = f"{m / c:.2f}x" if m else "n/a"
        mq_text = f"{m:,.1f}" if m else "too big"
        print(f"{label:<26} {ch['bytes']:>7,} {c:>11,.1f} {mq_text:>16} {ratio:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
