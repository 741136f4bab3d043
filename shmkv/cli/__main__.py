"""``python -m shmkv.cli``: the same as the ``shmkv`` command."""

import sys

from shmkv.__main__ import run

sys.exit(run())
