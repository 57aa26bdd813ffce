"""The 0.33 drop-in's ``FullAttentionManager.find_longest_cache_hit``: 0.33.0's pair.

vLLM 0.33.0's finders return ``(hit blocks per group, hit length)``; kvcache's
managers keep 0.25.1's blocks-only value (its coordinator reads the length), and
the drop-in's class answers direct callers with the pair by delegating to
kvcache's two finders (sub-block at the hash-block alignment, whole-block else).
"""

from __future__ import annotations

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache import FullAttentionSpec, Request, get_request_block_hasher, sha256
from kvcache import vllm_0_33 as v33
from kvcache.block_pool import BlockPool
from kvcache.single_type_kv_cache_manager import FullAttentionManager

HBS, BS = 2, 4


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    kcu.init_none_hash(sha256)


def cached_pool(num_full_blocks: int) -> tuple[BlockPool, Request, list[kcu.KVCacheBlock]]:
    """A pool holding the first ``num_full_blocks`` blocks of an 8-token request."""
    pool = BlockPool(10, True, hash_block_size=HBS)
    req = Request("r", [0, 0, 1, 1, 2, 2, 3, 3], block_hasher=get_request_block_hasher(HBS, sha256))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, num_full_blocks, BS, 0)
    return pool, req, blocks


def find(pool: BlockPool, req: Request, alignment: int, eagle: bool) -> tuple[object, int]:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float16")
    hits, length = v33.FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 8, [0], pool, spec, eagle, alignment
    )
    return [[b.block_id for b in group] for group in hits], length


def test_sub_block_alignment_is_the_fine_grained_finder() -> None:
    pool, req, blocks = cached_pool(2)
    ids = [b.block_id for b in blocks]
    assert find(pool, req, HBS, eagle=False) == ([ids], 8)
    # EAGLE drops one hash block, not a whole block: the last block stays a hit.
    assert find(pool, req, HBS, eagle=True) == ([ids], 6)


def test_block_alignment_is_the_whole_block_finder_with_its_length() -> None:
    pool, req, blocks = cached_pool(1)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float16")
    hashes = kcu.resolve_block_hashes(req.block_hashes, HBS, BS)
    base = FullAttentionManager.find_longest_cache_hit(hashes, 8, [0], pool, spec, False, BS)
    assert [b.block_id for b in base[0]] == [blocks[0].block_id]  # 0.25.1's value
    assert find(pool, req, BS, eagle=False) == ([[blocks[0].block_id]], 4)
    assert find(pool, req, BS, eagle=True) == ([[]], 0)


def test_context_parallel_sub_block_alignment_is_refused() -> None:
    pool, req, _ = cached_pool(2)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float16")
    with pytest.raises(NotImplementedError, match="dcp_world_size=2"):
        v33.FullAttentionManager.find_longest_cache_hit(
            req.block_hashes, 8, [0], pool, spec, False, HBS, dcp_world_size=2
        )
