"""The Mamba switches of the 0.33.0 profile, each at its point of difference.

Every test runs the same calls on kvcache and on the spec under both releases and
checks the one thing the switch changes (the real vLLM 0.33.0 check of the same
rules is ``make conformance-0.33``: families ``mamba``, ``full+mamba-all``,
``full+mamba-none``).
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
    MambaManager,
    MambaSpec,
    Request,
    SlidingWindowSpec,
    get_request_block_hasher,
    sha256,
)
from kvcache import vllm_0_33 as v33
from kvcache.kv_cache_manager import KVCacheManager
from spec.vocab import NULL_BLOCK

BS = 4
IMPLS = ("kvcache", "spec")
RELEASES = ("0.25.1", "0.33.0")


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    kcu.init_none_hash(sha256)


def mamba_spec(mode: str = "align", num_spec: int = 0) -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((1,),), dtypes=("float16",),
                     mamba_cache_mode=mode, num_speculative_blocks=num_spec)


def config(*specs: Any, num_blocks: int = 24) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [], [
        KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])


def build(impl: str, cfg: KVCacheConfig, release: str, **kwargs: Any) -> Any:
    if impl == "spec":
        return spec.KVCacheManager(cfg, 64, BS, BS, profile=release, **kwargs)
    if release == "0.33.0":
        return v33.KVCacheManager(cfg, max_model_len=64, scheduler_block_size=BS,
                                  hash_block_size=BS, **kwargs)
    return KVCacheManager(cfg, 64, BS, BS, **kwargs)


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), block_hasher=get_request_block_hasher(BS, sha256))


def mamba_table(m: Any, rid: str, group: int = -1) -> list[int]:
    """The request's Mamba block ids (0 is the null block), on either implementation."""
    blocks = getattr(m, "coordinator", m).single_type_managers[group].req_to_blocks[rid]
    return [b if isinstance(b, int) else b.block_id for b in blocks]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["all", "none"])
def test_mamba_align_only_refuses_caching_outside_align(impl: str, mode: str) -> None:
    cfg = config(mamba_spec(mode))
    build(impl, cfg, "0.25.1")  # 0.25.1 builds it
    with pytest.raises(AssertionError, match=f"mamba_cache_mode='{mode}'"):
        build(impl, cfg, "0.33.0")
    build(impl, cfg, "0.33.0", enable_caching=False)  # uncached: still built
    build(impl, config(mamba_spec("align")), "0.33.0")


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_frees_processed_states_retires_past_null_gaps(impl: str) -> None:
    # A table with live states behind null gaps: 0.25.1's removal scans right to
    # left from the last skipped position and stops at the first null (here at
    # once); 0.33.0 retires every live state before the latest.
    tables = {}
    for release in RELEASES:
        m = build(impl, config(mamba_spec("align")), release)
        group = getattr(m, "coordinator", m).single_type_managers[0]
        live = m.block_pool.get_new_blocks(3)
        null = m.block_pool.null_block if impl == "kvcache" else NULL_BLOCK
        group.req_to_blocks["a"] = [live[0], null, live[1], null, live[2]]
        group.remove_skipped_blocks("a", 17)  # skips 16 tokens: 4 blocks
        tables[release] = (mamba_table(m, "a", 0), m.block_pool.get_num_free_blocks())
    ids = [b if isinstance(b, int) else b.block_id for b in live]
    assert tables["0.25.1"][0] == [ids[0], 0, ids[1], 0, ids[2]]
    assert tables["0.33.0"][0] == [0, 0, 0, 0, ids[2]]
    assert tables["0.33.0"][1] == tables["0.25.1"][1] + 2


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_frees_processed_states_keeps_no_draft_margin(impl: str) -> None:
    # With speculative blocks 0.25.1 subtracts num_speculative_blocks from the token
    # count before freeing, so it frees one state later than 0.33.0.
    free = {}
    for release in RELEASES:
        m = build(impl, config(mamba_spec("none", num_spec=2)), release,
                  enable_caching=False)
        r = request("a", 40)
        assert m.allocate_slots(r, 9) is not None
        r.num_computed_tokens = 9
        m.remove_skipped_blocks("a", 9)
        free[release] = m.block_pool.get_num_free_blocks()
    assert free["0.33.0"] == free["0.25.1"] + 1


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_every_attention_group_beside_mamba(impl: str) -> None:
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16",
                            sliding_window=8)
    ids = {}
    for release in RELEASES:
        m = build(impl, config(swa, mamba_spec("align")), release, enable_caching=False)
        assert m.allocate_slots(request("a", 8), 8) is not None
        ids[release] = m.take_new_block_ids()
    assert ids["0.25.1"] == []  # 0.25.1: full-attention classes only
    assert len(ids["0.33.0"]) == 2  # 0.33.0: the sliding-window group's two blocks


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_no_eagle_margin_keeps_the_hit_within_full_attention(impl: str) -> None:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")
    hits = {}
    for release in RELEASES:
        m = build(impl, config(full, mamba_spec("align")), release, use_eagle=True)
        first = request("a", 13)
        for chunk in (4, 4, 4, 1):  # chunked prefill: Mamba caches a state per chunk
            assert m.allocate_slots(first, chunk) is not None
            first.num_computed_tokens += chunk
            m.new_step_starts()
        m.free(first)
        # A second request sharing 12 tokens: full attention (EAGLE) hits 8 tokens;
        # 0.25.1 lets the Mamba search peek a block further and accepts its 12.
        b = Request("b", [*range(12), 99], block_hasher=get_request_block_hasher(BS, sha256))
        hits[release] = m.get_computed_blocks(b)[1]
    assert hits == {"0.25.1": 12, "0.33.0": 8}  # docs/divergences.md #6, fixed in 0.33.0


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_caps_new_state_blocks_reports_the_shortfall(impl: str) -> None:
    # A new request (speculative blocks 2) whose hits leave 2 of its 4 blocks short:
    # 0.25.1 reports the whole cap (1 + 2), 0.33.0 the shortfall.
    counts = {}
    for release in RELEASES:
        m = build(impl, config(mamba_spec("align", num_spec=2)), release)
        group = getattr(m, "coordinator", m).single_type_managers[0]
        null = m.block_pool.null_block if impl == "kvcache" else NULL_BLOCK
        hits = [null, *m.block_pool.get_new_blocks(1)]
        counts[release] = group.get_num_blocks_to_allocate("x", 8, hits, 8, 8)
    assert counts == {"0.25.1": 3, "0.33.0": 2}


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_prompt_tail_state_keys_an_evicted_state_again(impl: str) -> None:
    # A 9-token prompt's last reusable boundary is 8 tokens; its state block, cached
    # by the first chunk, loses its key to evict_blocks. Caching up to 8 tokens again
    # keys it again under 0.33.0 (with a BlockStored event), not under 0.25.1.
    stored = {}
    for release in RELEASES:
        m = build(impl, config(mamba_spec("align")), release, enable_kv_cache_events=True)
        r = request("a", 9)
        assert m.allocate_slots(r, 8) is not None
        r.num_computed_tokens = 8
        state = mamba_table(m, "a", 0)[-1]
        m.take_events()
        m.evict_blocks({state})
        m.take_events()
        m.cache_blocks(r, 8)
        events = m.take_events()
        stored[release] = [type(e).__name__ for e in events]
    assert stored == {"0.25.1": [], "0.33.0": ["BlockStored"]}


def test_drop_in_mamba_manager_has_the_0_33_state_switches() -> None:
    # vLLM 0.33.0's tests build MambaManager directly: the drop-in's class carries the
    # switches a 0.33.0 KVCacheManager sets on the managers it builds, and takes
    # remove_skipped_blocks' count by 0.33.0's keyword.
    from kvcache.block_pool import BlockPool

    pool = BlockPool(8, True, hash_block_size=BS)
    direct = v33.MambaManager(mamba_spec("align"), pool, True, 0, BS)
    built = build("kvcache", config(mamba_spec("align")), "0.33.0").coordinator
    via_manager = built.single_type_managers[0]
    for name in ("mamba_frees_processed_states", "mamba_caps_new_state_blocks",
                 "mamba_prompt_tail_state"):
        assert getattr(direct, name) is getattr(via_manager, name) is True, name
    old, committed, running = pool.get_new_blocks(3)
    direct.req_to_blocks["r"] = [old, pool.null_block, committed, running]
    direct.remove_skipped_blocks("r", processed_computed_tokens=12)  # past the null gap
    assert direct.req_to_blocks["r"] == [pool.null_block, pool.null_block, committed, running]
    assert old.ref_cnt == 0 and committed.ref_cnt == running.ref_cnt == 1
    # 0.33.0's order: num_local_computed_tokens, then num_tokens_main_model. A new
    # 9-token request (speculative blocks 1) needs a state and a draft block; read in
    # the base class's order the sixth argument would be 0 main-model tokens (1 block).
    fresh = v33.MambaManager(mamba_spec("align", num_spec=1), pool, True, 0, BS)
    assert fresh.get_num_blocks_to_allocate("n", 9, [], 0, 0, 9) == 2
    assert fresh.get_num_blocks_to_allocate("n", 9, [], 0, 0, 9, False, 9) == 2
    assert MambaManager.get_num_blocks_to_allocate(fresh, "n", 9, [], 0, 0) == 1


@pytest.mark.parametrize("release", RELEASES)
def test_speculative_block_relocation_checks_ownership_under_0_33(release: str) -> None:
    # 0.33.0 asserts a speculative block is writable (one owner, no hash) before it
    # moves to the table's end; 0.25.1 moves it unchecked.
    m = build("kvcache", config(mamba_spec("align", num_spec=1)), release)
    group = m.coordinator.single_type_managers[0]
    shared = m.block_pool.get_new_blocks(1)[0]
    m.block_pool.touch((shared,))  # a second reference
    table = [shared]
    if release == "0.33.0":
        with pytest.raises(AssertionError, match=r"exclusively owned.*ref_cnt=2"):
            group._relocate_speculative_block(table, 0)
        assert table == [shared]  # left as it was
    else:
        group._relocate_speculative_block(table, 0)
        assert table == [m.block_pool.null_block, shared]
    own = m.block_pool.get_new_blocks(1)[0]
    table = [own]
    group._relocate_speculative_block(table, 0)
    assert table == [m.block_pool.null_block, own]
