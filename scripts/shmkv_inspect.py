#!/usr/bin/env python3
"""Print a live pool's header, regions, usage, processes and invariant status (shmkv's
``mdb_stat``); the same as ``shmkv inspect NAME``.

    python scripts/shmkv_inspect.py POOL_NAME
"""

from __future__ import annotations

import sys

from shmkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["inspect", *sys.argv[1:]]))
