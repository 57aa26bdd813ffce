"""A group whose spec says it takes no part in prefix caching (``prefix_cacheable``
False, as vLLM 0.33.0's ``SlidingWindowMLASpec(bounded_replay=True)``) keys nothing:
its blocks are allocated and freed like any window's, but never hashed or cached,
so its block size need not fit the hash block. kvcache and the spec alike; vLLM
0.33.0's own ``test_contiguous_kv_packing.py::TestSWABoundedReplayGrouping`` runs in
``make upstream-0.33``.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
import spec
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    Request,
    SlidingWindowSpec,
    sha256,
)
from kvcache import vllm_0_33 as v33

HASH = 4


def _not_cacheable(self: Any) -> bool:
    return False


# A sliding window that declares itself outside prefix caching, under the kind's own
# class name (the spec finds a group's rules by the name of its spec's class).
BoundedReplayWindow: Any = type(
    "SlidingWindowSpec", (SlidingWindowSpec,), {"prefix_cacheable": property(_not_cacheable)}
)


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    kcu.init_none_hash(sha256)


def layout() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    window = BoundedReplayWindow(
        block_size=2, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8
    )
    return KVCacheConfig(
        32, [], [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["swa"], window)]
    )


def request(rid: str) -> Request:
    return Request(rid, list(range(9)), block_hasher=v33.get_request_block_hasher(HASH, sha256))


@pytest.mark.parametrize("side", ["kvcache", "spec"])
def test_a_group_outside_prefix_caching_caches_nothing(side: str) -> None:
    if side == "kvcache":
        manager: Any = v33.KVCacheManager(
            layout(), max_model_len=64, scheduler_block_size=4, hash_block_size=HASH
        )
    else:
        manager = spec.KVCacheManager(layout(), 64, 4, HASH, profile="0.33.0")
    first = request("a")
    assert manager.allocate_slots(first, 9) is not None  # caches the full group's 2 blocks
    full, window = getattr(manager, "coordinator", manager).single_type_managers
    assert full.num_cached_block.get("a", 0) == 2
    assert window.num_cached_block.get("a", 0) == 0
    manager.free(first)
    # A repeat hits the full group's blocks; the window, holding no keys, adds none.
    hit_tokens = manager.get_computed_blocks(request("b"))[1]
    assert hit_tokens == 8
