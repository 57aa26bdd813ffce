"""vLLM 0.33.0's smaller API points on kvcache's 0.33 profile, each against 0.25.1's
behaviour and, where the spec models it, against the spec's 0.33 profile.

Covers the NONE_HASH seed helpers, the tagged ``generate_block_hash_extra_keys`` and
its event form, the null-head helpers, the stand-alone pool's lookahead
argument, the switches ``event_session_id``,
``full_report_mode`` and ``external_blocks_floor_zero``, zeroing by 0.33.0's
``needs_kv_cache_zeroing`` (``skip_zeroing_group_ids``, ``record_blocks_for_zeroing``),
and the drop-in's stand-alone ``BlockPool`` and single-type managers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
import spec
from kvcache import (
    BlockPool,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    SlidingWindowSpec,
    get_request_block_hasher,
    sha256,
    xxhash,
)
from kvcache import vllm_0_33 as v33
from kvcache.kv_cache_interface import needs_kv_cache_zeroing
from kvcache.single_type_kv_cache_manager import FullAttentionManager

BS = 4


@pytest.fixture(autouse=True)
def sha256_none_hash() -> Any:
    """Each test hashes from the process's seed with sha256, and leaves it so."""
    kcu.init_none_hash(sha256)
    yield
    kcu.init_none_hash(sha256)


def full_spec(dtype: str = "float16") -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=dtype)


def swa_spec(dtype: str = "float16") -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=dtype,
                             sliding_window=2 * BS)


def config(*specs: Any, num_blocks: int = 24) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [], [
        KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])


def pair(cfg: KVCacheConfig, **kwargs: Any) -> tuple[Any, Any]:
    """kvcache's drop-in manager and the spec's, both on the 0.33.0 profile."""
    impl = v33.KVCacheManager(cfg, max_model_len=64, scheduler_block_size=BS,
                              hash_block_size=BS, **kwargs)
    oracle = spec.KVCacheManager(cfg, 64, BS, BS, profile="0.33.0", **kwargs)
    return impl, oracle


def request(rid: str, tokens: list[int], **kwargs: Any) -> Request:
    return Request(rid, tokens, block_hasher=v33.get_request_block_hasher(BS, sha256),
                   **kwargs)


# ---------------------------------------------------------------- hashing helpers


def test_none_hash_seed_follows_the_hash_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert v33.resolve_none_hash_seed(sha256) == kcu.DEFAULT_NONE_HASH_SEED
    random_seeds = {v33.resolve_none_hash_seed(xxhash) for _ in range(3)}
    assert len(random_seeds) == 3 and kcu.DEFAULT_NONE_HASH_SEED not in random_seeds
    assert kcu.resolve_none_hash_seed(sha256) is None  # 0.25.1: random bytes, no seed
    v33.init_none_hash(sha256)
    assert v33.get_none_hash_seed() == kcu.DEFAULT_NONE_HASH_SEED
    assert sha256(kcu.DEFAULT_NONE_HASH_SEED) == kcu.NONE_HASH
    kcu.init_none_hash(sha256)
    assert kcu.none_hash_seed() is None
    assert v33.get_none_hash_seed() == kcu.DEFAULT_NONE_HASH_SEED  # nothing to report
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert v33.resolve_none_hash_seed(xxhash) == "7"
    v33.init_none_hash(xxhash)
    assert v33.get_none_hash_seed() == "7" and xxhash("7") == kcu.NONE_HASH


def mm_lora_salt_request() -> Request:
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier="img",
                                      mm_position=PlaceholderRange(offset=2, length=3))]
    return Request("r", list(range(10)), mm_features=features, cache_salt="salt",
                   lora_request=LoRARequest("ad", 1, "/ad"))


def test_helper_keys_are_tagged_and_events_untag_them() -> None:
    r = mm_lora_salt_request()
    untagged, nxt = kcu.generate_block_hash_extra_keys(r, 0, 5, 0)
    tagged, nxt33 = v33.generate_block_hash_extra_keys(r, 0, 5, 0)
    assert untagged == ("ad", ("img", 2), "salt") and nxt == nxt33 == 1
    assert tagged == (("lora", "ad", "/ad"), ("mm", "img", 2), ("cache_salt", "salt"))
    assert kcu.to_event_extra_keys([tagged, None]) == [untagged, None]
    assert kcu.to_event_extra_keys([]) is None and kcu.to_event_extra_keys(None) is None
    assert v33.generate_block_hash_extra_keys(r, 5, 9, 1) == (
        (("lora", "ad", "/ad"),), 1)  # past the item and the salt: the LoRA key only


def test_null_head_helpers() -> None:
    pool = BlockPool(8, True, BS)
    null, real = pool.null_block, pool.get_new_blocks(2)
    assert kcu.null_head_len([]) == 0 and kcu.null_head_len(real) == 0
    assert kcu.null_head_len([null, null, real[0], null, real[1]]) == 2
    table = [null, *real]
    assert kcu.trim_null_head(table) == real
    assert kcu.trim_null_head(real) is real  # no copy without a null head


def test_standalone_pool_takes_lookahead_tokens_as_0_33() -> None:
    for given, expected in ((False, 0), (True, 1), (2, 2)):  # a bool is an int, as in vLLM
        pool = v33.BlockPool(8, True, BS, num_hash_lookahead_tokens=given)
        assert pool.num_hash_lookahead_tokens == expected
    with pytest.raises(ValueError, match="num_hash_lookahead_tokens"):
        v33.BlockPool(8, True, BS, num_hash_lookahead_tokens=-1)


# ---------------------------------------------------------------- event switches


def stored(events: list[Any]) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored"]


def test_block_stored_carries_the_session_id() -> None:
    impl, oracle = pair(config(full_spec()), enable_kv_cache_events=True)
    r = request("a", list(range(9)))
    r.session_id = "s-1"  # type: ignore[attr-defined]  # 0.33.0's Request field
    for m in (impl, oracle):
        m.allocate_slots(r, 9)
    impl_events, oracle_events = stored(impl.take_events()), stored(oracle.take_events())
    assert [e.session_id for e in impl_events] == ["s-1"]
    assert [dataclasses.asdict(e) for e in impl_events] == [
        dataclasses.asdict(e) for e in oracle_events]
    old = KVCacheManager(config(full_spec()), 64, BS, BS, enable_kv_cache_events=True)
    old.allocate_slots(r, 9)
    assert not hasattr(stored(old.take_events())[0], "session_id")  # 0.25.1's class


def test_partial_entry_event_has_session_and_every_overlapping_item() -> None:
    pool = v33.BlockPool(4, True, BS, enable_kv_cache_events=True)
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=name,
                                      mm_position=PlaceholderRange(offset=o, length=n))
                for name, o, n in (("A", 6, 3), ("B", 10, 2))]
    r = Request("p", list(range(12)), block_hasher=v33.get_request_block_hasher(BS, sha256),
                mm_features=features)
    r.session_id = "s-2"  # type: ignore[attr-defined]
    pool.cache_partial_block(r, pool.get_new_blocks(1)[0], 12, 0, 2 * BS)
    (event,) = pool.take_events()
    assert event.session_id == "s-2"
    assert event.extra_keys == [(("A", -2), ("B", 2))]
    old = BlockPool(4, True, BS, enable_kv_cache_events=True)  # 0.25.1: the last item only
    old.cache_partial_block(r, old.get_new_blocks(1)[0], 12, 0, 2 * BS)
    assert old.take_events()[0].extra_keys == [(("B", 2),)]


@pytest.mark.parametrize("mode", ["full", "incremental"])
def test_full_report_mode_tells_of_hits(mode: str) -> None:
    impl, oracle = pair(config(full_spec(), swa_spec()), enable_kv_cache_events=True)
    first = request("a", list(range(13)))
    again = request("b", list(range(13)))
    again.kv_cache_report_mode = mode  # type: ignore[attr-defined]
    events = []
    for m in (impl, oracle):
        m.allocate_slots(first, 13)
        m.take_events()
        found = m.get_computed_blocks(again)
        assert found[1] == 12
        events.append(stored(m.take_events()))
    impl_events, oracle_events = events
    if mode == "incremental":
        assert impl_events == oracle_events == []
        return
    assert [(e.group_idx, len(e.block_hashes), e.parent_block_hash) for e in impl_events] == [
        (0, 3, None), (1, 3, None)]
    assert impl_events[0].block_hashes == [kcu.maybe_convert_block_hash(h)
                                           for h in again.block_hashes[:3]]
    assert [dataclasses.asdict(e) for e in impl_events] == [
        dataclasses.asdict(e) for e in oracle_events]
    assert impl.block_pool.get_num_free_blocks() == oracle.block_pool.get_num_free_blocks()


def test_emit_cached_block_events_checks_its_count() -> None:
    pool = BlockPool(8, True, BS, enable_kv_cache_events=True)
    r = Request("a", list(range(8)), block_hasher=get_request_block_hasher(BS, sha256))
    pool.emit_cached_block_events(r, 0, BS, 0)
    assert pool.take_events() == []
    with pytest.raises(ValueError, match="num_cached_blocks=3"):
        pool.emit_cached_block_events(r, 3, BS, 0)
    pool.emit_cached_block_events(r, 2, BS, 1)
    (event,) = pool.take_events()
    assert (event.group_idx, event.token_ids, len(event.block_hashes)) == (1, list(range(8)), 2)


# ---------------------------------------------------------------- allocation switches


def test_external_blocks_after_an_over_allocation() -> None:
    new = v33.FullAttentionManager(full_spec(), block_pool=BlockPool(10, False, BS),
                                   enable_caching=False, kv_cache_group_id=0,
                                   scheduler_block_size=BS)
    new.allocate_new_blocks("r", 3 * BS, 3 * BS)
    free = new.block_pool.get_num_free_blocks()
    new.allocate_external_computed_blocks("r", 0, BS)
    assert new.block_pool.get_num_free_blocks() == free and len(new.req_to_blocks["r"]) == 3
    old = FullAttentionManager(full_spec(), BlockPool(10, False, BS), False, 0, BS)
    old.allocate_new_blocks("r", 3 * BS, 3 * BS)
    with pytest.raises(ValueError, match="-2"):
        old.allocate_external_computed_blocks("r", 0, BS)
    oracle = spec.KVCacheManager(config(full_spec(), num_blocks=10), 64, BS, BS,
                                 enable_caching=False, profile="0.33.0")
    group = getattr(oracle, "coordinator", oracle).single_type_managers[0]
    group.allocate_new_blocks("r", 3 * BS, 3 * BS)
    group.allocate_external_computed_blocks("r", 0, BS)
    assert len(group.req_to_blocks["r"]) == 3


def test_zeroing_follows_the_config() -> None:
    assert not needs_kv_cache_zeroing(config(full_spec(), swa_spec()))
    mixed = config(full_spec("float16"), swa_spec("bfloat16"))
    assert needs_kv_cache_zeroing(mixed)
    impl, oracle = pair(mixed)
    r = request("a", list(range(9)))
    ids = [m.allocate_slots(r, 9).get_block_ids() for m in (impl, oracle)]
    assert ids[0] == ids[1]
    expected = [*ids[0][0], *ids[0][1]]
    assert impl.take_new_block_ids() == oracle.take_new_block_ids() == expected
    uniform, _ = pair(config(full_spec(), swa_spec()))
    uniform.allocate_slots(request("b", list(range(9))), 9)
    assert uniform.take_new_block_ids() == []  # nothing to zero: nothing recorded
    old = KVCacheManager(mixed, 64, BS, BS)
    old_ids = old.allocate_slots(request("c", list(range(9))), 9).get_block_ids()
    assert old.take_new_block_ids() == old_ids[0]  # 0.25.1: full attention only


@pytest.mark.parametrize("side", ["kvcache", "spec"])
def test_skip_zeroing_and_record_again(side: str) -> None:
    kvcache_side, spec_side = pair(config(full_spec("float16"), swa_spec("bfloat16")))
    impl = kvcache_side if side == "kvcache" else spec_side
    r = request("a", list(range(17)))
    assert impl.allocate_slots(r, 1, num_external_computed_tokens=16,
                               skip_zeroing_group_ids=(0,)) is not None
    full_ids, swa_ids = impl.get_block_ids("a")
    reported = impl.take_new_block_ids()
    assert not set(full_ids[:4]) & set(reported)  # the load writes group 0's blocks
    assert set(swa_ids) - {0} <= set(reported) and full_ids[4] in reported
    assert getattr(impl, "skip_zeroing_group_ids", ()) == ()  # for one call only
    impl.record_blocks_for_zeroing("a", 2 * BS)
    assert impl.take_new_block_ids() == [*full_ids[2:], *swa_ids[2:]]
    with pytest.raises(ValueError, match="start_token=3"):
        impl.record_blocks_for_zeroing("a", 3)
    with pytest.raises(ValueError, match="skip_zeroing_group_ids: 2"):
        impl.allocate_slots(request("b", list(range(5))), 5, skip_zeroing_group_ids=(2,))
    assert impl.get_block_ids("a") == (full_ids, swa_ids)  # the refusals changed nothing


# ---------------------------------------------------------------- stand-alone groups


def test_standalone_groups_take_0_33_arguments() -> None:
    pool = v33.BlockPool(32, True, 2)
    group = v33.SlidingWindowManager(swa_spec(), block_pool=pool, enable_caching=True,
                                     kv_cache_group_id=0, scheduler_block_size=BS,
                                     needs_kv_cache_zeroing=True)
    assert group.records_new_block_ids
    new = group.allocate_new_blocks("r", 8, 8)
    assert group.take_new_block_ids() == [b.block_id for b in new]
    quiet = v33.FullAttentionManager(full_spec(), block_pool=pool, enable_caching=True,
                                     kv_cache_group_id=1, scheduler_block_size=BS)
    assert not quiet.records_new_block_ids  # 0.33.0: nothing to zero unless asked
    hits = pool.get_new_blocks(1)
    assert group.get_num_blocks_to_allocate("x", 8, hits, BS, BS, 8) == 1  # hit held
    # Hashes at the pool's hash block size (2): viewed at the group's block size.
    hashes = [kcu.BlockHash(bytes([i])) for i in range(4)]
    for h, block in zip((hashes[1], hashes[3]), pool.get_new_blocks(2), strict=True):
        pool.cached_block_hash_to_block.insert(kcu.make_block_hash_with_group_id(h, 0), block)
    found, n = v33.SlidingWindowManager.find_longest_cache_hit(
        hashes, 8, [0], pool, swa_spec(), False, 2)
    assert n == 8 and len(found[0]) == 2
    # Full attention at the hash block's alignment: the fine-grained finder's pair
    # (tests/unit/test_drop_in_full_attention_finder.py); refused under dcp.
    found, n = v33.FullAttentionManager.find_longest_cache_hit(
        hashes, 8, [0], pool, full_spec(), False, 2)
    assert n == 8 and len(found[0]) == 2
    with pytest.raises(NotImplementedError, match="dcp_world_size=2"):
        v33.FullAttentionManager.find_longest_cache_hit(hashes, 8, [0], pool, full_spec(),
                                                        False, 2, dcp_world_size=2)
    with pytest.raises(ValueError, match="medium='NVMe'"):
        v33.BlockPool(4, True, BS, medium="NVMe")
    assert v33.BlockPool(4, True, BS, medium="CPU").medium == "CPU"
