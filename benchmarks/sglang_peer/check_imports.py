"""Verify that SGLang's real HiCache storage modules import (no stubs)."""
import runpy
import sys
from pathlib import Path

IMPORTS = [
    ("sglang.srt.mem_cache.hicache_storage",
     ["HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "HiCacheFile"]),
    ("sglang.srt.mem_cache.storage.backend_factory", ["StorageBackendFactory"]),
]


# The same check as the vLLM recipe's (one line per name, exit 1 on anything missing).
check = runpy.run_path(str(Path(__file__).resolve().parents[1] / "vllm_peer"
                           / "check_imports.py"))["check"]

if __name__ == "__main__":
    sys.exit(check(IMPORTS))
