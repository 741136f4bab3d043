"""shmkv: one KV-cache block pool and prefix cache, in POSIX shared memory, for every
scheduler process on a node. Follows vLLM v1's KV-cache layer name for name.

``import shmkv`` never imports torch.
"""

from shmkv.block_pool import BlockPool, KVCacheBlock, RepairReport
from shmkv.errors import (
    FencedError,
    InvariantViolation,
    LayoutMismatchError,
    LockTimeoutError,
    OutOfBlocksError,
    PoolClosedError,
    PoolFullError,
    ProtocolError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmKVError,
    UsageError,
)
from shmkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from shmkv.free_queue import FreeKVCacheBlockQueue
from shmkv.hashing import (
    DEFAULT_NONE_HASH_SEED,
    HASH_FN_NAMES,
    BlockHashListWithBlockSize,
    RequestBlockHasher,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    none_hash,
    sha256,
    sha256_cbor,
    to_event_extra_keys,
)
from shmkv.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from shmkv.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from shmkv.layout import LAYOUT_VERSION, NULL_BLOCK_ID
from shmkv.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request

__version__ = "0.1.0"

__all__ = [
    "PrefixCacheStats",
    "KVCacheManager",
    "KVCacheBlocks",
    "get_kv_cache_coordinator",
    "UnitaryKVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheCoordinator",
    "HybridKVCacheCoordinator",
    "AllBlocksCleared",
    "BlockHashListWithBlockSize",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "DEFAULT_NONE_HASH_SEED",
    "FencedError",
    "FreeKVCacheBlockQueue",
    "HASH_FN_NAMES",
    "InvariantViolation",
    "KVCacheBlock",
    "KVEventBatch",
    "LAYOUT_VERSION",
    "LayoutMismatchError",
    "LockTimeoutError",
    "LoRARequest",
    "MultiModalFeatureSpec",
    "NULL_BLOCK_ID",
    "OutOfBlocksError",
    "PlaceholderRange",
    "PoolClosedError",
    "PoolFullError",
    "ProtocolError",
    "RepairReport",
    "Request",
    "RequestBlockHasher",
    "SegmentError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "ShmKVError",
    "UsageError",
    "generate_block_hash_extra_keys",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "hash_block_tokens",
    "none_hash",
    "sha256",
    "sha256_cbor",
    "to_event_extra_keys",
]
