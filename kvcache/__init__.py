"""kvcache: a verified, drop-in reference of vLLM 0.25.1's KV-cache manager.

The public names match vLLM's (``vllm.v1.core``), so code written against
vLLM's ``KVCacheManager`` runs against this package unchanged.

The core modules may be compiled with mypyc; ``COMPILED`` says whether the
compiled build is loaded, and ``KVCACHE_PURE=1`` selects the pure-Python
sources (``kvcache/_builds.py``).
"""

from kvcache import _builds, _deps

_deps.check_dependencies()  # a missing one: one line on the command line (exit 2)
_builds.select_build()

from kvcache import kv_cache_manager as _kv_cache_manager
from kvcache.block_pool import BlockHashToBlockMap, BlockPool
from kvcache.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvcache.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    ContextParallelError,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from kvcache.kv_cache_manager import KVCacheBlocks, KVCacheManager, enable_self_check
from kvcache.kv_cache_metrics import KVCacheMetricsCollector
from kvcache.kv_cache_utils import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
    sha256_cbor,
    xxhash,
    xxhash_cbor,
)
from kvcache.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from kvcache.metrics import PrefixCacheStats
from kvcache.request import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
)
from kvcache.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)

__version__ = "0.1.0"

COMPILED: bool = _builds.is_compiled(_kv_cache_manager)
"""Whether the mypyc-compiled core is loaded (False: the pure-Python sources)."""

__all__ = [
    "COMPILED",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ChunkedLocalAttentionManager",
    "ChunkedLocalAttentionSpec",
    "ContextParallelError",
    "CrossAttentionManager",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "HiddenStateCacheSpec",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheMetricsCollector",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "KVCacheTensor",
    "KVEventBatch",
    "LoRARequest",
    "MLAAttentionSpec",
    "MambaManager",
    "MambaSpec",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "PrefixCacheStats",
    "RSWAManager",
    "RSWASpec",
    "Request",
    "RequestStatus",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "TQFullAttentionSpec",
    "UniformTypeKVCacheSpecs",
    "UnitaryKVCacheCoordinator",
    "enable_self_check",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_kv_cache_coordinator",
    "get_kv_cache_spec_kind",
    "get_kv_cache_spec_sliding_window",
    "get_manager_for_kv_cache_spec",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "sha256",
    "sha256_cbor",
    "xxhash",
    "xxhash_cbor",
]
