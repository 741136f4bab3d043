"""Writes the parts of the docs that are generated, so they cannot go stale:

- ``docs/layout.md``: the shared-memory layout's tables (regions, header, block rows,
  process-table rows, journal entries, the offsets of an example pool), rendered from
  ``shmkv/pool/layout.py`` itself (``REGIONS`` and the record dtypes);
- the sample outputs of ``shmkv run`` and ``shmkv replay`` in README.md and
  docs/serving.md (between the ``<!-- sample: NAME -->`` and ``<!-- end sample -->``
  marks), rendered from the JSON of real runs kept in ``docs/samples/`` (``SAMPLE_RUNS``:
  ``run.json``, ``kill-one.json``, ``replay-trace.json``) with the functions the commands
  print with.

Usage::

    python scripts/update_docs.py             # re-render everything from what is stored
    python scripts/update_docs.py --run       # first run every sample's command again (new
                                              # figures, docs/run.png too), then re-render
    python scripts/update_docs.py --run kill-one   # only that one's
    python scripts/update_docs.py --check     # exit 1 naming each file that is stale

The ``replay-trace`` sample replays the public Mooncake conversation trace
(docs/serving.md, "Mooncake traces"): ``--trace PATH`` names the downloaded file.

``tests/unit/test_readme.py`` fails when a file differs from what this script writes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_DIR = ROOT / "docs" / "samples"
SAMPLE_JSON = SAMPLES_DIR / "run.json"
TRACE_NAME = "conversation_trace.jsonl"  # the Mooncake trace, as the sample names it
# JSON name -> the command's arguments (its --json and --plot are added; TRACE: the trace)
SAMPLE_RUNS = {
    "run": ["run"],
    "kill-one": ["run", "--kill-one", "--no-compare"],
    # the cost model off: the sample shows the hits (a modelled replay of the whole trace
    # takes minutes; docs/serving.md's router tables show the latency)
    "replay-trace": ["replay", "--trace", TRACE_NAME, "--blocks", "8192",
                     "--prefill-ms-per-token", "0", "--decode-ms-per-step", "0"],
}
LAYOUT_MD = ROOT / "docs" / "layout.md"
SAMPLE_FILES = (ROOT / "README.md", ROOT / "docs" / "serving.md")
_SAMPLE = re.compile(r"(<!-- sample: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end sample -->)",
                     re.S)


# ---------------------------------------------------------------------------- layout

class _Sym:
    """A config field in a region's shape formula: ``c.num_blocks + 2`` renders as text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __add__(self, other) -> _Sym:
        return _Sym(f"{self.text} + {other}")

    __radd__ = __add__

    def __str__(self) -> str:
        return self.text


class _SymConfig:
    def __getattr__(self, name: str) -> _Sym:
        return _Sym(name)


def _dtype_name(dtype, L) -> str:
    for name in ("HEADER_DTYPE", "BLOCK_DTYPE", "PROC_DTYPE", "JOURNAL_DTYPE"):
        if dtype == getattr(L, name):
            return f"`{name}` ({dtype.itemsize} B)"
    return f"{dtype.name}"


def _fields_table(dtype) -> list[str]:
    rows = ["| field | type | offset (B) | size (B) |", "|---|---|---:|---:|"]
    for name, (sub, offset, *_) in sorted(dtype.fields.items(), key=lambda kv: kv[1][1]):
        rows.append(f"| `{name}` | {sub.str.lstrip('<|=')} | {offset} | {sub.itemsize} |")
    return rows


def render_layout() -> str:
    """docs/layout.md, from shmkv/pool/layout.py."""
    from shmkv.pool import layout as L

    example = L.PoolConfig(num_blocks=4096, hash_block_size=16)
    lay = L.Layout.from_config(example)
    out = [
        "# The shared-memory layout",
        "",
        "Back to the [README](../README.md).",
        "",
        "<!-- Written by `python scripts/update_docs.py` from "
        "`shmkv/pool/layout.py`; edit that file, then run the script. -->",
        "",
        f"Layout version {L.LAYOUT_VERSION}, magic `{L.MAGIC:#x}`. A pool is one POSIX "
        "shared-memory segment named `/shmkv-<pool name>-v<layout version>`: a fixed header "
        f"followed by regions at {L.ALIGN_BYTES}-byte aligned offsets, in this order. The pool "
        "lock is a POSIX semaphore named `<segment name>.lock`, and the liveness lock file "
        "is `/dev/shm<segment name>.alive`. The tables below are generated from the code "
        "(`REGIONS` and the record dtypes of [`shmkv/pool/layout.py`]"
        "(../shmkv/pool/layout.py)), whose docstring says what every field means, who "
        "writes it, and in what order stores are published.",
        "",
        "## Regions",
        "",
        "| # | region | dtype | shape | written by | guarded by | invariants | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, region in enumerate(L.REGIONS):
        shape = ", ".join(str(d) for d in region.shape(_SymConfig()))
        out.append(f"| {k} | `{region.name}` | {_dtype_name(region.dtype, L)} | `[{shape}]` | "
                   f"{region.writer} | {region.guard} | {region.invariants} | {region.doc} |")
    out += ["", "`num_alias_rows` is `num_blocks` in a pool made with `partial_keys=True`, "
            "else 0; `num_index_buckets` is the power of two at or above `2 * num_blocks` "
            "(16 at least).", ""]
    for title, dtype in (("Header (`HEADER_DTYPE`)", L.HEADER_DTYPE),
                         ("Block rows (`BLOCK_DTYPE`)", L.BLOCK_DTYPE),
                         ("Process-table rows (`PROC_DTYPE`)", L.PROC_DTYPE),
                         ("Undo-journal entries (`JOURNAL_DTYPE`)", L.JOURNAL_DTYPE)):
        out += [f"## {title}", "", *_fields_table(dtype), ""]
    out += [
        "## An example: a pool of 4,096 blocks",
        "",
        f"`BlockPool.create(name, 4096)` (no event log, {example.max_processes} process "
        f"slots, {example.journal_entries:,} journal entries): {lay.total_bytes:,} bytes.",
        "",
        "| region | offset (B) | size (B) | shape |",
        "|---|---:|---:|---|",
    ]
    for name, offset, nbytes, _ in lay.describe():
        shape = " x ".join(str(d) for d in lay.shapes[name])
        out.append(f"| `{name}` | {offset:,} | {nbytes:,} | {shape} |")
    out += ["", _LAYOUT_PROSE]
    return "\n".join(out)


_LAYOUT_PROSE = """## Around the tables

The invariants the regions must keep (INV-FREE, INV-REF, INV-LEDGER, ...) are named and
checked once, in [`shmkv/pool/recovery.py`](../shmkv/pool/recovery.py);
`pool.check_invariants()` runs them and raises `InvariantViolation` listing every break.

Every other shmkv segment (channels, block tables, KV stores, stats, publisher positions,
offload tier tables) carries an owner record (its creator and its pool), laid out in the
same file ("Sibling segments"); `shmkv cleanup` reads only that to decide what may go
([cli.md](cli.md#cleanup-what-goes-and-what-stays)).

A KV store (`shmkv/ranks/kv_store.py`, whose docstring is its layout) is a 4 KiB header,
then K and V in one of two byte orders, named by the header's `layout` field: layer-major
(`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`: each layer's K, then its
V, over every block, so a model on the CPU attends over a layer in place) or block-major
(`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`: each block's K and V of
every layer in one contiguous range, so a set of blocks moves to or from a GPU in one copy
per run of consecutive ids). A store of another layout version is refused at attach,
naming `layout_version`.

To look at a live pool: `shmkv inspect NAME` or `python scripts/shmkv_inspect.py NAME` prints
its header, regions, counts and invariant status, `shmkv inspect NAME --keys` its cached
blocks one by one; `shmkv ls` lists every shmkv segment on the machine. How the journal, the
process table and the ledger are used when a process dies is in
[crash-safety.md](crash-safety.md).

Which store publishes which (the undo journal's entries and `journal_len`, the commit, the
lock marks, the Channel ring's `tail`/`head`, the block-table seqlock's `seq`), and the
barriers that keep them in that order on weakly ordered CPUs (aarch64) as well as on x86-64,
are in the module's docstring ("Memory ordering"). Only x86-64 machines have run the tests so
far: the barriers are checked to be there (`tests/unit/test_memory_ordering.py`), not seen to
be needed.
"""


# ---------------------------------------------------------------------------- samples

def render_sample(name: str, figures: dict[str, dict]) -> str:
    """The body of sample ``name`` (an indented block: the command, then its output), from
    ``figures``: each stored run's JSON, by its name in ``SAMPLE_RUNS``."""
    from shmkv.serve import report

    if name == "shmkv-run":
        text = "$ shmkv run\n" + report.comparison_output(figures["run"],
                                                          ["  plot: shmkv-run.png"])
    elif name == "shmkv-run-report":
        first = {k: v for k, v in figures["run"].items() if k != "compare"}
        text = "$ shmkv run --no-compare\n" + report.report_text(first) + "\n"
    elif name == "shmkv-run-kill-one":
        text = ("$ shmkv run --kill-one --no-compare --plot ''\n"
                + report.report_text(figures["kill-one"]) + "\n")
    elif name == "shmkv-replay-trace":
        text = (f"$ shmkv {' '.join(SAMPLE_RUNS['replay-trace'])} --plot ''\n"
                + report.comparison_output(figures["replay-trace"], []))
    else:
        raise ValueError(f"no sample named {name!r}")
    return "".join(f"    {line}".rstrip() + "\n" for line in text.splitlines()) + "\n"


def render_samples(text: str, figures: dict[str, dict]) -> str:
    """``text`` with every sample block re-rendered."""
    def sub(m: re.Match) -> str:
        return m.group(1) + "\n" + render_sample(m.group("name"), figures) + m.group(4)

    return _SAMPLE.sub(sub, text)


def sample_names(text: str) -> list[str]:
    return [m.group("name") for m in _SAMPLE.finditer(text)]


def run_sample(name: str = "run", trace: Path | None = None) -> None:
    """Runs sample ``name``'s command (``SAMPLE_RUNS``) and keeps its figures (and, for
    ``run``, the README's command, its plot as docs/run.png).

    Raises:
        SystemExit: ``replay-trace`` without ``trace``.
    """
    args = list(SAMPLE_RUNS[name])
    with tempfile.TemporaryDirectory() as tmp:
        if TRACE_NAME in args:
            if trace is None:
                raise SystemExit(f"--run {name} needs --trace PATH (the Mooncake {TRACE_NAME})")
            (Path(tmp) / TRACE_NAME).symlink_to(Path(trace).resolve())
        out = Path(tmp) / f"{name}.json"
        plot = str(ROOT / "docs" / "run.png") if name == "run" else ""
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "shmkv.cli", *args, "--json", str(out),
                        "--plot", plot], check=True, cwd=tmp,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
        print(f"shmkv {' '.join(args)}: {time.monotonic() - t0:.1f} s, load "
              f"{os.getloadavg()[0]:.2f}", file=sys.stderr)
        figures = json.loads(out.read_text())
    for f in (figures, *figures.get("compare", [])):
        f.pop("processes", None)  # pids of a past run: nothing a reader needs
    SAMPLES_DIR.mkdir(exist_ok=True)
    (SAMPLES_DIR / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")


def expected_files() -> dict[Path, str]:
    """Every generated file and what it should hold now."""
    figures = {name: json.loads((SAMPLES_DIR / f"{name}.json").read_text())
               for name in SAMPLE_RUNS}
    files = {LAYOUT_MD: render_layout()}
    for path in SAMPLE_FILES:
        files[path] = render_samples(path.read_text(), figures)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs="*", choices=sorted(SAMPLE_RUNS), metavar="NAME",
                        help="run these samples' commands again first (none named: all of "
                        f"them): {', '.join(SAMPLE_RUNS)}")
    parser.add_argument("--trace", type=Path,
                        help=f"the Mooncake {TRACE_NAME}, for --run replay-trace")
    parser.add_argument("--check", action="store_true", help="only say what is stale")
    args = parser.parse_args(argv)
    if args.run is not None:
        for name in args.run or list(SAMPLE_RUNS):
            run_sample(name, args.trace)
    stale = 0
    for path, text in expected_files().items():
        if path.read_text() == text:
            continue
        stale += 1
        if args.check:
            print(f"stale: {path.relative_to(ROOT)}", file=sys.stderr)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())


__all__ = ["expected_files", "main", "render_layout", "render_sample", "render_samples"]
