"""``BlockHashToBlockMap._cache``: vLLM's private layout, which vLLM's own tests read and edit."""

from __future__ import annotations

import copy

from kvcache.block_pool import BlockHashToBlockMap
from kvcache.kv_cache_utils import BlockHash, KVCacheBlock, make_block_hash_with_group_id


def test_bare_block_then_dict_form_until_the_last_block_leaves() -> None:
    cache = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(BlockHash(b"h"), 1)
    other = make_block_hash_with_group_id(BlockHash(b"h"), 2)
    b0, b1, b2 = KVCacheBlock(0), KVCacheBlock(1), KVCacheBlock(2)
    cache.insert(key, b0)
    cache.insert(other, b2)
    assert cache._cache == {key: b0, other: b2}
    cache.insert(key, b1)
    assert cache._cache == {key: {0: b0, 1: b1}, other: b2}
    assert cache.pop(key, 0) is b0
    assert cache._cache[key] == {1: b1}  # stays a dict, as in vLLM
    assert cache.get_one_block(key) is b1
    assert cache.pop(key, 1) is b1
    assert cache._cache == {other: b2}
    assert len(cache._cache) == 1


def test_view_edits_reach_the_map_and_copy_is_a_snapshot() -> None:
    cache = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(BlockHash(b"k"), 0)
    b3, b4 = KVCacheBlock(3), KVCacheBlock(4)
    cache.insert(key, b3)
    cache.insert(key, b4)
    backup = copy.copy(cache._cache)
    del cache._cache[key]
    assert cache.get_one_block(key) is None and len(cache) == 0
    assert backup == {key: {3: b3, 4: b4}}
    cache._cache[key] = backup[key]
    assert cache.get_blocks(key) == [b3, b4]
    cache._cache[key] = b4
    assert cache.get_blocks(key) == [b4] and cache._cache[key] is b4
