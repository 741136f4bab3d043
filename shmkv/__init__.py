"""shmkv: one KV-cache block pool and prefix cache, in POSIX shared memory, for every
scheduler process on a node. Follows vLLM v1's KV-cache layer name for name.

``import shmkv`` never imports torch.
"""

from shmkv.block_pool import BlockPool, KVCacheBlock
from shmkv.errors import (
    InvariantViolation,
    LayoutMismatchError,
    OutOfBlocksError,
    PoolClosedError,
    ProtocolError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmKVError,
    UsageError,
)
from shmkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from shmkv.free_queue import FreeKVCacheBlockQueue
from shmkv.layout import LAYOUT_VERSION, NULL_BLOCK_ID

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "InvariantViolation",
    "KVCacheBlock",
    "KVEventBatch",
    "LAYOUT_VERSION",
    "LayoutMismatchError",
    "NULL_BLOCK_ID",
    "OutOfBlocksError",
    "PoolClosedError",
    "ProtocolError",
    "SegmentError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "ShmKVError",
    "UsageError",
]
