"""Runs a vLLM release's fetched KV-cache tests in their own pytest session and tabulates them.

    python tests/vllm_upstream/run.py [--target shmkv|vllm|both] [FILE ...]

The release is the installed vLLM's (``fetch.installed_release``): its tests, fetched with
``python tests/vllm_upstream/fetch.py``, under ``_upstream/<release>/``.

prints, per file: tests collected, passed, failed, deselected (``expectations.DESELECTED``),
xfailed (``expectations.KNOWN_GAPS``), and how many constructed a shmkv object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    from tests.vllm_upstream import fetch
except ImportError:  # run as a script
    sys.path.insert(0, str(HERE))
    import fetch  # type: ignore[no-redef]

RELEASE = fetch.installed_release()
UPSTREAM = fetch.dest_for(RELEASE)
# vLLM's tests of this layer that run here (paths relative to UPSTREAM).
FILES = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_kv_cache_metrics.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
)
# Files of tests/v1/core/prefix_cache that do not run here, and why.
EXCLUDED_FILES = {
    "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py":
        "end to end: starts vLLM's OpenAI server on a real model (GPU)",
}
TIMEOUT_S = 600


def fetched() -> bool:
    return (UPSTREAM / "FETCHED").is_file()


def run_upstream(target: str, files=FILES, extra_args=()) -> dict[str, dict]:
    """Runs ``files`` against ``target`` ("shmkv" or "vllm"); returns nodeid -> result."""
    import shmkv

    root = str(Path(shmkv.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [root, str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["SHMKV_UPSTREAM_TARGET"] = target
    env["SHMKV_UPSTREAM_RELEASE"] = RELEASE
    # Some tests build vLLM's ModelConfig, which asks the Hugging Face hub about the model:
    # offline, they fail at once (on vLLM as on shmkv) instead of waiting on the network.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        env["SHMKV_UPSTREAM_RESULTS"] = str(out)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "shmkv_upstream_plugin", "--rootdir=.", "-c", os.devnull,
               "--confcutdir=.", "--timeout=120", "-W", "ignore", "-o", "addopts=",
               *extra_args, *files]
        proc = subprocess.run(cmd, cwd=UPSTREAM, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        if not out.is_file():
            raise RuntimeError(f"the upstream session wrote no results (rc {proc.returncode}):"
                               f"\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        data = json.loads(out.read_text())["results"]
    # A file that failed to import shows up as one collection error.
    for line in proc.stdout.splitlines():
        if line.startswith("ERROR ") and "::" not in line:
            path = line.split()[1]
            data[path + "::<collection>"] = {"outcome": "error", "error": line}
    return data


def tabulate(results: dict[str, dict]) -> dict[str, Counter]:
    table: dict[str, Counter] = {}
    for nodeid, r in results.items():
        c = table.setdefault(nodeid.split("::", 1)[0], Counter())
        c[r["outcome"]] += 1
        c["touched"] += bool(r.get("touched"))
        if r["outcome"] != "deselected":
            c["ran"] += 1
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="both", choices=("shmkv", "vllm", "both"))
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("files", nargs="*", default=list(FILES))
    args = parser.parse_args(argv)
    if not fetched():
        print(f"vLLM {RELEASE}'s tests are not fetched: python tests/vllm_upstream/fetch.py")
        return 2
    targets = ("vllm", "shmkv") if args.target == "both" else (args.target,)
    raw = {}
    for target in targets:
        t0 = time.monotonic()
        raw[target] = run_upstream(target, args.files)
        table = tabulate(raw[target])
        print(f"\n== vLLM {RELEASE}'s tests against {target} ({time.monotonic() - t0:.0f} s)")
        print(f"{'file':64} {'ran':>4} {'pass':>4} {'fail':>4} {'desel':>5} {'xfail':>5}"
              f" {'shmkv':>5}")
        tot = Counter()
        for path in args.files:
            c = table.get(path, Counter())
            tot.update(c)
            print(f"{path:64} {c['ran']:4} {c['passed']:4} {c['failed'] + c['error']:4}"
                  f" {c['deselected']:5} {c['xfailed']:5} {c['touched']:5}")
        print(f"{'total':64} {tot['ran']:4} {tot['passed']:4} {tot['failed'] + tot['error']:4}"
              f" {tot['deselected']:5} {tot['xfailed']:5} {tot['touched']:5}")
        bad = sorted(k for k, v in raw[target].items() if v["outcome"] in ("failed", "error"))
        for k in bad:
            print(f"  FAILED {k}: {raw[target][k].get('error', '')}")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
