"""The spec's HiSparse rules that the differential test (``tests/unit/
test_hisparse_vs_spec.py``) does not reach: the pool's unpin and reuse watchers one
by one, refusals (0.25.1, no coordinator bound, a mixed-pool ``pop_blocks_for_free``,
bad region and window sizes, a resident group's calls out of turn)."""

from __future__ import annotations

import pytest
from unit.test_hisparse_vs_spec import RoleGroupSpec, full, layout, spec_side

import spec
from kvcache import KVCacheConfig, KVCacheGroupSpec
from kvcache.kv_cache_interface import HiSparseHotSpec
from spec.block_pool import BlockPool
from spec.single_type_kv_cache_manager import HISPARSE_RESIDENT, SingleTypeKVCacheManager

BS = 4


def test_unpinned_blocks_are_free_last_and_their_watcher_is_told_once() -> None:
    pool = BlockPool(5, True, BS)
    a, b, c, _ = pool.get_new_blocks(4)
    seen: list[int] = []
    pool.touch([b])  # held twice: unpinning drops one reference only
    pool.unpin_blocks([a, b], seen.append)
    assert (pool.ref_cnt[a], pool.ref_cnt[b], pool.get_num_free_blocks()) == (0, 1, 1)
    pool.free_blocks([c])  # an unhashed free block goes in front of the unpinned one
    assert pool.get_new_blocks(1) == [c] and seen == []
    assert pool.get_new_blocks(1) == [a] and seen == [a]
    pool.free_blocks([a])
    assert pool.get_new_blocks(1) == [a] and seen == [a]  # told once
    with pytest.raises(ValueError, match="null block or not held"):
        pool.unpin_blocks([0], seen.append)
    pool.check_invariants()


def test_a_reset_tells_the_watchers_and_a_shared_queue_stays_shared() -> None:
    pool, host = BlockPool(3, True, BS, True), BlockPool(3, True, BS, True, medium="CPU")
    host.share_event_queue(pool)
    a, b = pool.get_new_blocks(2)
    seen: list[int] = []
    pool.unpin_blocks([a], seen.append)
    assert not pool.reset_prefix_cache() and seen == []  # b is still held
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() and seen == [a]
    assert host.reset_prefix_cache()
    assert len(pool.take_events()) == 2 and host.take_events() == []
    assert host.kv_event_queue is pool.kv_event_queue


def test_refusals() -> None:
    config = layout("resident", 16)
    with pytest.raises(NotImplementedError, match=r"role 'hisparse_source' \(group 0\)"):
        spec.KVCacheManager(config, 64, BS, BS, profile="0.25.1")
    unbound = spec.KVCacheManager(config, 64, BS, BS, profile="0.33.0")
    with pytest.raises(RuntimeError, match="no HiSparse coordinator bound"):
        unbound.single_type_managers[2].add_local_computed_blocks("r", [], 0, 0)
    side = spec_side(config, True, 8)
    with pytest.raises(NotImplementedError, match="its own pool"):
        side.km.pop_blocks_for_free(object())
    assert side.km.effectiveness_lookup(object()) is None  # the resume rows skip HiSparse
    resident = side.km.single_type_managers[2]
    resident.adopt_resident_page("r", 0, 1)  # no table: nothing to adopt
    with pytest.raises(ValueError, match="an import needs tokens"):
        resident.allocate_external_computed_blocks("r", 4, 0)
    side.coord.source.add_local_computed_blocks("r", [], 0, 0)
    resident.add_local_computed_blocks("r", [], 4, 0)
    with pytest.raises(ValueError, match="'r' already holds pages"):
        resident.add_local_computed_blocks("r", [], 4, 0)


def test_a_hot_region_of_no_blocks_is_refused() -> None:
    hot = HiSparseHotSpec(block_size=BS, page_size=64, blocks_per_request=0)
    config = KVCacheConfig(num_blocks=16, kv_cache_groups=[
        RoleGroupSpec(["source"], full(), role="hisparse_source"),
        KVCacheGroupSpec(["hot"], hot)])
    with pytest.raises(ValueError, match="blocks_per_request=0 must be a positive int"):
        spec.KVCacheManager(config, 64, BS, BS, profile="0.33.0")


def test_a_resident_group_needs_its_admission_window() -> None:
    config = layout("resident", 16)
    with pytest.raises(ValueError, match="max_admission_blocks_per_request=None"):
        SingleTypeKVCacheManager(config.kv_cache_groups[2].kv_cache_spec,
                                 BlockPool(16, True, BS), True, 2, BS, None,
                                 rules=HISPARSE_RESIDENT)
