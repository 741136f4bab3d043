"""Fetches one vLLM release's own tests of the KV-cache layer for the upstream adapter.

    python tests/vllm_upstream/fetch.py [--release 0.34.0] [--sdist PATH]

Takes the release's source distribution from the package index (or a local copy given with
``--sdist`` or ``$SHMKV_VLLM_SDIST``), checks its sha256 against the one pinned here
(``SDIST_SHA256``), and unpacks ``tests/v1/core/`` and the few helper modules those tests
import into ``tests/vllm_upstream/_upstream/<release>/`` (ignored by git), one directory per
release. The release defaults to the installed vLLM's (``$VLLM_VERSION`` overrides it), so
the adapter runs the tests of the vLLM it tests against. Nothing of vLLM's test suite is
committed: the adapter runs whatever this unpacked.

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
import importlib.metadata
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

# The sha256 of each tested release's source distribution on PyPI (checked against the
# index's own too). A release not listed here is refused: add its hash to test it.
SDIST_SHA256 = {
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}
DEFAULT_RELEASE = "0.33.0"
HERE = Path(__file__).resolve().parent
ROOT = HERE / "_upstream"


def installed_release() -> str:
    """The release whose tests to use: ``$VLLM_VERSION``, else the installed vLLM's (its
    local suffix dropped), else ``DEFAULT_RELEASE``."""
    release = os.environ.get("VLLM_VERSION")
    if release:
        return release
    try:
        return importlib.metadata.version("vllm").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return DEFAULT_RELEASE


def dest_for(release: str) -> Path:
    """Where ``release``'s tests are unpacked."""
    return ROOT / release


def sdist_name(release: str) -> str:
    return f"vllm-{release}.tar.gz"


def pinned_sha(release: str) -> str:
    try:
        return SDIST_SHA256[release]
    except KeyError:
        raise SystemExit(f"no pinned sha256 for vLLM {release}'s source distribution "
                         f"(pinned: {', '.join(SDIST_SHA256)}): add it to SDIST_SHA256 in "
                         f"{Path(__file__).name}") from None
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


def download(dest_dir: Path, release: str) -> Path:
    """Downloads ``release``'s sdist from the package index into ``dest_dir`` and returns
    its path."""
    sdist, want = sdist_name(release), pinned_sha(release)
    req = urllib.request.Request(f"{_index_url()}/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp)["files"]
    entry = next((f for f in files if f["filename"] == sdist), None)
    if entry is None:
        raise SystemExit(f"{sdist} is not on {_index_url()}")
    index_sha = entry.get("hashes", {}).get("sha256")
    if index_sha and index_sha != want:
        raise SystemExit(f"{sdist}: the index says sha256 {index_sha}, expected {want}")
    path = dest_dir / sdist
    with urllib.request.urlopen(entry["url"], timeout=600) as resp, open(path, "wb") as out:
        shutil.copyfileobj(resp, out)
    return path


def check_sha(path: Path, release: str) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != pinned_sha(release):
        raise SystemExit(f"{path}: sha256 {digest}, expected {pinned_sha(release)}")


def unpack(sdist: Path, release: str, dest: Path | None = None) -> int:
    """Unpacks ``release``'s test files into ``dest`` (default ``dest_for(release)``,
    replacing what was there); returns the count."""
    dest = dest or dest_for(release)
    dest.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"vllm-{release}/"
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
        (tmp / "FETCHED").write_text(
            f"{sdist_name(release)} sha256={pinned_sha(release)} files={count}\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default=installed_release(),
                        help="the vLLM release (default: $VLLM_VERSION, else the installed "
                             "vLLM's)")
    parser.add_argument("--sdist", default=os.environ.get("SHMKV_VLLM_SDIST"),
                        help="a local vllm-RELEASE.tar.gz (default: download it)")
    args = parser.parse_args(argv)
    pinned_sha(args.release)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = Path(args.sdist) if args.sdist else download(Path(tmp), args.release)
        check_sha(sdist, args.release)
        count = unpack(sdist, args.release)
    print(f"unpacked {count} files of {sdist_name(args.release)} into "
          f"{dest_for(args.release)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
