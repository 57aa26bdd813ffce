"""Release profiles (kvcache/profile.py, spec/profile.py) and the 0.33.0 drop-in module.

What these tests hold without vLLM 0.33.0 installed: the switch table (names,
values, ledger entries), the spec's copy of it, the families ``make
conformance-0.33`` runs and does not run yet, and each switch's effect at its
point of difference, against the 0.25.1 default. Conformance with the real vLLM
0.33.0 is ``make conformance-0.33`` (kvcache/kit/conformance.py --release 0.33.0).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import tomllib
from collections.abc import Iterator
from pathlib import Path
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
    MambaSpec,
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
from kvcache.kit.conformance import TARGETS, conformant_families
from kvcache.kit.driver import FAMILIES
from kvcache.kit.ledger import load_ledger
from kvcache.profile import (
    GAPS,
    RELEASES,
    SWITCHES,
    TABLE_PATH,
    Profile,
    in_range,
    load_table,
    release_key,
    resolve_profile,
)

NOT_IN_0_33 = TARGETS["0.33.0"].not_in
BS = 4
EDGES = ("0.25.1", "0.33.0")
"""The releases with a drop-in (0.25.1's kvcache, 0.33.0's kvcache.vllm_0_33) whose
behaviour at each point of difference the tests below pin."""
ROOT = Path(__file__).resolve().parents[2]


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


def test_a_profile_is_frozen_and_every_layer_reads_the_one_given() -> None:
    """One channel: a layer gets the profile when built and nobody can change it after,
    so the manager, its coordinator, its block pool and every single-type manager see
    the same switch values for their whole life (pickling keeps them too)."""
    profile = Profile("0.29.0").with_switches(pop_drops_null_head=True)
    with pytest.raises(AttributeError, match="Profile is frozen: pop_drops_null_head=False"):
        profile.pop_drops_null_head = False  # type: ignore[misc]
    with pytest.raises(AttributeError, match="Profile is frozen: release"):
        del profile.release
    assert profile.pop_drops_null_head and pickle.loads(pickle.dumps(profile)) == profile
    manager = KVCacheManager(full_config(), 64, BS, BS, profile=profile)
    layers = [manager, manager.coordinator, manager.block_pool,
              *manager.coordinator.single_type_managers]
    assert all(layer.profile is profile for layer in layers)


def test_unknown_release_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"release='0\.30\.1': kvcache has profiles for "
                       r"0\.25\.1, 0\.26\.0, .*0\.29\.0, .*0\.33\.0"):
        Profile("0.30.1")
    with pytest.raises(ValueError, match=r"release='0\.30\.1': the spec has profiles for 0\.25"):
        spec_profile.Profile("0.30.1")
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


def test_kvcache_and_the_spec_read_the_one_table() -> None:
    assert TABLE_PATH == spec_profile.TABLE_PATH == ROOT / "spec" / "releases.toml"
    raw = tomllib.loads(TABLE_PATH.read_text(encoding="utf-8"))
    names = tuple(row["name"] for row in raw["switch"])
    assert tuple(s.name for s in SWITCHES) == spec_profile.SWITCHES == names
    assert RELEASES == spec_profile.RELEASES == tuple(raw["releases"])
    # kvcache's typed attributes are the table's switches, no more, no fewer.
    assert set(Profile.__annotations__) - {"release"} == set(names)
    # The spec keeps no hand copy: no switch name is spelled in its profile module.
    source = (ROOT / "spec" / "profile.py").read_text(encoding="utf-8")
    assert not [name for name in names if name in source]
    for release in RELEASES:
        expected = {row["name"] for row in raw["switch"]
                    if release_key(row["since"]) <= release_key(release)}
        on = {name for name, value in Profile(release).switches().items() if value}
        assert on == expected, release
        assert spec_profile.Profile(release).switches() == Profile(release).switches()
    assert set(spec_profile.SWITCHES) == set(spec_profile.Profile().rules.__dataclass_fields__)
    assert spec_profile.resolve_profile(Profile("0.29.0")).release == "0.29.0"


def test_every_release_between_turns_on_more_switches() -> None:
    counts = [sum(Profile(r).switches().values()) for r in RELEASES]
    assert RELEASES[0] == "0.25.1" and RELEASES[-1] == "0.33.0" and len(RELEASES) == 10
    assert counts[0] == 0 and counts[-1] == len(SWITCHES)
    assert counts == sorted(counts) and 0 < counts[5] < len(SWITCHES)  # 0.29.0: some


def bisect_rows() -> dict[str, dict[str, str]]:
    """docs/bisect.md's table (written by ``python -m kvcache bisect``): per ledger
    entry, each release's cell ('x' shows, '.' exercised and absent, '' not)."""
    lines = (ROOT / "docs" / "bisect.md").read_text(encoding="utf-8").splitlines()
    header = next(line for line in lines if line.startswith("| entry |"))
    releases = [c.strip() for c in header.strip("|").split("|")][3:]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        marks = {"**x**": "x", "·": ".", "": ""}
        rows[cells[0]] = {r: marks[c] for r, c in zip(releases, cells[3:], strict=True)}
    return rows


def test_measured_first_releases_are_the_bisects() -> None:
    rows = bisect_rows()
    ledger = {entry.id: entry for entry in load_ledger()}
    measured = [s for s in SWITCHES if s.measured_by == "bisect"]
    assert measured and all(s.ledger_id and s.measured for s in measured)
    by_conformance = [s for s in SWITCHES if s.measured_by == "conformance"]
    assert all(s.measured and s.note for s in by_conformance)  # how, in the data
    for switch in measured:
        cells = rows[switch.ledger_id]
        shows = [r for r in RELEASES if cells[r] == "x"]
        assert shows and shows[0] == switch.since, switch
        before = [r for r in RELEASES if release_key(r) < release_key(switch.since)]
        absent = [r for r in before if cells[r] == "."]
        # The earliest it may have come: after the last release seen without it.
        last_without = absent[-1] if absent else RELEASES[0]
        assert switch.earliest == RELEASES[RELEASES.index(last_without) + 1], switch
        assert ledger[switch.ledger_id].releases.startswith(f">={switch.since}"), switch
    for switch in SWITCHES:
        if not switch.measured:  # said so in the data, not a silent guess
            assert switch.since == "0.33.0" and switch.note, switch


def test_each_release_lists_what_its_profile_does_not_reproduce() -> None:
    ledger = {entry.id: entry for entry in load_ledger()}
    for gap in GAPS:
        held = [r for r in RELEASES if in_range(r, gap.releases)]
        assert held and gap.what, gap
        if gap.ledger_id:
            assert all(in_range(r, ledger[gap.ledger_id].releases) for r in held), gap
    ids = {r: {g.ledger_id for g in Profile(r).not_reproduced()} for r in RELEASES}
    assert ids["0.25.1"] == set()
    assert "free-order-without-caching" in ids["0.27.0"] & ids["0.27.1"]
    assert "free-order-without-caching" not in ids["0.26.0"] | ids["0.28.0"]
    assert "align-mamba-hybrid-caches-every-full-block" in ids["0.26.0"] & ids["0.27.1"]
    assert "eagle-hybrid-allocation-refused" in ids["0.32.0"]
    assert "eagle-hybrid-allocation-refused" not in ids["0.31.0"] | ids["0.33.0"]
    assert not Profile("0.25.1").unmeasured() and not Profile("0.33.0").unmeasured()
    middle = set(Profile("0.29.0").unmeasured())
    assert {s.name for s in SWITCHES if not s.measured} <= middle
    # measured on vLLM 0.26.0 in session 21 (unmeasured on 0.26.0-0.27.1 before)
    assert "full_report_mode" not in set(Profile("0.26.0").unmeasured())
    assert "full_report_mode" not in set(Profile("0.27.0").unmeasured())


def test_a_broken_table_is_refused_by_name(tmp_path: Path) -> None:
    text = TABLE_PATH.read_text(encoding="utf-8")
    bad = tmp_path / "releases.toml"
    bad.write_text(text.replace('since = "0.29.0"', 'since = "0.29.5"', 1), encoding="utf-8")
    with pytest.raises(ValueError, match=r"since='0\.29\.5' is none of"):
        load_table(bad)
    bad.write_text(text.replace('"0.26.0", "0.27.0"', '"0.27.0", "0.26.0"', 1), encoding="utf-8")
    with pytest.raises(ValueError, match="not strictly ascending"):
        load_table(bad)
    with pytest.raises(ValueError, match=r"releases='>0\.26\.0'"):
        in_range("0.29.0", ">0.26.0")


def test_every_profile_builds_and_agrees_with_the_spec() -> None:
    """Each release's switch set works together: the same calls on kvcache's and the
    spec's managers under every profile leave the same state."""
    for release in RELEASES:
        for config in (full_config(groups=2), swa_config()):
            km = KVCacheManager(config, 64, BS, BS, profile=release)
            sm = spec.KVCacheManager(config, 64, BS, BS, profile=release)
            for m in (km, sm):
                for rid in ("a", "b"):
                    r = request(rid, list(range(13)))
                    found = m.get_computed_blocks(r)
                    assert m.allocate_slots(r, 13 - found[1], found[1], found[0]) is not None
                    r.num_computed_tokens = 13
                    m.remove_skipped_blocks(rid, 13)
            assert km.abstract_state() == sm.abstract_state(), release


@pytest.mark.parametrize("release", ["0.28.0", "0.29.0"])
def test_cache_mask_alignment_follows_hits_from_0_29(release: str) -> None:
    """cache_mask_hit_alignment: beside an 'align' Mamba group with fine-grained hits
    (hash block 4, scheduler block 8), a sliding-window group under sparse retention
    keeps the window block before the replay boundary (22) at the hash block from
    0.29.0 (tokens 16-19), at the scheduler block before (tokens 8-15 only). The
    calls of the profile check's swa+mamba-retention #4 on vLLM 0.28.0; kvcache and
    the spec agree under both profiles."""
    config = KVCacheConfig(30, [], [
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=2)),
        KVCacheGroupSpec(["mamba"], MambaSpec(
            block_size=8, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
            num_speculative_blocks=1))])
    tokens = [1, 2, 2, 1, 1, 1, 0, 1, 2, 1, 2, 0, 2, 1, 0, 2, 2, 0, 2, 1, 0, 0, 1]
    states = []
    for m in (KVCacheManager(config, 64, 8, 4, profile=release,
                             prefix_cache_retention_interval=16),
              spec.KVCacheManager(config, 64, 8, 4, profile=release,
                                  prefix_cache_retention_interval=16)):
        r = Request("r", tokens, block_hasher=get_request_block_hasher(4, sha256))
        assert m.allocate_slots(r, 16, num_lookahead_tokens=2) is not None
        r.num_computed_tokens = 16
        m.new_step_starts()
        assert m.allocate_slots(r, 4, num_lookahead_tokens=2) is not None
        state = m.abstract_state()
        swa_table = state["req_to_blocks"][0]["r"]
        states.append((state, swa_table[4] in state["block_hash"]))
    (kv_state, kv_keyed), (spec_state, spec_keyed) = states
    assert kv_state == spec_state
    assert kv_keyed == spec_keyed == (release == "0.29.0")


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
def test_an_eagle_junction_keeps_the_tail_a_block_lower_from_0_33(release: str) -> None:
    """junction_eagle_tail: an EAGLE sliding-window group (window 1, blocks of 4) under
    sparse retention (12) keeps the tail before a request's shared-prefix boundary (8)
    and, from 0.33.0, the one a block lower (block 1, tokens 4-7): a sibling diverging
    right after the junction has no block past it to drop. kvcache and the spec
    agree under both profiles."""
    config = KVCacheConfig(30, [], [
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=1)),
        KVCacheGroupSpec(["mamba"], MambaSpec(
            block_size=4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align"))])
    states = []
    for m in (KVCacheManager(config, 64, 4, 4, use_eagle=True, profile=release,
                             prefix_cache_retention_interval=12),
              spec.KVCacheManager(config, 64, 4, 4, use_eagle=True, profile=release,
                                  prefix_cache_retention_interval=12)):
        r = Request("r", list(range(15)), block_hasher=get_request_block_hasher(4, sha256))
        r.shared_prefix_boundary = 8  # as the scheduler keeps a sibling's lookup
        assert m.allocate_slots(r, 12) is not None
        states.append(m.abstract_state())
    kv_state, spec_state = states
    assert kv_state == spec_state
    swa_table = kv_state["req_to_blocks"][0]["r"]
    assert (swa_table[1] in kv_state["block_hash"]) == (release == "0.33.0")


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


@pytest.mark.parametrize("release", EDGES)
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


@pytest.mark.parametrize("release", EDGES)
def test_cascade_count_is_zero_in_0_33(release: str) -> None:
    m = manager(full_config(), release)
    admit(m, request("a", list(range(9)), release))
    expected = [0] if release == "0.33.0" else [3]
    assert m.get_num_common_prefix_blocks("a") == expected


@pytest.mark.parametrize("release", EDGES)
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


@pytest.mark.parametrize("release", EDGES)
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
    for release in EDGES:
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


def test_docs_switch_table_is_the_generated_one() -> None:
    # scripts/ is no package: load the generator by its path.
    loader_spec = importlib.util.spec_from_file_location(
        "gen_profiles_table", ROOT / "scripts" / "gen_profiles_table.py")
    assert loader_spec is not None and loader_spec.loader is not None
    gen = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(gen)
    BEGIN, END, render = gen.BEGIN, gen.END, gen.render

    text = (ROOT / "docs" / "profiles.md").read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert text[text.index(BEGIN):text.index(END) + len(END)] == render()
    for switch in SWITCHES:
        assert f"`{switch.name}`" in render(), switch.name


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

    built = build("0.33.0", 0)
    assert getattr(built, "coordinator", built).retention_interval == 0
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
