"""Fetches vLLM 0.33.0's own tests of the KV-cache layer for the upstream adapter.

    python tests/vllm_upstream/fetch.py [--sdist PATH]

Takes the ``vllm==0.33.0`` source distribution from the package index (or a local copy given
with ``--sdist`` or ``$SHMKV_VLLM_SDIST``), checks its sha256, and unpacks ``tests/v1/core/``
and the few helper modules those tests import into ``tests/vllm_upstream/_upstream/``
(ignored by git). Nothing of vLLM's test suite is committed: the adapter runs whatever this
unpacked.

Why not ``pip download vllm==0.33.0 --no-binary :all:``: pip prepares the metadata of a
source distribution before it saves it, which for vLLM means installing its build
requirements (cmake, ninja, a CUDA torch) or running its setup.py; neither is wanted for
reading test files. This script asks the same index pip uses (the PEP 691 JSON form of
``https://pypi.org/simple/vllm/``, or ``$PIP_INDEX_URL``) for the one file and verifies the
hash the index gives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
# The sha256 of vllm-0.33.0.tar.gz on PyPI (checked against the index's own too).
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
HERE = Path(__file__).resolve().parent
DEST = HERE / "_upstream"
STAMP = DEST / "FETCHED"
# What is unpacked, relative to the sdist's root: the layer's tests and the helpers they
# import (tests/v1/core/utils.py imports tests/v1/kv_connector/unit/utils.py).
MEMBERS = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)


def _index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def download(dest_dir: Path) -> Path:
    """Downloads the sdist from the package index into ``dest_dir`` and returns its path."""
    req = urllib.request.Request(f"{_index_url()}/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp)["files"]
    entry = next((f for f in files if f["filename"] == SDIST), None)
    if entry is None:
        raise SystemExit(f"{SDIST} is not on {_index_url()}")
    index_sha = entry.get("hashes", {}).get("sha256")
    if index_sha and index_sha != SDIST_SHA256:
        raise SystemExit(f"{SDIST}: the index says sha256 {index_sha}, expected {SDIST_SHA256}")
    path = dest_dir / SDIST
    with urllib.request.urlopen(entry["url"], timeout=600) as resp, open(path, "wb") as out:
        shutil.copyfileobj(resp, out)
    return path


def check_sha(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {SDIST_SHA256}")


def unpack(sdist: Path, dest: Path = DEST) -> int:
    """Unpacks the test files into ``dest`` (replacing what was there); returns the count."""
    prefix = f"vllm-{VERSION}/"
    tmp = Path(tempfile.mkdtemp(prefix="vllm-tests-", dir=dest.parent))
    count = 0
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.startswith(prefix):
                    continue
                rel = member.name[len(prefix):]
                if not any(rel == m or (m.endswith("/") and rel.startswith(m))
                           for m in MEMBERS):
                    continue
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                count += 1
        (tmp / "FETCHED").write_text(f"{SDIST} sha256={SDIST_SHA256} files={count}\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", default=os.environ.get("SHMKV_VLLM_SDIST"),
                        help=f"a local {SDIST} (default: download it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = Path(args.sdist) if args.sdist else download(Path(tmp))
        check_sha(sdist)
        count = unpack(sdist)
    print(f"unpacked {count} files of {SDIST} into {DEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
