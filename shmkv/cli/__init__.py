"""The ``shmkv`` command (``shmkv --help``, ``shmkv COMMAND --help``).

    shmkv run [--no-compare] [--schedulers N] [--trace PATH] [--verbose] ...
                                                serve a chat workload with N scheduler
                                                processes (and their model ranks) on one
                                                shared pool, then on private pools: compared
    shmkv replay --trace PATH [--blocks A,B,C]  the same without a model: the KV-cache layer
                                                alone; several capacities: a sweep
    shmkv demo [--processes N] [--requests R]   several schedulers share one pool
    shmkv create NAME --blocks N [--events]     create a pool that stays in /dev/shm
    shmkv inspect NAME [--keys]                 a live pool: header, usage, processes,
                                                invariants; --keys: the cached blocks
    shmkv stats NAME [--interval S]             live figures, refreshed, with rates
    shmkv events NAME [-f] [-n N] [--json]      print / follow the global event log (ISO times)
    shmkv publish NAME --endpoint ADDR          KV events over ZMQ, vLLM's wire format
    shmkv metrics NAME --port P                 Prometheus metrics over HTTP
    shmkv recover NAME [--reclaim PID]          take over from the dead, repair, report
    shmkv unlink NAME                           remove a pool (segment, lock, lock file, siblings)
    shmkv ls [--all] [--json] [--prefix P]      every shmkv object on this machine, and
                                                which pools stay and which are orphans
    shmkv cleanup [--dry-run] [--idle-for D]    remove orphaned pools (none meant to stay,
                  [--include-idle]              unless idle D) and what a killed
                  [--prefix P]                  ``shmkv run`` left
    shmkv bench [NAME [ARGS...]] [--list]       the built-in benchmark, or benchmarks/bench_NAME.py
    shmkv index --redis URL --source SPEC...    a cluster-wide prefix index in Redis
    shmkv route --redis URL --tokens IDS        how much of a prompt each pool has cached

``shmkv --version``: the package's version and its layout version.

Exit codes: 0 success; 1 the command ran and found a problem (broken invariants, a demo
process failed, a run with unfinished requests or wrong tokens); 2 bad usage or an error
(message on stderr naming the argument, the value and the rule, no traceback unless
``--debug``; a pool that does not exist is one message for every command). Long-running commands
(publish, metrics, index, stats, events -f) stop on SIGTERM or Ctrl-C between two steps,
detach from the pool and exit 143 (SIGTERM) or 130 (Ctrl-C); ``run`` stops its processes,
removes its segments, reports and exits the same way. A second signal during the stop
changes nothing.

One module per command group: ``run``; ``pool`` (create, inspect, stats, recover, unlink,
ls, cleanup, demo, bench); ``events`` (events, publish, metrics); ``index`` (index, route);
``common`` (exit codes, the stop on signals, the missing-pool error); ``run_args`` (run's
and replay's argument checks); ``keys`` (``inspect --keys``). Each module's ``COMMANDS``
maps its commands to the functions that add their parsers; handlers import anything heavy
when they run, so ``import shmkv.cli`` and ``shmkv --help`` stay fast and never import torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from shmkv.cli import events, index, pool, run
from shmkv.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, missing_pool_message
from shmkv.errors import SegmentNotFoundError, ShmKVError

# the order `shmkv --help` lists them in
_ORDER = ("run", "replay", "demo", "inspect", "recover", "unlink", "cleanup", "create", "stats",
          "events", "publish", "metrics", "ls", "bench", "index", "route")


def _version() -> str:
    """``shmkv 0.1.0 (layout v7)``: the package's version and the shared-memory layout's
    (pools of another layout version are not attached)."""
    from shmkv import __version__
    from shmkv.pool.layout import LAYOUT_VERSION

    return f"shmkv {__version__} (layout v{LAYOUT_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmkv", description="One KV-cache block pool shared by every scheduler process "
        "on a node.", epilog="Exit codes: 0 success; 1 the command ran and found a problem "
        "(broken invariants, a demo process failed, a run with a request not served); 2 bad "
        "usage or an error, a missing pool included (one line on stderr; --debug shows the "
        "traceback). publish, metrics, stats "
        "and events --follow run until SIGTERM or Ctrl-C, then detach and exit 143 (SIGTERM) "
        "or 130 (Ctrl-C); so does run, once it has removed everything it made.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=_version(),
                        help="print shmkv's version, its layout version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    adders = {**run.COMMANDS, **pool.COMMANDS, **events.COMMANDS, **index.COMMANDS}
    assert sorted(adders) == sorted(_ORDER)
    for command in _ORDER:
        adders[command](sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that an unknown option is reported by the
    command's own parser (``shmkv cleanup --prefx``: cleanup's usage, not the top level's),
    with the closest option it has when one is close."""
    import difflib

    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        before = argv.index(args.command) > argv.index(extra[0])  # `shmkv --bogus ls`
        command = parser if before else subs.choices[args.command]
        options = [o for a in command._actions for o in a.option_strings]
        hint = difflib.get_close_matches(extra[0].split("=", 1)[0], options, n=1)
        command.error(f"unrecognized arguments: {' '.join(extra)}"
                      + (f" (did you mean {hint[0]}?)" if hint else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(build_parser(), argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `shmkv events NAME | head`: the reader left; not an error
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (no flush error at exit)
        except OSError:
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        if args.debug:
            raise
        return EXIT_INTERRUPTED
    except (ShmKVError, OSError) as exc:
        if args.debug:
            raise
        print(f"shmkv {args.command}: {_message(args, exc)}", file=sys.stderr)
        return EXIT_ERROR


def _message(args: argparse.Namespace, exc: BaseException) -> str:
    """The error's line; a pool named on the command line that does not exist is said the
    same way by every command (``common.missing_pool_message``)."""
    name = getattr(args, "name", None)
    if isinstance(exc, SegmentNotFoundError) and isinstance(name, str):
        from shmkv.pool import layout as L

        try:
            missing = not os.path.exists(f"/dev/shm{L.segment_name(name)}")
        except ShmKVError:  # not a valid pool name: the error says so
            missing = False
        if missing:
            return missing_pool_message(name)
    return str(exc)

