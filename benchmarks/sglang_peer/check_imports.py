"""Verify that SGLang's real HiCache storage modules import (no stubs)."""
import importlib
import sys

IMPORTS = [
    ("sglang.srt.mem_cache.hicache_storage",
     ["HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "HiCacheFile"]),
    ("sglang.srt.mem_cache.storage.backend_factory", ["StorageBackendFactory"]),
]


def main() -> int:
    ok = True
    for mod, names in IMPORTS:
        try:
            m = importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL import {mod}: {type(e).__name__}: {e}")
            ok = False
            continue
        for n in names:
            print(f"{'ok  ' if hasattr(m, n) else 'FAIL'} from {mod} import {n}")
            ok = ok and hasattr(m, n)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
