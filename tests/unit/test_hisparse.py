"""vLLM 0.33.0's HiSparse kinds in kvcache's 0.33 profile (switch ``hisparse_groups``):
the pool's unpin / reuse watchers / shared event queue, the three managers' rules
(driven here by a recording stand-in for vLLM's ``HiSparseCoordinator``, which lives
outside the core), the retained-hit trim, and the 0.25.1 refusal.

vLLM 0.33.0's own HiSparse tests (``make upstream-0.33``) drive the same managers
with vLLM's real coordinator; these pin the rules one by one against numbers worked
out from 0.33.0's source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    sha256,
)
from kvcache.block_pool import BlockPool
from kvcache.hisparse import HiSparseHotManager, HiSparseResidentManager, HiSparseSourceManager
from kvcache.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec
from kvcache.kv_events import BlockStored
from kvcache.single_type_kv_cache_manager import FullAttentionManager

BS = 4


@dataclass
class RoleGroupSpec(KVCacheGroupSpec):
    """A group with vLLM 0.33.0's ``role`` field."""

    role: str = "default"


@dataclass
class StandIn:
    """Records the calls the managers make to their HiSparse coordinator."""

    resident_managers: tuple[Any, ...] = ()
    gpu_pool: Any = None
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, *args, *kwargs.values()))


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")


def layout(num_blocks: int = 16) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[
            RoleGroupSpec(["source"], full(), role="hisparse_source"),
            RoleGroupSpec(["indexer"], full(), role="hisparse_indexer"),
            KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS, page_size=64)),
            KVCacheGroupSpec(
                ["hot"], HiSparseHotSpec(block_size=BS, page_size=64, blocks_per_request=2)
            ),
        ],
    )


def manager(release: str = "0.33.0", caching: bool = True, **kwargs: Any) -> KVCacheManager:
    return KVCacheManager(
        layout(), max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
        enable_caching=caching, profile=release, **kwargs,
    )  # fmt: skip


def bound(m: KVCacheManager, host_blocks: int = 8) -> StandIn:
    """Bind a stand-in coordinator and a host pool, as vLLM's coordinator does."""
    source, _, resident, hot = m.coordinator.single_type_managers
    stand_in = StandIn(resident_managers=(resident,), gpu_pool=m.block_pool)
    for group in (source, resident, hot):
        group.coordinator = stand_in  # type: ignore[attr-defined]
    assert isinstance(source, HiSparseSourceManager)
    source.bind_host_pool(host_blocks)
    return stand_in


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), block_hasher=kcu.get_request_block_hasher(BS, sha256))


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    kcu.init_none_hash(sha256)


# ---------------------------------------------------------------- the pool


def test_unpinned_blocks_count_as_free_and_tell_their_watcher_once_reused() -> None:
    pool = BlockPool(5, True, BS)
    a, b, c, _ = pool.get_new_blocks(4)
    seen: list[int] = []
    pool.touch([b])  # b is held twice: unpinning drops one reference only
    pool.unpin_blocks([a, b], lambda blk: seen.append(blk.block_id))
    assert (a.ref_cnt, b.ref_cnt) == (0, 1) and pool.get_num_free_blocks() == 1
    pool.free_blocks([c])  # an unhashed free block goes in front of the unpinned one
    assert pool.get_new_blocks(1) == [c] and seen == []
    assert pool.get_new_blocks(1) == [a] and seen == [a.block_id]
    pool.free_blocks([a])
    assert pool.get_new_blocks(1) == [a] and seen == [a.block_id]  # told once
    with pytest.raises(ValueError, match="null block or not held"):
        pool.unpin_blocks([pool.null_block], seen.append)
    pool.check_invariants()


def test_reset_prefix_cache_tells_the_watchers_of_unpinned_blocks() -> None:
    pool = BlockPool(3, True, BS)
    a, b = pool.get_new_blocks(2)
    seen: list[int] = []
    pool.unpin_blocks([a], lambda blk: seen.append(blk.block_id))
    assert not pool.reset_prefix_cache() and seen == []  # b is still held
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() and seen == [a.block_id]


def test_a_host_pool_queues_into_the_device_queue_and_frees_through_it() -> None:
    m = manager(enable_kv_cache_events=True)
    stand_in = bound(m)
    source = m.coordinator.single_type_managers[0]
    host = source.block_pool
    assert host is not m.block_pool and host.medium == "CPU" and host.num_gpu_blocks == 8
    r = request("r", 3 * BS)
    assert m.allocate_slots(r, 3 * BS) is not None
    assert [b.ref_cnt for b in source.req_to_blocks["r"]] == [1, 1, 1]
    assert stand_in.calls[-1][:3] == ("publish_when_ready", r, 3 * BS)  # caching deferred
    source.publish_blocks(r, 3 * BS)  # the coordinator, once the host copies are durable
    events = m.take_events()  # the indexer group's (device) and the source's (host)
    assert all(isinstance(e, BlockStored) for e in events)
    assert {e.group_idx: e.medium for e in events} == {1: "GPU", 0: "CPU"}
    r2 = request("r2", 2 * BS)
    assert m.allocate_slots(r2, 2 * BS, delay_cache_blocks=True) is not None
    source.publish_blocks(r2, 2 * BS)
    events = m.take_events()  # the queue object stays shared after a drain
    assert [(e.group_idx, e.medium) for e in events] == [(0, "CPU")]
    assert source.block_pool.take_events() == [] and m.take_events() == []
    m.free(r2)
    host_blocks = list(source.req_to_blocks["r"])
    popped = m.pop_blocks_for_free(r)
    m.block_pool.free_blocks(popped[::-1])  # host blocks go back to the host pool
    assert all(b.ref_cnt == 0 for b in host_blocks) and host.get_num_free_blocks() == 7
    with pytest.raises(ValueError, match="not a block of this pool"):
        m.block_pool.free_blocks([BlockPool(4, True, BS).get_new_blocks(1)[0]])
    host.check_invariants()
    m.block_pool.check_invariants()


# ---------------------------------------------------------------- the managers


def test_the_registry_chooses_the_hisparse_managers() -> None:
    m = manager()
    kinds = [type(g) for g in m.coordinator.single_type_managers]
    assert kinds == [
        HiSparseSourceManager, FullAttentionManager, HiSparseResidentManager, HiSparseHotManager
    ]  # fmt: skip
    assert m.retained_hit_group_ids == (0,)
    resident = m.coordinator.single_type_managers[2]
    assert isinstance(resident, HiSparseResidentManager)
    assert resident.max_admission_blocks_per_request == 64 // BS  # min(in flight, model len)


def test_resident_admission_counts_pages_past_the_host_prefix_and_the_import_tail() -> None:
    m = manager()
    bound(m)
    resident = m.coordinator.single_type_managers[2]
    assert isinstance(resident, HiSparseResidentManager)
    # No import: pages for 10 tokens (3) past a 5-token host prefix (2 pages).
    assert resident.get_num_blocks_to_allocate("a", 10, (), 5, 5, 10, False) == 1
    assert resident.get_num_blocks_to_allocate("a", 64, (), 0, 0, 64, True) == 16
    # An import of 8 external tokens after 4 local: pages 0-2 host-only, page 2 needs a
    # writable block, and one more page for tokens up to 16.
    assert resident.get_num_blocks_to_allocate("a", 16, (), 12, 4, 16, False) == 1 + 1
    resident.allocate_external_computed_blocks("a", 4, 8)
    row = resident.get_residency_row("a")
    assert [b.is_null for b in row] == [True, True, False]
    assert resident.get_num_blocks_to_allocate("a", 16, (), 12, 4, 16, False) == 1  # tail held
    with pytest.raises(ValueError, match="takes no hits"):
        resident.get_num_blocks_to_allocate("a", 16, [row[2]], 12, 4, 16, False)


def test_resident_pages_overlay_the_append_only_table() -> None:
    m = manager(caching=False)
    stand_in = bound(m)
    resident = m.coordinator.single_type_managers[2]
    assert isinstance(resident, HiSparseResidentManager)
    resident.add_local_computed_blocks("r", (), 2 * BS, 0)  # a 2-page host prefix
    assert stand_in.calls[-1] == ("commit_computed_blocks", "r", 2)
    new = resident.allocate_new_blocks("r", 4 * BS, 4 * BS)
    assert len(new) == 2 and resident.get_resident_page("r", 0) is None
    copy = m.block_pool.get_new_blocks(1)[0]
    assert resident.adopt_resident_page("r", 0, copy)
    assert not resident.adopt_resident_page("r", 0, copy)  # resident already
    assert not resident.adopt_resident_page("r", 9, copy)  # past the table
    assert resident.drop_resident_page("r", 2) is new[0]
    assert resident.drop_resident_page("r", 1) is None  # host-only
    assert resident.get_residency_row("r") == [copy, m.block_pool.null_block,
                                               m.block_pool.null_block, new[1]]
    assert resident.get_residency_row("r", 3) == [new[1]]
    assert resident.req_to_blocks["r"][2] is new[0]  # the table itself is unchanged
    popped = resident.pop_blocks_for_free("r")
    assert stand_in.calls[-1] == ("free", "r")
    assert popped == [copy, m.block_pool.null_block, m.block_pool.null_block, new[1]]
    assert "r" not in resident.residency_changes and "r" not in resident.req_to_blocks


def test_the_hot_region_is_taken_only_to_read_host_history() -> None:
    m = manager(caching=False)
    stand_in = bound(m)
    hot = m.coordinator.single_type_managers[3]
    assert isinstance(hot, HiSparseHotManager)
    assert hot.get_num_blocks_to_allocate("cold", 8, (), 0, 0, 8, False) == 0
    assert hot.get_num_blocks_to_allocate("imp", 8, (), 8, 4, 8, False) == 2  # an import
    assert hot.get_num_blocks_to_allocate("hit", 8, (), 4, 4, 8, False) == 2  # host prefix
    assert hot.allocate_new_blocks("cold", 8, 8) == [] and hot.num_cached_block["cold"] == 0
    # Running now: a local count no longer asks for the region, require_hot does.
    assert hot.get_num_blocks_to_allocate("cold", 8, (), 4, 4, 8, False) == 0
    hot.require_hot("cold")
    assert hot.get_num_blocks_to_allocate("cold", 12, (), 4, 4, 12, False) == 2
    assert len(hot.allocate_new_blocks("cold", 12, 12)) == 2 and hot.has_hot("cold")
    assert hot.allocate_new_blocks("cold", 64, 64) == []  # a fixed region
    hot.add_local_computed_blocks("hit", (), 4, 0)
    assert "hit" in hot.hot_required
    stand_in.resident_managers = ()
    hot.add_local_computed_blocks("alone", (), 0, 0)  # no resident group: always hot
    assert "alone" in hot.hot_required
    hot.free("cold")
    assert "cold" not in hot.hot_required and m.block_pool.get_num_free_blocks() == 15


def test_the_source_admits_by_host_capacity_and_announces_imports() -> None:
    m = manager()
    stand_in = bound(m, host_blocks=4)  # 3 usable host blocks
    source = m.coordinator.single_type_managers[0]
    assert isinstance(source, HiSparseSourceManager)
    assert source.get_num_blocks_to_allocate("a", 3 * BS, (), 0, 0, 3 * BS) == 0
    assert source.get_num_blocks_to_allocate("a", 4 * BS, (), 0, 0, 4 * BS) == 16 + 1
    source.allocate_external_computed_blocks("a", 0, 2 * BS)
    assert stand_in.calls[-1] == ("record_pending_host_import", "a", 2 * BS)
    assert len(source.req_to_blocks["a"]) == 2 and source.take_new_block_ids() == []
    assert source.take_pending_cow_copies() == [] and source.take_host_cow_copies() == []


def test_the_source_counts_a_partial_hit_copy_against_the_host_pool() -> None:
    m = manager()
    bound(m, host_blocks=3)  # 2 usable host blocks
    source = m.coordinator.single_type_managers[0]
    assert isinstance(source, HiSparseSourceManager)
    hit = source.block_pool.get_new_blocks(1)[0]  # held: touching it costs nothing
    # vLLM 0.33.0's order: total, then local computed tokens, then main-model tokens.
    assert source.get_num_blocks_to_allocate("w", 2 * BS, [hit], 2 * BS, BS, 2 * BS) == 0
    # A hit ending inside its block needs a copy: 2 blocks for 1 free host block.
    assert source.get_num_blocks_to_allocate("w", 2 * BS, [hit], 2 * BS, BS - 1, 2 * BS) == 17


def test_the_source_keeps_its_longer_hit_until_allocate_slots_cuts_it() -> None:
    m = manager()
    bound(m)
    source, indexer = m.coordinator.single_type_managers[:2]
    first = request("first", 3 * BS)
    assert m.allocate_slots(first, 3 * BS) is not None
    assert isinstance(source, HiSparseSourceManager)
    source.publish_blocks(first, 3 * BS)
    indexer.block_pool.evict_blocks({indexer.req_to_blocks["first"][2].block_id})
    second = request("second", 3 * BS + 1)
    blocks, hits = m.get_computed_blocks(second)
    assert hits == 2 * BS  # the device (indexer) group lost the third block
    assert [len(g) for g in blocks.blocks] == [3, 2, 0, 0]  # the host hit is kept whole
    assert m.allocate_slots(second, BS + 1, hits, blocks) is not None
    assert source.req_to_blocks["second"][:2] == source.req_to_blocks["first"][:2]
    assert source.req_to_blocks["second"][2] is not source.req_to_blocks["first"][2]


def test_the_managers_need_a_coordinator() -> None:
    m = manager(caching=False)
    resident = m.coordinator.single_type_managers[2]
    with pytest.raises(RuntimeError, match="no HiSparse coordinator bound"):
        resident.add_local_computed_blocks("r", (), 0, 0)


def test_0_25_1_refuses_hisparse_layouts() -> None:
    with pytest.raises(NotImplementedError, match=r"role .hisparse_source. \(group 0\) is not"):
        manager("0.25.1")
    no_role = KVCacheConfig(num_blocks=8, kv_cache_groups=layout().kv_cache_groups[2:])
    for profile in ("0.25.1", None):  # None: the default release
        with pytest.raises(NotImplementedError, match=r"HiSparseResidentSpec \(group 0\) is not"):
            KVCacheManager(no_role, max_model_len=16, scheduler_block_size=BS,
                           hash_block_size=BS, profile=profile)


def test_a_new_request_without_hits_adopts_its_empty_hits() -> None:
    """vLLM 0.33.0 cuts the retained hits into a new tuple even for the shared empty
    lookup result, so a new request always adopts: without resident groups its hot
    region is required then and allocated with its first slots; a resident group
    commits its 0 host pages. (kvcache kept the empty instance and skipped both.)"""
    for caching in (True, False):
        no_resident = KVCacheConfig(num_blocks=16, kv_cache_groups=[
            *layout().kv_cache_groups[:2], layout().kv_cache_groups[3]])  # fmt: skip
        m = KVCacheManager(no_resident, max_model_len=64, scheduler_block_size=BS,
                           hash_block_size=BS, enable_caching=caching, profile="0.33.0")
        source, _, hot = m.coordinator.single_type_managers
        stand_in = StandIn(resident_managers=(), gpu_pool=m.block_pool)
        source.coordinator = hot.coordinator = stand_in  # type: ignore[attr-defined]
        assert isinstance(source, HiSparseSourceManager) and isinstance(hot, HiSparseHotManager)
        source.bind_host_pool(8)
        r = request("r", 2 * BS)
        hits, num_hits = m.get_computed_blocks(r)
        assert num_hits == 0 and hits is m.empty_kv_cache_blocks
        new = m.allocate_slots(r, 2 * BS, num_hits, hits)
        assert new is not None and [len(g) for g in new.blocks] == [2, 2, 2]
        assert hot.has_hot("r")
        # Running requests pass no hits: nothing more is adopted.
        assert m.allocate_slots(r, 1) is not None and len(hot.req_to_blocks["r"]) == 2
    m = manager()
    stand_in = bound(m)
    r = request("r", 2 * BS)
    hits, num_hits = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 2 * BS, num_hits, hits) is not None
    assert ("commit_computed_blocks", "r", 0) in stand_in.calls
