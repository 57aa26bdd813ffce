"""The executable model (oracle) of vLLM 0.25.1's request-level KV-cache manager.

Plain lists, dicts and ints: a block is its id and block 0 is the null block.
"""

from spec.block_pool import NULL_BLOCK, BlockPool
from spec.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from spec.kv_cache_manager import KVCacheBlocks, KVCacheManager
from spec.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)

__all__ = [
    "NULL_BLOCK", "BlockPool", "ChunkedLocalAttentionManager", "CrossAttentionManager",
    "FullAttentionManager", "HybridKVCacheCoordinator", "KVCacheBlocks", "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache", "KVCacheManager", "MambaManager",
    "SingleTypeKVCacheManager", "SlidingWindowManager", "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator", "get_manager_for_kv_cache_spec",
]
