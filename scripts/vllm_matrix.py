"""Runs shmkv's vLLM tests against each vLLM release, one environment per release, and writes
the release table of docs/vllm.md from what ran.

    python scripts/vllm_matrix.py --env 0.33.0=/path/venv-v33/bin/python \
        --env 0.34.0=/path/venv-v34/bin/python [--junit 0.33.0=run.xml] [--write-docs]

Each environment holds one vLLM release's KV layer (``VLLM_VERSION=<release> bash
benchmarks/vllm_peer/install.sh PYTHON``), its fetched upstream tests (``PYTHON
tests/vllm_upstream/fetch.py``) and shmkv (``pip install -e '.[dev]'``). Per release the
script runs, in one pytest session of that environment:

- the differential tests (``tests/differential``: shmkv against the release's own classes);
- vLLM's own KV-layer tests of that release, run against shmkv (``tests/vllm_upstream``);
- the tier's scheduler-level tests (``TIER_TESTS``: real vLLM schedulers with the shared
  tier, the CPU transfer worker against the release's worker interface, the release gate).

``--junit RELEASE=FILE`` takes a release's figures from a JUnit XML file a run already wrote
(CI's full run covers the first release) and needs the upstream summary beside it
(``FILE.upstream.json``, written when ``SHMKV_UPSTREAM_SUMMARY`` names it). ``--write-docs``
replaces the table between the ``vllm-matrix`` markers in docs/vllm.md; without it the table
is printed. The exit status is 1 if any test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "vllm.md"
BEGIN, END = "<!-- vllm-matrix:begin -->", "<!-- vllm-matrix:end -->"
TIER_TESTS = (
    "tests/multiprocess/test_vllm_schedulers_shared.py",
    "tests/unit/test_vllm_cpu_worker.py",
    "tests/unit/test_vllm_compat.py",
)
SUITES = ("differential", "upstream", "tier")


def suite_of(classname: str) -> str | None:
    if classname.startswith("tests.differential."):
        return "differential"
    if classname.startswith("tests.vllm_upstream."):
        return "upstream"
    path = classname.replace(".", "/") + ".py"
    return "tier" if path in TIER_TESTS else None


def read_junit(path: Path) -> dict[str, Counter]:
    """Per suite: passed, failed (errors included) and skipped test counts."""
    out = {name: Counter() for name in SUITES}
    for case in ET.parse(path).iter("testcase"):
        # A module skipped whole is one case named by its module, with no class name.
        suite = suite_of(case.get("classname") or case.get("name", ""))
        if suite is None:
            continue
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            out[suite]["failed"] += 1
        elif "skipped" in tags:
            out[suite]["skipped"] += 1
        else:
            out[suite]["passed"] += 1
    return out


def run_release(python: str, workdir: Path) -> tuple[Path, Path, float]:
    workdir.mkdir(parents=True, exist_ok=True)
    """Runs the three suites in ``python``'s environment; returns the JUnit file, the
    upstream summary and the seconds it took."""
    junit, summary = workdir / "junit.xml", workdir / "upstream.json"
    env = dict(os.environ, SHMKV_UPSTREAM_SUMMARY=str(summary))
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={junit}", "tests/differential", "tests/vllm_upstream", *TIER_TESTS]
    start = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    return junit, summary, time.monotonic() - start


def release_of(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True, text=True, check=True).stdout.strip()


def row(release: str, suites: dict[str, Counter], upstream: dict) -> str:
    def cell(c: Counter) -> str:
        text = f"{c['passed']} passed"
        if c["failed"]:
            text += f", **{c['failed']} failed**"
        if c["skipped"]:
            text += f", {c['skipped']} skipped"
        return text

    failed = upstream.get("failed", 0) + upstream.get("error", 0) + upstream.get("xpassed", 0)
    ups = (f"{upstream.get('passed', 0)} passed"
           + (f", **{failed} failed**" if failed else "")
           + f", {upstream.get('xfailed', 0)} known gaps; {upstream.get('deselected', 0)} "
           "not run") if upstream else "not run"
    return (f"| {release} | {cell(suites['differential'])} | {ups} | "
            f"{cell(suites['tier'])} |")


def table(rows: list[str]) -> str:
    return "\n".join([
        BEGIN,
        "| vLLM | differential tests | the release's own KV-layer tests, on shmkv | tier, "
        "scheduler level |",
        "|---|---|---|---|",
        *rows,
        END,
    ])


def write_docs(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + text + tail)


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        release, sep, path = value.partition("=")
        if not sep:
            raise SystemExit(f"{what} takes RELEASE=PATH, got {value!r}")
        out[release] = path
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[],
                        help="RELEASE=PYTHON: the interpreter of that release's environment")
    parser.add_argument("--junit", action="append", default=[],
                        help="RELEASE=FILE: take that release's figures from a JUnit file")
    parser.add_argument("--write-docs", action="store_true",
                        help="replace the table in docs/vllm.md")
    parser.add_argument("--keep", type=Path,
                        help="keep each release's JUnit file and upstream figures here "
                             "(RELEASE.xml, RELEASE.xml.upstream.json: --junit reads them)")
    args = parser.parse_args(argv)
    envs, junits = _pairs(args.env, "--env"), _pairs(args.junit, "--junit")
    if not envs and not junits:
        parser.error("give at least one --env or --junit")
    results: dict[str, tuple[dict[str, Counter], dict]] = {}
    bad = False
    for release, path in junits.items():
        summary = Path(path + ".upstream.json")
        upstream = json.loads(summary.read_text()) if summary.is_file() else {}
        results[release] = (read_junit(Path(path)), upstream)
    for release, python in envs.items():
        installed = release_of(python).split("+")[0]
        if installed != release:
            raise SystemExit(f"{python} has vLLM {installed}, not {release}")
        with tempfile.TemporaryDirectory() as tmp:
            junit, summary, seconds = run_release(python, Path(tmp))
            upstream = json.loads(summary.read_text()) if summary.is_file() else {}
            results[release] = (read_junit(junit), upstream)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(junit, args.keep / f"{release}.xml")
                if summary.is_file():
                    shutil.copy(summary, args.keep / f"{release}.xml.upstream.json")
        print(f"vLLM {release}: {seconds:.0f} s", file=sys.stderr)
    rows = []
    for release in sorted(results, key=lambda r: tuple(int(x) for x in r.split("."))):
        suites, upstream = results[release]
        bad |= any(c["failed"] for c in suites.values())
        rows.append(row(release, suites, upstream))
    text = table(rows)
    if args.write_docs:
        write_docs(text)
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
