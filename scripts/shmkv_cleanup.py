#!/usr/bin/env python3
"""Remove orphaned shmkv objects (pools meant to stay are kept); the same as
``shmkv cleanup``.

    python scripts/shmkv_cleanup.py [--dry-run] [--idle-for DURATION] [--include-idle]
                                    [--prefix PREFIX]
"""

from __future__ import annotations

import sys

from shmkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["cleanup", *sys.argv[1:]]))
