"""The checks of ``shmkv run`` / ``shmkv replay``'s arguments, all made before anything
starts (no segment, no process): each failure is one :class:`~shmkv.errors.UsageError`
naming the argument, the value given and the rule, e.g.

    --blocks 'abc': 'abc' is not a whole number; give a number of blocks >= 16, or
    several separated by commas (2048,8192,32768)

:func:`check_arguments` checks what the command line alone decides; :func:`check_fits`
what needs the workload too (its longest request against ``--max-model-len``, a pool too
small for one request). A new argument adds one rule to ``_RULES`` (or a line to
:func:`check_arguments`)."""

from __future__ import annotations

import math
from collections.abc import Callable

from shmkv.errors import UsageError

__all__ = ["MIN_BLOCKS", "check_arguments", "check_fits", "longest_request", "parse_blocks",
           "router_config"]

MIN_BLOCKS = 16

# (attribute, option, rule text, test): the number-valued options of run and replay.
_RULES: list[tuple[str, str, str, Callable[[float], bool]]] = [
    ("schedulers", "--schedulers", "must be a whole number >= 1", lambda v: v >= 1),
    ("block_size", "--block-size", "must be a whole number >= 1", lambda v: v >= 1),
    ("max_num_seqs", "--max-num-seqs", "must be a whole number >= 1", lambda v: v >= 1),
    ("max_num_batched_tokens", "--max-num-batched-tokens", "must be a whole number >= 1",
     lambda v: v >= 1),
    ("max_model_len", "--max-model-len", "must be a whole number >= 1", lambda v: v >= 1),
    ("concurrency", "--concurrency", "must be a whole number >= 1", lambda v: v >= 1),
    ("trace_block_tokens", "--trace-block-tokens", "must be a whole number >= 1",
     lambda v: v >= 1),
    ("conversations", "--conversations", "must be a whole number >= 1", lambda v: v >= 1),
    ("requests", "--requests", "must be a whole number >= 1", lambda v: v >= 1),
    ("request_rate", "--request-rate", "must be a finite number of requests a second > 0",
     lambda v: 0 < v < math.inf),
    ("zipf", "--zipf", "must be a finite number >= 0 (0: every prompt equally popular)",
     lambda v: 0 <= v < math.inf),
    ("time_scale", "--time-scale", "must be a finite number >= 0 (0: send at once)",
     lambda v: 0 <= v < math.inf),
    ("timeout", "--timeout", "must be a finite number of seconds > 0",
     lambda v: 0 < v < math.inf),
    ("prefill_ms_per_token", "--prefill-ms-per-token",
     "must be a finite number of milliseconds >= 0 (0: no time for it)",
     lambda v: 0 <= v < math.inf),
    ("decode_ms_per_step", "--decode-ms-per-step",
     "must be a finite number of milliseconds >= 0 (0: no time for it)",
     lambda v: 0 <= v < math.inf),
    ("rank_nice", "--rank-nice", "must be a whole number from 0 to 19", lambda v: 0 <= v <= 19),
]


def parse_blocks(text: str) -> list[int]:
    """``--blocks``: one number of blocks, or several separated by commas.

    Raises:
        UsageError: naming the value, the item that is wrong and the rule.
    """
    rule = (f"give a number of blocks >= {MIN_BLOCKS}, or several separated by commas "
            "(2048,8192,32768)")
    items = [c.strip() for c in str(text).split(",")]
    if not any(items):
        raise UsageError(f"--blocks {text!r}: no number; {rule}")
    caps = []
    for item in items:
        if not item:
            raise UsageError(f"--blocks {text!r}: an empty item between commas; {rule}")
        try:
            caps.append(int(item))
        except ValueError:
            raise UsageError(f"--blocks {text!r}: {item!r} is not a whole number; "
                             f"{rule}") from None
    small = [c for c in caps if c < MIN_BLOCKS]
    if small:
        raise UsageError(f"--blocks {text!r}: {small[0]} is under {MIN_BLOCKS}; {rule}")
    return caps


def check_arguments(args) -> list[int]:
    """Every number-valued option and their combinations; returns ``--blocks`` parsed.
    Options a command does not offer (``--rank-nice`` for replay) are skipped.

    Raises:
        UsageError: the first argument that breaks its rule, with its value and the rule.
    """
    for attr, option, rule, ok in _RULES:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if not ok(value):  # NaN fails every rule
            raise UsageError(f"{option} {value!r}: {rule}")
    if getattr(args, "trace_format", None) and not getattr(args, "trace", None):
        raise UsageError(f"--trace-format {args.trace_format!r}: needs --trace PATH (the "
                         "built-in workload has no format to choose)")
    if getattr(args, "kill_one", False) and args.schedulers < 2:
        raise UsageError(f"--kill-one with --schedulers {args.schedulers}: needs at least "
                         "2 schedulers (one is killed, the others finish its requests)")
    restarts = [flag for flag, on in (("--kill-one", getattr(args, "kill_one", False)),
                                      ("--restart-one", getattr(args, "restart_one", False)),
                                      ("--rolling-restart",
                                       getattr(args, "rolling_restart", False))) if on]
    if len(restarts) > 1:
        raise UsageError(f"{' and '.join(restarts)}: give one of them")
    if restarts and restarts[0] != "--kill-one" and args.schedulers < 2:
        raise UsageError(f"{restarts[0]} with --schedulers {args.schedulers}: needs at least "
                         "2 schedulers (the others serve while one restarts)")
    if getattr(args, "cache_threshold", None) is not None:
        router_config(args)
    return parse_blocks(args.blocks)


def router_config(args):
    """The routers' settings (``RouterConfig``) from the flags, checked.

    Raises:
        UsageError: a value out of range, naming its flag, the range and the default.
    """
    from shmkv.serve.routing import RouterConfig

    cfg = RouterConfig(cache_threshold=args.cache_threshold,
                       balance_abs_threshold=args.balance_abs_threshold,
                       balance_rel_threshold=args.balance_rel_threshold,
                       prefix_weight=args.prefix_scorer_weight,
                       queue_weight=args.queue_scorer_weight,
                       kv_weight=args.utilization_scorer_weight)
    cfg.validate()
    return cfg


def longest_request(workload) -> tuple[int, str]:
    """(tokens, request id) of the workload's longest request: its prompt as sent (a
    conversation's turn resends the history: every earlier turn's prompt and output) plus
    the tokens it generates. Exact: a request always generates its ``max_tokens``."""
    history: dict[str, int] = {}
    best = (0, "")
    for t in workload:
        sent = history.get(t.conversation, 0) + len(t.prompt_token_ids)
        need = sent + t.max_tokens
        if t.conversation is not None:
            history[t.conversation] = need
        best = max(best, (need, t.request_id), key=lambda x: x[0])
    return best


def check_fits(workload, max_model_len: int, block_size: int, capacities: list[int],
               num_schedulers: int, pools: list[str], num_groups: int) -> None:
    """What needs the workload: every request fits ``--max-model-len``, and every pool
    (of every run: ``pools`` lists the kinds to be run) holds one request of that length.

    Raises:
        UsageError: naming ``--max-model-len`` or ``--blocks``, the value and the rule.
    """
    need, rid = longest_request(workload)
    if need > max_model_len:
        raise UsageError(
            f"--max-model-len {max_model_len}: too small for this workload, whose longest "
            f"request ({rid}: its prompt as sent, with its conversation's history, plus the "
            f"tokens it generates) is {need} tokens; use --max-model-len {need} or more")
    per_request = -(-max_model_len // block_size) * num_groups + 1  # + the null block
    for cap in capacities:
        for pool in sorted(set(pools), key=lambda p: p != "private"):  # the tighter first
            per = cap // (num_schedulers if pool == "private" else 1)
            if per < per_request:
                where = (f"{num_schedulers} private pools of {per}" if pool == "private"
                         else f"one pool of {per}")
                raise UsageError(
                    f"--blocks {cap}: {where} blocks cannot hold one request of "
                    f"--max-model-len {max_model_len} ({per_request} blocks: "
                    f"{-(-max_model_len // block_size)} per KV-cache group x {num_groups} "
                    f"groups + the null block); raise --blocks to "
                    f"{per_request * (num_schedulers if pool == 'private' else 1)} or lower "
                    "--max-model-len")
