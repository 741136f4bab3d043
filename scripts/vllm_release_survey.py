"""Surveys a new vLLM release for shmkv: what changed in the files shmkv mirrors or plugs
into, and how the differential tests fare against it.

    python scripts/vllm_release_survey.py 0.35.0 [--previous 0.34.0] [--diffs DIR]
        [--env DIR | --python PYTHON]

1. Downloads both releases' wheels without dependencies (``pip download --no-deps``).
2. Compares the files of ``WATCHED`` (vLLM's KV-cache layer, its request, the offloading
   API and connector, KV events, the scheduler) between them and prints, per file:
   unchanged, changed (lines added and removed), added or removed; ``--diffs DIR`` writes
   each changed file's unified diff there.
3. With ``--env DIR`` (a fresh environment made there: torch, the release's KV layer by
   ``benchmarks/vllm_peer/install.sh``, shmkv) or ``--python`` (an environment that has the
   release already), runs the differential tests against the release, with
   ``SHMKV_VLLM_UNTESTED=1`` so that shmkv.vllm imports with it, and prints pytest's summary.

The previous release defaults to the newest one shmkv is tested with. Exit status: 0, or
pytest's when the tests ran and failed.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile
import zipfile
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What shmkv mirrors (core/, pool/, hashing), plugs into (vllm/) or reads (events).
WATCHED = (
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/core/sched/scheduler.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/request.py",
    "vllm/v1/hisparse/*.py",
    "vllm/v1/kv_offload/*.py",
    "vllm/v1/kv_offload/cpu/*.py",
    "vllm/v1/kv_offload/cpu/policies/*.py",
    "vllm/v1/worker/block_table.py",
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/utils/hashing.py",
    "vllm/distributed/kv_events.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/*.py",
)
# Under the patterns above (``*`` crosses directories) but not used by shmkv.
UNWATCHED = ("vllm/v1/kv_offload/tiering/*", "vllm/v1/kv_offload/fs/*")


def newest_tested() -> str:
    text = (ROOT / "shmkv" / "vllm" / "compat.py").read_text()
    line = next(x for x in text.splitlines() if x.startswith("TESTED_VLLM_VERSIONS"))
    releases = [part.strip(" \"'") for part in line.split("(", 1)[1].rstrip(")").split(",")]
    releases = [r for r in releases if r]
    return max(releases, key=lambda r: tuple(int(x) for x in r.split(".")))


def download(release: str, dest: Path) -> Path:
    """The release's wheel, downloaded without dependencies into ``dest``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    f"vllm=={release}", "-d", str(dest)], check=True)
    wheels = sorted(dest.glob(f"vllm-{release}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip downloaded no wheel of vllm {release} into {dest}")
    return wheels[0]


def watched_files(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name).decode("utf-8", "replace") for name in zf.namelist()
                if any(fnmatch(name, pattern) for pattern in WATCHED)
                and not any(fnmatch(name, pattern) for pattern in UNWATCHED)}


def compare(old: dict[str, str], new: dict[str, str], diffs: Path | None) -> list[str]:
    lines = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            lines.append(f"removed    {name}")
            continue
        if name not in old:
            lines.append(f"added      {name} ({new[name].count(chr(10))} lines)")
            continue
        if old[name] == new[name]:
            lines.append(f"unchanged  {name}")
            continue
        diff = list(difflib.unified_diff(old[name].splitlines(keepends=True),
                                         new[name].splitlines(keepends=True),
                                         f"a/{name}", f"b/{name}"))
        plus = sum(1 for x in diff if x.startswith("+") and not x.startswith("+++"))
        minus = sum(1 for x in diff if x.startswith("-") and not x.startswith("---"))
        lines.append(f"changed    {name} (+{plus} -{minus})")
        if diffs is not None:
            out = diffs / (name.replace("/", "__") + ".diff")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(diff))
    return lines


def make_env(path: Path, release: str) -> str:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = str(path / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
    subprocess.run(["bash", str(ROOT / "benchmarks" / "vllm_peer" / "install.sh"), python],
                   env=dict(os.environ, VLLM_VERSION=release), check=False)
    subprocess.run([python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[dev]"], check=True)
    return python


def run_differential(python: str) -> int:
    env = dict(os.environ, SHMKV_VLLM_UNTESTED="1")
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                           "addopts=", "-m", "differential", "tests/differential"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    failed = [x for x in proc.stdout.splitlines() if x.startswith(("FAILED", "ERROR"))]
    print("\n".join(failed))
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:])
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", help="the new vLLM release, e.g. 0.35.0")
    parser.add_argument("--previous", default=None,
                        help="the release to compare with (default: the newest tested one)")
    parser.add_argument("--diffs", type=Path, help="write each changed file's diff here")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--env", type=Path, help="make an environment here and run the "
                                                "differential tests in it")
    group.add_argument("--python", help="run the differential tests with this interpreter")
    args = parser.parse_args(argv)
    previous = args.previous or newest_tested()
    with tempfile.TemporaryDirectory() as tmp:
        old = watched_files(download(previous, Path(tmp) / "old"))
        new = watched_files(download(args.release, Path(tmp) / "new"))
    print(f"vLLM {previous} -> {args.release}: the files shmkv mirrors or plugs into")
    lines = compare(old, new, args.diffs)
    print("\n".join(lines))
    changed = sum(1 for x in lines if not x.startswith("unchanged"))
    print(f"{changed} of {len(lines)} files differ")
    python = args.python or (make_env(args.env, args.release) if args.env else None)
    if python is None:
        return 0
    print(f"\ndifferential tests against vLLM {args.release}:")
    return run_differential(python)


if __name__ == "__main__":
    sys.exit(main())
