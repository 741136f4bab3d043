"""``python -m shmkv``: the ``shmkv`` command."""

from __future__ import annotations

import os
import sys


def _unshadow() -> None:
    """Import the installed package when a folder named ``shmkv`` without an ``__init__.py``
    (a checkout of this repository, say) in the current directory shadowed it.

    ``python -m`` puts the current directory first on ``sys.path``; Python then takes such a
    folder for a namespace package named ``shmkv``, and an editable install's finder, which
    runs after it, serves ``shmkv.__main__`` and ``shmkv.cli`` but not ``shmkv`` itself
    (``from shmkv import __version__`` fails). The entries that lead to such a folder leave
    ``sys.path`` (the processes the command starts inherit it) and ``shmkv`` is imported again.
    """
    pkg = sys.modules.get("shmkv")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return
    shadows = {os.path.realpath(p) for p in getattr(pkg, "__path__", ())}
    sys.path[:] = [e for e in sys.path
                   if os.path.realpath(os.path.join(e or os.curdir, "shmkv")) not in shadows]
    del sys.modules["shmkv"]
    import importlib

    importlib.invalidate_caches()
    importlib.import_module("shmkv")


def run() -> int:
    """The command, after :func:`_unshadow`; ``python -m shmkv.cli`` runs it too."""
    _unshadow()
    from shmkv.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
