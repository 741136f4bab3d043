"""Imported only by the fork server of ``shmkv run`` (``Runner``'s preload list), for its
side effect: the fork server ignores SIGTERM.

A SIGTERM to the whole process group (a CI time limit, ``kill -TERM -PGID``) would otherwise
kill the fork server first, and with it every scheduler and rank at once: they are its
children and die with their parent (``PR_SET_PDEATHSIG``, ``engine.child_setup``), before
their own clean stop could detach them from the pool. Ignoring it, the fork server still ends
with the front end (it exits when the front end's end of its pipe closes), and each child
sets its own SIGTERM handler first thing (``engine.child_setup``).
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
