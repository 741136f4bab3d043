"""shmkv's exceptions, one hierarchy under :class:`ShmKVError`.

| class                  | raised when                                                        |
|------------------------|--------------------------------------------------------------------|
| ShmKVError             | base class; catch it to catch everything shmkv raises on purpose   |
| OutOfBlocksError       | a commit path needs more free blocks than the pool has (ValueError, |
|                        | with vLLM's message, so code written for vLLM keeps working)       |
| UsageError             | the caller passed a bad argument (ValueError); nothing was changed |
| PoolClosedError        | a handle or pool is used after ``close()``                          |
| SegmentError           | base of the shared-memory segment errors                           |
| SegmentNotFoundError   | attach to a name that has no segment                               |
| SegmentExistsError     | create over a segment that already exists                          |
| NoSpaceError           | /dev/shm has no room for a new segment's pages; names both sizes   |
| LayoutMismatchError    | the segment is not shmkv's, or of another layout version or config |
| LockTimeoutError       | the pool lock was not acquired in time; names the holder           |
| FencedError            | this process's slot was reclaimed; it must attach again            |
| PoolFullError          | every process-table slot is held by a live process                 |
| ProtocolError          | a message or event batch that cannot be decoded                    |
| TornReadError          | no consistent snapshot of a shared block table could be read in    |
|                        | time, or a zero-copy read overlapped a write                      |
| InvariantViolation     | ``check_invariants`` found corruption; carries ``.violations``     |

Every message carries the numbers that explain it (block ids, counts, expected vs found).
"""

from __future__ import annotations


class ShmKVError(Exception):
    """Base class of every error shmkv raises on purpose."""


class OutOfBlocksError(ShmKVError, ValueError):
    """Not enough free blocks; a ValueError carrying vLLM's message."""


class UsageError(ShmKVError, ValueError):
    """A bad argument (double free, id out of range, bad name...); nothing was changed."""


class PoolClosedError(UsageError):
    """The pool, or a block handle of it, was used after ``close()``."""


class ForkedPoolError(UsageError):
    """A pool handle was used in a forked child of the process that opened it: the child
    must attach the pool itself (the handle's slot, lock and liveness are the parent's)."""


class SegmentError(ShmKVError):
    """Base class of shared-memory segment errors."""


class SegmentNotFoundError(SegmentError):
    """No segment exists under the requested name."""


class SegmentExistsError(SegmentError):
    """A segment already exists under the name ``create`` was given."""


class NoSpaceError(SegmentError):
    """/dev/shm has no room for a new segment: its pages are reserved at creation, so this
    is raised by ``create``, naming the size asked for and the free space, and nothing is
    left behind (never a SIGBUS on first touch)."""


class LayoutMismatchError(SegmentError):
    """The segment's header does not match: bad magic, layout version, size or config."""


class LockTimeoutError(ShmKVError):
    """The pool lock was not acquired within the timeout; the message names the holder."""


class FencedError(ShmKVError):
    """This process's process-table slot was reclaimed; it must not touch the pool again."""


class PoolFullError(SegmentError):
    """Every process-table slot is held by a live process."""


class ProtocolError(ShmKVError):
    """A message or event batch could not be decoded (bad bytes, unknown tag)."""


class TornReadError(ShmKVError):
    """A shared block table changed under a reader: no consistent snapshot in time, or a
    zero-copy read overlapped a write (the step handshake was broken)."""


class InvariantViolation(ShmKVError):
    """Shared state is corrupt; ``violations`` lists every broken invariant, id first."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = list(violations)
        lines = "\n  ".join(self.violations)
        super().__init__(f"{len(self.violations)} invariant violation(s):\n  {lines}")
