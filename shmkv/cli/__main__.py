"""``python -m shmkv.cli``: the same as the ``shmkv`` command."""

import sys

from shmkv.cli import main

sys.exit(main())
