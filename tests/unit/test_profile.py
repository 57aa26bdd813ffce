"""Release profiles (kvcache/profile.py, spec/profile.py) and the 0.33.0 drop-in module.

What these tests hold without vLLM 0.33.0 installed: the switch table (names,
values, ledger entries), the spec's copy of it, the families ``make
conformance-0.33`` runs and does not run yet, and each switch's effect at its
point of difference, against the 0.25.1 default. Conformance with the real vLLM
0.33.0 is ``make conformance-0.33`` (kvcache/kit/conformance33.py).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
import spec
import spec.profile as spec_profile
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    get_request_block_hasher,
    sha256,
    xxhash,
)
from kvcache import vllm_0_33 as v33
from kvcache.kit.conformance33 import NOT_IN_0_33, conformant_families
from kvcache.kit.driver import FAMILIES
from kvcache.kit.ledger import load_ledger
from kvcache.profile import RELEASES, SWITCHES, Profile, resolve_profile

BS = 4


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    """Every test here hashes with sha256 from the process's seed (other tests, e.g. the
    kit's sequences, leave NONE_HASH at their last hash function)."""
    kcu.init_none_hash(sha256)


def full_config(num_blocks: int = 12, groups: int = 1) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [], [
        KVCacheGroupSpec([f"layer.{i}"], FullAttentionSpec(
            block_size=BS, num_kv_heads=i + 1, head_size=8, dtype="float16"))
        for i in range(groups)
    ])


def swa_config(num_blocks: int = 12) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(
        ["layer.0"], SlidingWindowSpec(
            block_size=BS, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=BS))])


def manager(config: KVCacheConfig, release: str, **kwargs: Any) -> Any:
    if release == "0.33.0":
        return v33.KVCacheManager(config, max_model_len=64, scheduler_block_size=BS,
                                  hash_block_size=BS, **kwargs)
    return KVCacheManager(config, max_model_len=64, scheduler_block_size=BS,
                          hash_block_size=BS, **kwargs)


def request(rid: str, tokens: list[int], release: str = "0.25.1", **kwargs: Any) -> Request:
    hasher = (v33.get_request_block_hasher(BS, sha256) if release == "0.33.0"
              else get_request_block_hasher(BS, sha256))
    return Request(rid, tokens, block_hasher=hasher, **kwargs)


def admit(m: Any, r: Request) -> None:
    """Look the waiting request up and allocate its whole prompt, as a scheduler does."""
    found = m.get_computed_blocks(r)
    hits, n = found[0], found[1]
    assert m.allocate_slots(r, r.num_tokens - n, n, hits) is not None
    if len(found) == 3:
        m.record_prefix_cache_stats(r, n)
    r.num_computed_tokens = r.num_tokens
    r.status = RequestStatus.RUNNING


# ---------------------------------------------------------------- the switch table


def test_default_profile_is_0_25_1_with_every_switch_off() -> None:
    assert resolve_profile(None) == Profile("0.25.1") == Profile()
    assert not any(Profile("0.25.1").switches().values())
    assert all(Profile("0.33.0").switches().values())
    assert KVCacheManager(full_config(), 64, BS, BS).profile == Profile("0.25.1")


def test_unknown_release_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"release='0\.30\.0'"):
        Profile("0.30.0")
    with pytest.raises(ValueError, match="release='9'"):
        KVCacheManager(full_config(), 64, BS, BS, profile="9")
    with pytest.raises(ValueError, match="profile=3"):
        resolve_profile(3)  # type: ignore[arg-type]


def test_every_switch_names_a_ledger_entry_or_none() -> None:
    ids = {entry.id for entry in load_ledger()}
    assert len({s.name for s in SWITCHES}) == len(SWITCHES)
    for switch in SWITCHES:
        assert switch.ledger_id == "" or switch.ledger_id in ids, switch
        assert switch.since in RELEASES and switch.what
        assert hasattr(Profile(), switch.name)


def test_spec_owns_an_equal_copy_of_the_switches() -> None:
    assert tuple(s.name for s in SWITCHES) == spec_profile.SWITCHES
    for release in RELEASES:
        assert spec_profile.Profile(release).switches() == Profile(release).switches()
    assert set(spec_profile.SWITCHES) >= spec_profile.MODELLED
    assert spec_profile.resolve_profile(Profile("0.33.0")).release == "0.33.0"


def test_conformance_families_not_in_0_33_are_listed_not_dropped() -> None:
    run = {f.name for f in conformant_families()}
    assert run | set(NOT_IN_0_33) == set(FAMILIES)
    assert not run & set(NOT_IN_0_33)
    # Only the layouts whose spec class 0.33.0 removed are left out.
    assert set(NOT_IN_0_33) == {
        "tq",  # vLLM 0.33.0 has no TQFullAttentionSpec (ledger tq-spec-removed)
    }
    assert {f.name for f in conformant_families("spec-0.33")} == run


# ---------------------------------------------------------------- the drop-in constructor


def test_drop_in_constructor_takes_0_33_names() -> None:
    m = manager(full_config(), "0.33.0", max_in_flight_tokens=16, num_hash_lookahead_tokens=0,
                num_prefill_lookahead=0, enable_mamba_shared_prefix_checkpoint=True)
    assert m.profile == Profile("0.33.0")
    with pytest.raises(TypeError):
        manager(full_config(), "0.33.0", max_num_batched_tokens=16)


@pytest.mark.parametrize("name", ["num_hash_lookahead_tokens", "num_prefill_lookahead"])
def test_drop_in_validates_lookahead_counts(name: str) -> None:
    assert getattr(manager(full_config(), "0.33.0", **{name: 2}), name) == 2
    for bad in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match=name):
            manager(full_config(), "0.33.0", **{name: bad})


# ---------------------------------------------------------------- switches at work


def test_lookup_returns_a_boundary_and_stats_wait_for_admission() -> None:
    m = manager(full_config(), "0.33.0", log_stats=True)
    first = request("a", list(range(9)), "0.33.0")
    admit(m, first)
    second = request("b", list(range(9)), "0.33.0")
    blocks, n, boundary = m.get_computed_blocks(second)
    assert (n, boundary) == (8, 0) and len(blocks.get_block_ids()[0]) == 2
    assert m.get_computed_blocks(second, max_cache_hit_length=5)[1] == 4
    with pytest.raises(ValueError, match="max_cache_hit_length"):
        m.get_computed_blocks(second, max_cache_hit_length=-1)
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.hits, stats.hits_by_source) == (1, 0, {})  # only "a"
    m.record_prefix_cache_stats(second, 8)
    assert m.make_prefix_cache_stats().hits == 8
    old = manager(full_config(), "0.25.1", log_stats=True)
    old.get_computed_blocks(request("c", list(range(9))))
    assert old.make_prefix_cache_stats().requests == 1  # 0.25.1 counts at the lookup


def test_get_block_ids_selects_groups() -> None:
    m = manager(full_config(groups=2), "0.33.0")
    r = request("a", list(range(6)), "0.33.0")
    blocks = m.allocate_slots(r, 6)
    both = blocks.get_block_ids()
    assert blocks.get_block_ids(group_ids=[1]) == (both[1],)
    assert blocks.get_block_ids(group_ids=[1, 0]) == (both[1], both[0])
    assert m.empty_kv_cache_blocks.get_block_ids(True, group_ids=[0]) is None
    with pytest.raises(ValueError, match="group_ids: 2"):
        blocks.get_block_ids(group_ids=[2])


@pytest.mark.parametrize("release", RELEASES)
def test_pop_blocks_for_free_drops_the_null_head_in_0_33(release: str) -> None:
    m = manager(swa_config(), release)
    r = request("a", list(range(13)), release)
    m.allocate_slots(r, 13)
    r.num_computed_tokens = 13
    m.remove_skipped_blocks("a", 13)
    held = m.get_block_ids("a")[0]
    assert held[0] == 0  # a skipped block became the null block
    popped = [b.block_id for b in m.pop_blocks_for_free(r)]
    assert popped == ([b for b in held if b != 0] if release == "0.33.0" else held)


@pytest.mark.parametrize("release", RELEASES)
def test_cascade_count_is_zero_in_0_33(release: str) -> None:
    m = manager(full_config(), release)
    admit(m, request("a", list(range(9)), release))
    expected = [0] if release == "0.33.0" else [3]
    assert m.get_num_common_prefix_blocks("a") == expected


@pytest.mark.parametrize("release", RELEASES)
def test_adopting_hits_without_new_tokens(release: str) -> None:
    m = manager(full_config(), release)
    admit(m, request("a", list(range(9)), release))
    r = request("b", list(range(9)), release)
    found = m.get_computed_blocks(r)
    if release == "0.33.0":
        assert m.allocate_slots(r, 0, found[1], found[0]) is not None
    else:
        with pytest.raises(ValueError, match="num_new_tokens"):
            m.allocate_slots(r, 0, found[1], found[0])


@pytest.mark.parametrize("release", RELEASES)
def test_new_block_ids_only_where_zeroing_is_needed(release: str) -> None:
    m = manager(full_config(), release)
    m.allocate_slots(request("a", list(range(6)), release), 6)
    assert (m.take_new_block_ids() == []) == (release == "0.33.0")


def test_events_and_skip_zeroing_argument_of_0_33() -> None:
    m = manager(full_config(), "0.33.0", enable_kv_cache_events=True)
    r = request("a", list(range(9)), "0.33.0")
    assert m.allocate_slots(r, 9, skip_zeroing_group_ids=(0,)) is not None
    (stored,) = m.take_events()
    assert type(stored) is v33.BlockStored
    assert (stored.locality, stored.ownership, stored.session_id,
            stored.lookahead_token_ids) == (None, None, None, None)
    assert len(stored.block_hashes) == 2
    with pytest.raises(ValueError, match="skip_zeroing_group_ids: 3"):
        m.allocate_slots(r, 1, skip_zeroing_group_ids=(3,))


def test_spec_models_the_manager_level_switches() -> None:
    config = swa_config()
    sm = spec.KVCacheManager(config, 64, BS, BS, profile="0.33.0", log_stats=True)
    km = manager(config, "0.33.0", log_stats=True)
    for m, release in ((sm, "0.33.0"), (km, "0.33.0")):
        r = request("a", list(range(13)), release)
        m.allocate_slots(r, 13)
        r.num_computed_tokens = 13
        m.remove_skipped_blocks("a", 13)
        assert m.get_num_common_prefix_blocks("a") == [0]
    assert sm.abstract_state() == km.abstract_state()
    ids = [b.block_id for b in km.pop_blocks_for_free(km._owners["a"])]
    assert sm.pop_blocks_for_free(request("a", list(range(13)))) == ids


# ---------------------------------------------------------------- hashing


def tagged_key_request(release: str) -> Request:
    return request(
        "a", list(range(8)), release,
        lora_request=LoRARequest("lora-a", 1, lora_path="/adapters/a"),
        cache_salt="salt",
        mm_features=[MultiModalFeatureSpec(identifier="img", modality="image", data=None,
                                           mm_position=PlaceholderRange(offset=1, length=2))],
    )


def test_tagged_extra_keys_enter_the_hash() -> None:
    new, old = tagged_key_request("0.33.0"), tagged_key_request("0.25.1")
    keys = (("lora", "lora-a", "/adapters/a"), ("mm", "img", 1), ("cache_salt", "salt"))
    assert new.block_hashes[0] == kcu.hash_block_tokens(sha256, None, [0, 1, 2, 3], keys)
    assert old.block_hashes[0] == kcu.hash_block_tokens(
        sha256, None, [0, 1, 2, 3], ("lora-a", ("img", 1), "salt"))
    assert new.block_hashes[1] == kcu.hash_block_tokens(
        sha256, new.block_hashes[0], [4, 5, 6, 7], (("lora", "lora-a", "/adapters/a"),))
    plain_new, plain_old = request("p", list(range(8)), "0.33.0"), request("p", list(range(8)))
    assert plain_new.block_hashes == plain_old.block_hashes  # plain blocks hash alike


def test_output_tokens_completing_a_block_keep_its_earlier_images() -> None:
    features = [MultiModalFeatureSpec(identifier=name, modality="image", data=None,
                                      mm_position=PlaceholderRange(offset=offset, length=1))
                for name, offset in (("img-1", 4), ("img-2", 5))]
    hashes = {}
    for release in RELEASES:
        r = request("a", list(range(6)), release, mm_features=features)
        r.append_output_token_ids([6, 7])  # completes block 1, which holds both images
        hashes[release] = r.block_hashes[1]
    parent = request("p", list(range(4))).block_hashes[0]
    assert hashes["0.33.0"] == kcu.hash_block_tokens(
        sha256, parent, [4, 5, 6, 7], (("mm", "img-1", 0), ("mm", "img-2", 1)))
    assert hashes["0.25.1"] == kcu.hash_block_tokens(
        sha256, parent, [4, 5, 6, 7], (("img-2", 1),))  # 0.25.1 loses img-1


@pytest.fixture
def no_hash_seed() -> Iterator[None]:
    seed = os.environ.pop("PYTHONHASHSEED", None)
    try:
        yield
    finally:
        if seed is not None:
            os.environ["PYTHONHASHSEED"] = seed
        kcu.init_none_hash(sha256)


def test_none_hash_fixed_seed_without_pythonhashseed(no_hash_seed: None) -> None:
    v33.init_none_hash(sha256)
    assert hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest() == kcu.NONE_HASH
    v33.init_none_hash(xxhash)
    first = kcu.NONE_HASH
    v33.init_none_hash(xxhash)
    assert first != kcu.NONE_HASH  # non-cryptographic: a random seed each time


def test_docs_table_names_every_switch() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "profiles.md").read_text()
    for switch in SWITCHES:
        assert f"`{switch.name}`" in text, switch.name
        if switch.ledger_id:
            assert f"| `{switch.ledger_id}` | `{switch.name}`" in text, switch


def test_drop_in_helpers_of_0_33() -> None:
    m = manager(full_config(), "0.33.0")
    first = request("a", list(range(13)), "0.33.0")
    admit(m, first)
    assert m.estimate_cached_tokens(first) == 12  # three full blocks cached
    second = request("b", list(range(13)), "0.33.0")
    blocks, n, boundary, diverged = m.get_computed_blocks_for_connector(second)
    assert (n, boundary, diverged) == (12, 0, False)
    cut = m.truncate_computed_blocks(blocks, 4)
    assert cut.get_block_ids() == (blocks.get_block_ids()[0][:1],)
    assert blocks.get_block_ids()[0] == m.get_block_ids("a")[0][:3]  # not changed
    with pytest.raises(ValueError, match="not a multiple"):
        m.truncate_computed_blocks(blocks, 6)
    with pytest.raises(ValueError, match="past group 0's hit"):
        m.truncate_computed_blocks(blocks, 16)
    m.record_blocks_for_zeroing("a", 0)  # no group zeroes without Mamba
    assert m.take_new_block_ids() == []
    assert m.take_kv_cache_block_copies() == ([], [])
    assert m.take_boundary_state_offloads() == {}
    assert m.finalize_partial_tail_offloads(first) == []
    assert m.mamba_shared_prefix_checkpoint is False


# ---------------------------------------------------------------- retention under 0.33.0


@pytest.mark.parametrize("side", ["kvcache", "spec"])
def test_zero_retention_without_a_window_is_accepted_only_under_0_33(side: str) -> None:
    """``retention_zero_without_window``: with only full attention, 0.33.0 accepts an
    interval of 0 (it thins nothing) and refuses a positive one; 0.25.1 refuses both."""

    def build(release: str, interval: int) -> Any:
        if side == "spec":
            return spec.KVCacheManager(full_config(), 64, BS, BS, profile=release,
                                       prefix_cache_retention_interval=interval)
        if release == "0.33.0":
            config = full_config()
            config.prefix_cache_retention_interval = interval
            return manager(config, release)
        return manager(full_config(), release, prefix_cache_retention_interval=interval)

    assert build("0.33.0", 0).coordinator.retention_interval == 0
    with pytest.raises(ValueError, match="sliding-window or Mamba"):
        build("0.33.0", BS)
    for interval in (0, BS):
        with pytest.raises(ValueError, match="sliding-window or Mamba"):
            build("0.25.1", interval)


def test_replay_boundaries_under_each_release() -> None:
    """0.25.1 keeps one position (one token short of the prompt); 0.33.0 with an EAGLE
    group keeps one scheduler block below a resend's and a longer sibling's hit."""
    old, new = manager(full_config(), "0.25.1", use_eagle=True), manager(
        full_config(), "0.33.0", use_eagle=True)
    assert old.coordinator.replay_boundaries(12) == (11,)
    assert new.coordinator.replay_boundaries(12) == (4, 8)  # block-aligned: both
    assert new.coordinator.replay_boundaries(13) == (8,)
    assert new.coordinator.replay_boundaries(3) == (0,)
    assert manager(full_config(), "0.33.0").coordinator.replay_boundaries(12) == (11,)
