"""The installed vLLM release's own tests of the KV-cache layer (``tests/v1/core/`` of its
source distribution), run unchanged against shmkv's classes.

The test files are not in this repository: ``python tests/vllm_upstream/fetch.py`` unpacks the
installed release's into ``tests/vllm_upstream/_upstream/<release>/`` (``.ci/run`` does). They
run in one pytest subprocess with ``shmkv_upstream_plugin`` (the shims, the deselect list of
``expectations.py``), so the rebinding of vLLM's names never reaches this session, where the
differential tests need vLLM's own classes. Each file below is one test here: it fails listing
every upstream test of that file that failed on shmkv. Without vLLM, or without the fetched
files, it skips.

By hand (``SHMKV_UPSTREAM_TARGET=vllm`` runs them against vLLM itself)::

    python tests/vllm_upstream/run.py [--target vllm] [FILE ...]
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.vllm_upstream import run as upstream

pytest.importorskip("vllm.v1.core.kv_cache_manager")
pytestmark = [pytest.mark.differential, pytest.mark.long]


@pytest.fixture(scope="module")
def results():
    if not upstream.fetched():
        pytest.skip(f"vLLM {upstream.RELEASE}'s tests are not fetched: "
                    "python tests/vllm_upstream/fetch.py")
    results = upstream.run_upstream("shmkv", upstream.FILES)
    summary = os.environ.get("SHMKV_UPSTREAM_SUMMARY")
    if summary:  # the release matrix's figures (scripts/vllm_matrix.py)
        total = Counter()
        for counts in upstream.tabulate(results).values():
            total.update(counts)
        with open(summary, "w") as out:
            json.dump({"release": upstream.RELEASE, **total}, out)
    return results


# The first test waits for the whole upstream session (its fixture).
@pytest.mark.timeout(upstream.TIMEOUT_S + 60)
@pytest.mark.parametrize("path", upstream.FILES)
def test_vllm_upstream_file_passes_on_shmkv(results, path):
    mine = {k: v for k, v in results.items() if k.split("::", 1)[0] == path}
    assert mine, f"no test of {path} ran (collection error?)"
    bad = {k: v for k, v in mine.items() if v["outcome"] in ("failed", "error", "xpassed")}
    assert not bad, f"{len(bad)} of vLLM's tests in {path} fail on shmkv:\n" + "\n".join(
        f"  {k}: {v['outcome']} {v.get('error', '')}" for k, v in sorted(bad.items()))
