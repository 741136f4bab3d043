#!/usr/bin/env python3
"""Remove shmkv pools that no live process is attached to; the same as ``shmkv cleanup``.

    python scripts/shmkv_cleanup.py [--dry-run]
"""

from __future__ import annotations

import sys

from shmkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["cleanup", *sys.argv[1:]]))
