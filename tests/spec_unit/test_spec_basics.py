"""Quick checks of spec/ on hand-written scenarios (block_size 4, tiny pools)."""

from __future__ import annotations

import pytest

from kvcache.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvcache.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash, sha256
from kvcache.request import Request, RequestStatus
from spec import KVCacheBlocks, KVCacheManager
from spec.vocab import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 8, **kwargs: object) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, 64, BLOCK_SIZE, BLOCK_SIZE, **kwargs)  # type: ignore[arg-type]


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def schedule(manager: KVCacheManager, request: Request) -> tuple[int, ...] | None:
    """Prefill the whole prompt in one step; return the request's block ids."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    manager.check_invariants()
    return None if new_blocks is None else tuple(manager.get_block_ids(request.request_id)[0])


def test_fresh_ids_ascend_from_1() -> None:
    manager = make_manager()
    assert manager.abstract_state()["free_queue"] == [1, 2, 3, 4, 5, 6, 7]
    assert schedule(manager, make_request("a", list(range(10)))) == (1, 2, 3)
    assert schedule(manager, make_request("b", [99] * 5)) == (4, 5)
    assert manager.take_new_block_ids() == [1, 2, 3, 4, 5]


def test_prefix_hit_after_free() -> None:
    manager = make_manager()
    a = make_request("a", list(range(10)))
    assert schedule(manager, a) == (1, 2, 3)
    manager.free(a)
    # Freed tail first: the partial block 3 (unhashed) to the front, then 2, 1 at the back.
    assert manager.abstract_state()["free_queue"] == [3, 4, 5, 6, 7, 2, 1]
    b = make_request("b", [*range(8), 50, 51, 52])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert (hits.get_block_ids(), num_hit_tokens) == (([1, 2],), 8)
    assert schedule(manager, b) == (1, 2, 3)
    manager.check_invariants()


def test_hit_capped_at_num_tokens_minus_one() -> None:
    manager = make_manager()
    a = make_request("a", list(range(8)))
    schedule(manager, a)
    manager.free(a)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert (hits.get_block_ids(), num_hit_tokens) == (([1],), 4)  # block 2 would cover all 8


def test_unhashed_blocks_freed_to_front() -> None:
    manager = make_manager(enable_caching=False)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    assert schedule(manager, a) == (1, 2, 3)
    assert schedule(manager, b) == (4, 5, 6)
    manager.free(a)
    assert manager.abstract_state()["free_queue"] == [3, 2, 1, 7]
    assert manager.abstract_state()["block_hash"] == {}


def test_watermark_applies_to_waiting_requests_only() -> None:
    manager = make_manager(num_blocks=8, watermark=0.25)  # 2 blocks of headroom
    assert manager.watermark_blocks == 2
    request = make_request("a", list(range(24)))  # needs 6 of the 7 free blocks
    assert manager.allocate_slots(request, 24) is None
    assert manager.allocate_slots(request, 24, has_scheduled_reqs=False) is not None
    manager.free(request)
    request.status = RequestStatus.RUNNING
    assert manager.allocate_slots(request, 24) is not None
    manager.check_invariants()


def test_reset_prefix_cache_refused_while_in_use() -> None:
    manager = make_manager(enable_kv_cache_events=True)
    a = make_request("a", list(range(8)))
    schedule(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    state = manager.abstract_state()
    assert state["block_hash"] == {} and state["cached"] == {}
    assert isinstance(manager.take_events()[-1], AllBlocksCleared)


def test_events() -> None:
    manager = make_manager(num_blocks=4, enable_kv_cache_events=True)
    a = make_request("a", list(range(8)))
    schedule(manager, a)
    [stored] = manager.take_events()
    assert isinstance(stored, BlockStored)
    external = [maybe_convert_block_hash(h) for h in a.block_hashes]
    assert stored.block_hashes == external[:2] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.extra_keys == [None, None]
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")
    manager.free(a)
    schedule(manager, make_request("b", [7] * 12))  # reuses 3, then evicts 2 and 1
    removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[external[1]], [external[0]]]


def test_distinct_empty_blocks_run_allocate_new_computed_blocks() -> None:
    manager = make_manager()
    a = make_request("a", list(range(3)))
    manager.allocate_slots(a, 3)  # one partial block: nothing cached, not yet "running"
    assert manager.allocate_slots(a, 1, new_computed_blocks=manager.empty_kv_cache_blocks)
    with pytest.raises(ValueError, match="already holds"):
        manager.allocate_slots(a, 1, new_computed_blocks=KVCacheBlocks(([],)))


def test_allocate_slots_rejects_zero_tokens() -> None:
    with pytest.raises(ValueError, match="num_new_tokens"):
        make_manager().allocate_slots(make_request("a", [1, 2]), 0)


def test_block_lists_answer_as_kvcaches_do() -> None:
    """``KVCacheBlocks``' accessors, the spec's beside kvcache's after one request
    cached its full blocks in a hybrid layout: concatenation, the empty copy, and
    the ids not cached (null blocks counted as uncached by the one-group query)."""
    import kvcache as K

    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8,
                             dtype="float16")
    window = K.SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8,
                                 dtype="float16", sliding_window=4)
    config = KVCacheConfig(16, [], [KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["w"], window)])
    answers = []
    for manager_class, ids in ((K.KVCacheManager, lambda blocks: [b.block_id for b in blocks]),
                               (KVCacheManager, list)):
        manager = manager_class(config, 64, BLOCK_SIZE, BLOCK_SIZE)  # type: ignore[arg-type]
        request = make_request("a", list(range(14)))
        new = manager.allocate_slots(request, 14)
        assert new is not None
        request.num_computed_tokens = 14
        manager.remove_skipped_blocks("a", 14)
        blocks = manager.get_blocks("a")
        one = manager.create_kv_cache_blocks((blocks.blocks[1],))  # type: ignore[arg-type]
        answers.append((
            [ids(g) for g in (blocks + blocks).blocks],
            [list(g) for g in blocks.new_empty().blocks],
            blocks.get_unhashed_block_ids_all_groups(),
            one.get_unhashed_block_ids(),
        ))
    assert answers[0] == answers[1]
    tables, empty, unhashed, one_group = answers[1]
    # the window's first two blocks (5, 6) fell out of it; 4 and 8 hold the partial tail
    assert tables == [[1, 2, 3, 4, 1, 2, 3, 4], [0, 0, 7, 8, 0, 0, 7, 8]]
    assert empty == [[], []] and unhashed == [[4], [8]] and one_group == [0, 0, 8]


def test_a_lookup_with_caching_off_finds_nothing() -> None:
    """Called directly, the hit search of a manager without prefix caching finds no hit
    (its lookup table is empty), whatever ``max_cache_hit_length`` says."""
    manager = make_manager(enable_caching=False)
    assert manager.find_longest_cache_hit([b"x", b"y"], 8) == (([],), 0)
