"""Workloads for ``shmkv run``: the built-in chat workload and the JSONL trace format.

A workload is a list of :class:`TraceRequest`, one per line of a trace file::

    {"request_id": "c3-t0", "conversation": "c3", "cache_salt": "tenant-b",
     "prompt_token_ids": [5, 17, ...], "max_tokens": 12}

- ``prompt_token_ids``: the tokens this request adds. For a request with a
  ``conversation``, the prompt sent to the model is the conversation's history (every
  earlier turn's prompt and the tokens generated for it) followed by these tokens, as a chat
  client resends its history; turns of one conversation run one after the other, in file
  order. Without a ``conversation`` the request stands alone.
- ``max_tokens``: tokens to generate (greedy), at least 1.
- ``cache_salt``: isolates a tenant's prefix cache (hashed into the first block), or null.
- ``arrival_s`` (optional): when the request arrives, in seconds after the first; honoured
  with ``--time-scale`` (``shmkv/serve/trace.py`` reads the Mooncake format into these).

Unknown fields, a missing field, a token outside the model's vocabulary or a prompt longer
than the model allows are errors naming the line (:class:`~shmkv.errors.UsageError`).

The built-in workloads: ``chat`` (:func:`chat_workload`) looks like chat serving: a few
tenants, each with its own ``cache_salt``, several system prompts that many users share,
and multi-turn conversations that resend their history; conversations start in a random
order and their turns interleave. ``hot-prompts`` (:func:`hot_prompts_workload`) is many
short single-turn requests on a few dozen system prompts of Zipf-skewed popularity,
arriving as a Poisson process: the hot prompts are wanted everywhere at once, which is
where routing by prefix and balancing load pull apart.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shmkv.errors import UsageError

__all__ = ["WORKLOADS", "ChatWorkloadConfig", "HotPromptsConfig", "TraceRequest",
           "chat_workload", "hot_prompts_workload", "read_trace", "write_trace"]

WORKLOADS = ("chat", "hot-prompts")


class TraceRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                   omit_defaults=True):
    """One request of a workload (one line of a JSONL trace)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    cache_salt: str | None = None
    conversation: str | None = None
    arrival_s: float | None = None  # seconds after the start (honoured with --time-scale)


@dataclass(frozen=True)
class ChatWorkloadConfig:
    """The shape of the built-in chat workload (the defaults are ``shmkv run``'s)."""

    num_conversations: int = 90
    max_turns: int = 6
    num_tenants: int = 3
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (64, 160)
    user_message_tokens: tuple[int, int] = (12, 40)
    max_tokens: tuple[int, int] = (6, 12)
    vocab_size: int = 97  # TinyModelConfig's
    seed: int = 0


def chat_workload(cfg: ChatWorkloadConfig = ChatWorkloadConfig()) -> list[TraceRequest]:
    """The built-in workload: ``num_conversations`` conversations of 1..``max_turns`` turns
    (about three on average), each with a tenant and one of that tenant's system prompts.

    Tenant ``t`` has its own salt and its own system prompts (the first ``num_system_prompts``
    prompts are drawn once and every tenant uses them, so equal token ids under different
    salts must not share blocks). Conversations start in random order; at each step one of
    the open conversations (chosen at random) sends its next turn, so turns interleave.
    """
    if cfg.num_conversations < 1 or cfg.max_turns < 1 or cfg.num_tenants < 1 or (
        cfg.num_system_prompts < 1
    ):
        raise UsageError(f"chat workload: every count must be >= 1, got {cfg}")
    rng = random.Random(cfg.seed)
    lo_tok = 1  # token 0 is left out (some models use it for padding)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo_tok, cfg.vocab_size) for _ in range(n)]

    systems = [tokens(rng.randint(*cfg.system_prompt_tokens))
               for _ in range(cfg.num_system_prompts)]
    tenants = [f"tenant-{chr(ord('a') + t)}" for t in range(cfg.num_tenants)]
    # Popularity is skewed, as in real chat traffic: the first prompts are the most used.
    system_weights = [1.0 / (i + 1) for i in range(cfg.num_system_prompts)]
    conversations = []
    for c in range(cfg.num_conversations):
        turns = min(cfg.max_turns, 1 + int(rng.expovariate(1 / 2.0)))
        conversations.append({
            "id": f"c{c}", "turns": turns, "next": 0,
            "salt": rng.choice(tenants),
            "system": rng.choices(range(cfg.num_system_prompts), system_weights)[0],
        })
    out: list[TraceRequest] = []
    pending = list(range(len(conversations)))
    rng.shuffle(pending)
    open_: list[int] = []
    while pending or open_:
        # Keep a window of about eight open conversations, as a server has many users.
        while pending and (len(open_) < 8 or rng.random() < 0.15):
            open_.append(pending.pop())
        i = rng.choice(open_)
        conv = conversations[i]
        turn = conv["next"]
        prompt = systems[conv["system"]] if turn == 0 else []
        out.append(TraceRequest(
            request_id=f"{conv['id']}-t{turn}",
            prompt_token_ids=prompt + tokens(rng.randint(*cfg.user_message_tokens)),
            max_tokens=rng.randint(*cfg.max_tokens),
            cache_salt=conv["salt"],
            conversation=conv["id"],
        ))
        conv["next"] += 1
        if conv["next"] == conv["turns"]:
            open_.remove(i)
    return out


@dataclass(frozen=True)
class HotPromptsConfig:
    """The shape of the ``hot-prompts`` workload (the defaults are ``--workload
    hot-prompts``'s)."""

    num_requests: int = 3000
    num_system_prompts: int = 64
    zipf_s: float = 1.0  # prompt k (from 1) is drawn with weight 1 / k**zipf_s
    system_prompt_tokens: tuple[int, int] = (96, 224)
    user_message_tokens: tuple[int, int] = (8, 40)
    max_tokens: tuple[int, int] = (4, 12)
    request_rate: float = 150.0  # requests per second (Poisson arrivals), at --time-scale 1
    vocab_size: int = 97
    seed: int = 0


def hot_prompts_workload(cfg: HotPromptsConfig = HotPromptsConfig()) -> list[TraceRequest]:
    """``num_requests`` single-turn requests, each a system prompt (drawn with Zipf weights
    ``1 / k**zipf_s`` over ``num_system_prompts``) and a user message of its own; arrivals
    (``arrival_s``) a Poisson process of ``request_rate`` a second, honoured with
    ``--time-scale`` (0: as fast as ``--concurrency`` allows).

    Raises:
        UsageError: a count < 1, a rate <= 0 or a negative exponent.
    """
    if cfg.num_requests < 1 or cfg.num_system_prompts < 1:
        raise UsageError(f"hot-prompts workload: --requests and the system prompts must be "
                         f">= 1, got {cfg.num_requests} and {cfg.num_system_prompts}")
    if not 0 < cfg.request_rate < float("inf"):
        raise UsageError(f"--request-rate {cfg.request_rate!r}: must be a finite number of "
                         "requests a second > 0")
    if not 0 <= cfg.zipf_s < float("inf"):
        raise UsageError(f"--zipf {cfg.zipf_s!r}: must be a finite number >= 0 (0: every "
                         "system prompt equally popular)")
    rng = random.Random(cfg.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, cfg.vocab_size) for _ in range(n)]

    systems = [tokens(rng.randint(*cfg.system_prompt_tokens))
               for _ in range(cfg.num_system_prompts)]
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_system_prompts)]
    picks = rng.choices(range(cfg.num_system_prompts), weights, k=cfg.num_requests)
    out, t = [], 0.0
    for i, k in enumerate(picks):
        out.append(TraceRequest(
            request_id=f"h{i}-p{k}",
            prompt_token_ids=systems[k] + tokens(rng.randint(*cfg.user_message_tokens)),
            max_tokens=rng.randint(*cfg.max_tokens), arrival_s=round(t, 6)))
        t += rng.expovariate(cfg.request_rate)
    return out


_decoder = msgspec.json.Decoder(TraceRequest)
_encoder = msgspec.json.Encoder()


def read_trace(path: str | Path, vocab_size: int | None = None) -> list[TraceRequest]:
    """Reads a JSONL trace (blank lines and lines starting with ``#`` are skipped).

    Raises:
        UsageError: a line that is not a valid request, naming the file, line and field;
            a duplicate request id; a token id outside ``[0, vocab_size)``.
        OSError: the file cannot be read.
    """
    out: list[TraceRequest] = []
    seen: set[str] = set()
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith(b"#"):
                continue
            try:
                req = _decoder.decode(text)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise UsageError(f"{path}:{number}: not a trace request: {exc}") from None
            _check(req, f"{path}:{number}", vocab_size)
            if req.request_id in seen:
                raise UsageError(f"{path}:{number}: request_id {req.request_id!r} repeated")
            seen.add(req.request_id)
            out.append(req)
    if not out:
        raise UsageError(f"{path}: no requests")
    return out


def _check(req: TraceRequest, where: str, vocab_size: int | None) -> None:
    if req.max_tokens < 1:
        raise UsageError(f"{where}: max_tokens must be >= 1, got {req.max_tokens}")
    if not req.prompt_token_ids:
        raise UsageError(f"{where}: prompt_token_ids is empty")
    if req.arrival_s is not None and req.arrival_s < 0:
        raise UsageError(f"{where}: arrival_s must be >= 0, got {req.arrival_s}")
    if vocab_size is not None:
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"{where}: token id {bad[0]} is outside the model's vocabulary "
                             f"[0, {vocab_size})")


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Writes requests as JSONL (what :func:`read_trace` reads)."""
    with open(path, "wb") as f:
        for req in requests:
            f.write(_encoder.encode(req) + b"\n")
