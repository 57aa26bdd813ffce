"""Unit tests of kvcache's documented behaviour, one fact per test."""

from __future__ import annotations

import hashlib
import pickle

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache import (
    AllBlocksCleared,
    BlockHashListWithBlockSize,
    BlockRemoved,
    BlockStored,
    FreeKVCacheBlockQueue,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
    get_hash_fn_by_name,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)

BS = 4


def make_manager(num_blocks: int = 10, **kwargs: object) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                          **kwargs)  # type: ignore[arg-type]


def make_request(rid: str, tokens: list[int], **kwargs: object) -> Request:
    return Request(rid, tokens, block_hasher=get_request_block_hasher(BS, sha256),
                   **kwargs)  # type: ignore[arg-type]


def admit(m: KVCacheManager, r: Request) -> list[int]:
    """Schedule a waiting request's whole prompt, as the scheduler does."""
    hits, n = m.get_computed_blocks(r)
    out = m.allocate_slots(r, r.num_tokens - n, n, hits)
    assert out is not None
    r.num_computed_tokens = r.num_tokens
    r.status = RequestStatus.RUNNING
    return m.get_block_ids(r.request_id)[0]


def test_fresh_ids_ascend_from_one_and_null_block_is_not_counted() -> None:
    m = make_manager(10)
    assert m.block_pool.get_num_free_blocks() == 9
    assert admit(m, make_request("a", list(range(9)))) == [1, 2, 3]
    assert m.block_pool.null_block.block_id == 0 and m.block_pool.null_block.is_null


def test_hash_is_sha256_of_pickle_protocol_5() -> None:
    init_none_hash(sha256)
    r = make_request("a", [7, 8, 9, 10, 11])
    expected = hashlib.sha256(pickle.dumps((kcu.NONE_HASH, (7, 8, 9, 10), None), protocol=5))
    assert r.block_hashes == [expected.digest()]


def test_extra_keys_lora_then_mm_then_salt_on_first_block_only() -> None:
    mm = [MultiModalFeatureSpec("img", PlaceholderRange(offset=2, length=3))]
    r = make_request("a", list(range(8)), lora_request=LoRARequest("ad", 1), mm_features=mm,
                     cache_salt="s")
    keys0, _ = kcu.generate_block_hash_extra_keys(r, 0, 4, 0)
    keys1, _ = kcu.generate_block_hash_extra_keys(r, 4, 8, 0)
    assert keys0 == ("ad", ("img", 2), "s")
    assert keys1 == ("ad", ("img", -2))


def test_isolation_keys_change_the_hash() -> None:
    tokens = list(range(8))
    base = make_request("a", tokens).block_hashes
    assert make_request("b", tokens).block_hashes == base
    assert make_request("c", tokens, cache_salt="x").block_hashes[0] != base[0]
    assert make_request("d", tokens, lora_request=LoRARequest("l", 1)).block_hashes[1] != base[1]


def test_get_hash_fn_by_name_rejects_unknown_name() -> None:
    assert get_hash_fn_by_name("sha256") is sha256
    with pytest.raises(ValueError, match="md5"):
        get_hash_fn_by_name("md5")


def test_hit_is_capped_below_num_tokens() -> None:
    m = make_manager()
    admit(m, make_request("a", list(range(8))))
    # The same 8 tokens: a full hit would leave nothing to compute, so only 1 block hits.
    hits, n = m.get_computed_blocks(make_request("b", list(range(8))))
    assert n == 4 and hits.get_block_ids() == ([1],)


def test_free_releases_tail_first_unhashed_to_front_hashed_to_back() -> None:
    m = make_manager(10)
    r = make_request("a", list(range(10)))  # blocks 1, 2 full (cached), 3 partial
    admit(m, r)
    m.free(r)
    free_ids = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids == [3, 4, 5, 6, 7, 8, 9, 2, 1]


def test_watermark_applies_only_to_waiting_and_preempted_with_scheduled_requests() -> None:
    m = make_manager(10, watermark=0.5)  # 5 blocks of headroom
    r = make_request("a", list(range(17)))  # needs 5 of 9 free; 5 + 5 > 9
    assert m.allocate_slots(r, 17) is None
    assert m.allocate_slots(r, 17, has_scheduled_reqs=False) is not None
    m.free(r)
    r.status = RequestStatus.PREEMPTED
    assert m.allocate_slots(r, 17) is None
    r.status = RequestStatus.RUNNING
    assert m.allocate_slots(r, 17) is not None


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    m = make_manager(enable_kv_cache_events=True)
    r = make_request("a", list(range(9)))
    admit(m, r)
    assert m.reset_prefix_cache() is False
    m.free(r)
    m.take_events()
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]
    assert m.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_events_store_then_remove_on_reuse() -> None:
    m = make_manager(4, enable_kv_cache_events=True)  # 3 usable blocks
    r = make_request("a", list(range(9)))
    admit(m, r)
    (stored,) = m.take_events()
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 2
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))
    assert stored.kv_cache_spec_kind == "full_attention" and stored.group_idx == 0
    m.free(r)
    admit(m, make_request("b", [50 + i for i in range(12)]))
    events = m.take_events()
    assert [type(e) for e in events[:2]] == [BlockRemoved, BlockRemoved]


def test_distinct_empty_blocks_register_the_request_like_vllm() -> None:
    m = make_manager()
    r = make_request("a", list(range(6)))
    m.allocate_slots(r, 6, 0, m.empty_kv_cache_blocks.new_empty())
    assert m.coordinator.single_type_managers[0].num_cached_block["a"] == 1
    r2 = make_request("b", list(range(6)))
    m.allocate_slots(r2, 2)  # identity-empty: not registered before caching...
    assert "b" not in m.coordinator.single_type_managers[0].num_cached_block


def test_common_prefix_unknown_id_creates_an_entry_like_vllm() -> None:
    m = make_manager()
    admit(m, make_request("a", list(range(9))))
    assert m.get_num_common_prefix_blocks("a") == [3]
    assert m.get_num_common_prefix_blocks("ghost") == [0]
    assert m.get_num_common_prefix_blocks("a") == [0]  # two "requests" now


def test_allocate_slots_rejects_zero_tokens() -> None:
    m = make_manager()
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(make_request("a", [1, 2]), 0)


def test_evict_blocks_rejects_out_of_range_ids_without_change() -> None:
    m = make_manager(10)
    admit(m, make_request("a", list(range(9))))
    before = m.abstract_state()
    with pytest.raises(ValueError, match="block_ids"):
        m.evict_blocks({1, 10})
    with pytest.raises(ValueError, match="block_ids"):
        m.evict_blocks({-1})
    assert m.abstract_state() == before


def test_metrics_collector_reaches_the_block_pool() -> None:
    from kvcache.kv_cache_metrics import KVCacheMetricsCollector

    collector = KVCacheMetricsCollector(sample_rate=1.0)
    m = make_manager(metrics_collector=collector)
    assert m.metrics_collector is collector and m.block_pool.metrics_collector is collector
    r = make_request("r", list(range(2 * BS + 1)))
    m.allocate_slots(r, 2 * BS + 1)
    assert sorted(collector.block_metrics) == m.get_block_ids("r")[0]


def test_free_queue_order_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    q.remove(blocks[4])
    q.prepend_n([blocks[1], blocks[2]])
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 2, 3, 5, 0]
    with pytest.raises(RuntimeError):
        q.remove(blocks[4])
    with pytest.raises(ValueError):
        q.popleft_n(6)


def test_hash_list_view_rescales_to_larger_blocks() -> None:
    fine = [bytes([i]) for i in range(7)]
    view = BlockHashListWithBlockSize(fine, 2, 6)  # type: ignore[arg-type]
    assert len(view) == 2 and list(view) == [fine[2], fine[5]] and view[-1] == fine[5]
    assert view[0:2] == [fine[2], fine[5]]
