"""``python -m shmkv``: the ``shmkv`` command."""

import sys

from shmkv.cli import main

sys.exit(main())
