"""Context parallelism under ``Profile("0.33.0")``: per-group geometry, pcp not scaled.

vLLM 0.33.0 gives a group's manager the dcp / pcp world sizes only when its spec is
``dcp_sharded`` (attention specs; Mamba and replicated drafts are not), and a block
spans ``block_size * dcp`` tokens (pcp no longer counts): the switches
``dcp_sharded_geometry`` and ``pcp_not_scaled`` (ledger entries
``mamba-not-dcp-sharded``, ``pcp-not-scaled``). Several prefix-caching groups take
dcp when each is full attention or replicated, pcp when each is full attention or
replicated attention, and vLLM asserts otherwise. Here kvcache's drop-in and the
spec, both under 0.33.0, against numbers worked out from 0.33.0's rules (the
``full-dcp`` / ``hybrid-dcp`` families check random sequences against vLLM 0.33.0
itself in ``make conformance-0.33``), with 0.25.1's geometry beside them, and a
planted bug: kvcache with the two switches at 0.25.1's values is caught by the
kit's kvcache-0.33 vs spec-0.33 sequences.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache as K
import spec as S
from kvcache import vllm_0_33 as v33
from kvcache.kit.conformance import both_refuse, family_seed
from kvcache.kit.driver import FAMILIES, Stats, run_sequence
from kvcache.profile import Profile

BS = 4  # every spec's own block size here


def config(kinds: tuple[str, ...], num_blocks: int = 32) -> K.KVCacheConfig:
    attn = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")
    make = {
        "full": lambda: K.FullAttentionSpec(**attn),
        "swa": lambda: K.SlidingWindowSpec(**attn, sliding_window=2 * BS),
        "mamba": lambda: K.MambaSpec(block_size=BS, shapes=((1,),), dtypes=("float16",),
                                     mamba_cache_mode="align"),
    }
    groups = [K.KVCacheGroupSpec([f"l{i}"], make[k]()) for i, k in enumerate(kinds)]
    return K.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def managers(kinds: tuple[str, ...], release: str, **kwargs: Any) -> list[tuple[str, Any]]:
    """(name, manager) of kvcache and of the spec, same config, same release."""
    kwargs.setdefault("max_model_len", 64)
    kvcache_manager = (
        v33.KVCacheManager(config(kinds), **kwargs)
        if release == "0.33.0"
        else K.KVCacheManager(config(kinds), **kwargs)
    )
    return [("kvcache", kvcache_manager),
            ("spec", S.KVCacheManager(config(kinds), profile=release, **kwargs))]


def block_sizes(manager: Any) -> list[int]:
    return [m.block_size for m in getattr(manager, "coordinator", manager).single_type_managers]


@pytest.mark.parametrize(
    ("kinds", "dcp", "pcp", "sizes_0_25", "sizes_0_33"),
    [
        (("full",), 2, 2, [16], [8]),  # pcp no longer scales the block
        (("full",), 1, 2, [8], [4]),
        (("full", "mamba"), 2, 1, [8, 8], [8, 4]),  # Mamba is not dcp-sharded
        (("full", "swa", "mamba"), 4, 1, [16, 16, 16], [16, 16, 4]),
    ],
)
def test_block_sizes_follow_each_release_geometry(
    kinds: tuple[str, ...], dcp: int, pcp: int, sizes_0_25: list[int], sizes_0_33: list[int]
) -> None:
    for release, sizes in (("0.25.1", sizes_0_25), ("0.33.0", sizes_0_33)):
        scheduler = 16 if len(kinds) > 1 else sizes[0]
        for name, m in managers(kinds, release, scheduler_block_size=scheduler,
                                hash_block_size=scheduler, enable_caching=False,
                                dcp_world_size=dcp, pcp_world_size=pcp):
            assert block_sizes(m) == sizes, (release, name)
            if name == "kvcache" and release == "0.33.0":
                stms = m.coordinator.single_type_managers
                mamba = [isinstance(s, K.MambaManager) for s in stms]
                assert [s.dcp_world_size for s in stms] == [1 if b else dcp for b in mamba]
                assert [s.pcp_world_size for s in stms] == [1 if b else pcp for b in mamba]
                assert m.coordinator.group_block_sizes == tuple(sizes)


def test_allocation_without_caching_counts_unscaled_mamba_blocks() -> None:
    """full + Mamba ('align', caching off), dcp=2: 10 tokens take 2 full-attention
    blocks of 8 tokens and the Mamba group its own blocks of 4 (0.25.1: of 8)."""
    for release, mamba_blocks in (("0.25.1", 2), ("0.33.0", 3)):
        for name, m in managers(("full", "mamba"), release, scheduler_block_size=8,
                                hash_block_size=8, enable_caching=False, dcp_world_size=2):
            req = K.Request("r", list(range(10)))
            blocks = m.allocate_slots(req, 10)
            assert blocks is not None
            ids = blocks.get_block_ids()
            assert len(ids[0]) == 2, (release, name, ids)
            assert len(ids[1]) == mamba_blocks, (release, name, ids)


def test_lone_group_under_pcp_caches_by_the_dcp_block() -> None:
    """One full-attention group, dcp=1, pcp=2, caching on: 0.33.0 needs the hash block
    to be the unscaled block (4) and asserts for 0.25.1's (8); hits come in blocks of 4."""
    for name, m in managers(("full",), "0.25.1", scheduler_block_size=8, hash_block_size=8,
                            pcp_world_size=2):
        assert block_sizes(m) == [8], name  # 0.25.1 builds it with the scaled hash block
    for build in (
        lambda: v33.KVCacheManager(config(("full",)), max_model_len=64, scheduler_block_size=8,
                                   hash_block_size=8, pcp_world_size=2),
        lambda: S.KVCacheManager(config(("full",)), 64, 8, 8, pcp_world_size=2,
                                 profile="0.33.0"),
    ):
        with pytest.raises(AssertionError, match="hash_block_size=8"):
            build()
    tokens = list(range(11))
    for name, m in managers(("full",), "0.33.0", scheduler_block_size=BS, hash_block_size=BS,
                            pcp_world_size=2):
        hasher = v33.get_request_block_hasher(BS, K.sha256)
        first = K.Request("a", tokens, block_hasher=hasher)
        assert m.allocate_slots(first, 11) is not None
        second = K.Request("b", tokens, block_hasher=hasher)
        hit = m.get_computed_blocks(second)
        assert hit[1] == 8, name
        assert len(hit[0].blocks[0]) == 2, name  # two blocks of 4 tokens


@pytest.mark.parametrize(
    ("kinds", "dcp", "pcp", "refused"),
    [
        (("full", "mamba"), 2, 1, False),  # Mamba is replicated
        (("full", "swa"), 2, 1, True),  # a dcp-sharded sliding window
        (("full", "mamba"), 1, 2, True),  # under pcp only attention may be replicated
    ],
)
def test_several_caching_groups_take_dcp_by_0_33_rules(
    kinds: tuple[str, ...], dcp: int, pcp: int, refused: bool
) -> None:
    kwargs = dict(max_model_len=64, scheduler_block_size=8, hash_block_size=BS,
                  dcp_world_size=dcp, pcp_world_size=pcp)
    for build in (lambda: v33.KVCacheManager(config(kinds), **kwargs),
                  lambda: S.KVCacheManager(config(kinds), profile="0.33.0", **kwargs)):
        if refused:
            with pytest.raises(AssertionError, match="world_size"):
                build()
        else:
            build()
    with pytest.raises(K.ContextParallelError):  # 0.25.1 refuses every such layout
        K.KVCacheManager(config(kinds), **kwargs)


def test_hybrid_hit_uses_each_group_block() -> None:
    """full + Mamba 'align', dcp=2, caching on (as vLLM 0.33.0's own per-group DCP test,
    smaller): a 16-token prefix computed in one chunk is hit in full, as 2 full-attention
    blocks of 8 tokens and 4 Mamba blocks of 4 (the last the state)."""
    prefix = [i // 8 for i in range(16)]
    results = []
    for name, m in managers(("full", "mamba"), "0.33.0", scheduler_block_size=8,
                            hash_block_size=BS, dcp_world_size=2):
        hasher = v33.get_request_block_hasher(BS, K.sha256)
        owner = K.Request("owner", prefix + [99] * 3, block_hasher=hasher)
        computed, num_computed = m.get_computed_blocks(owner)[:2]  # the spec's: 2 values
        assert num_computed == 0
        for n in (16, 3):
            assert m.allocate_slots(owner, n, 0, computed) is not None
            owner.num_computed_tokens += n
            computed = None
        m.new_step_starts()
        other = K.Request("other", prefix + [100] * 5, block_hasher=hasher)
        hit, num_hit = m.get_computed_blocks(other)[:2]
        assert num_hit == 16, name
        lengths = [len(g) for g in hit.blocks]
        assert lengths == [2, 4], (name, lengths)
        results.append(hit.get_block_ids())
    assert results[0] == results[1]


def mismatches(family: str, sequences: int) -> int:
    stats = Stats()
    index = list(FAMILIES).index(family)
    bad = 0
    for i in range(sequences):
        result = run_sequence(family_seed(11, index, i), FAMILIES[family], "kvcache-0.33",
                              "spec-0.33", stats)
        if result.cannot_build is not None and both_refuse(result, "kvcache-0.33", "spec-0.33"):
            continue
        bad += result.mismatch is not None or result.cannot_build is not None
    return bad


@pytest.mark.parametrize("switch", ["dcp_sharded_geometry", "pcp_not_scaled"])
def test_kvcache_with_a_geometry_switch_off_is_caught(
    switch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planted bug: kvcache's drop-in with one geometry switch at 0.25.1's value
    (the spec keeps 0.33.0's) differs in the context-parallel families."""
    family = "hybrid-dcp" if switch == "dcp_sharded_geometry" else "full-dcp"
    assert mismatches(family, 12) == 0  # control
    mutant = Profile("0.33.0").with_switches(**{switch: False})
    monkeypatch.setattr(v33, "PROFILE", mutant)
    assert mismatches(family, 12) > 0, f"{switch} off in kvcache was not caught"


@pytest.mark.parametrize("dcp", [1, 2])
def test_dcp_turns_fine_grained_hits_on_at_an_equal_mamba_block(dcp: int) -> None:
    """full + Mamba 'align' with the Mamba block equal to the hash block: vLLM 0.33.0
    turns fine-grained hits on under dcp > 1 only (the dcp-scaled full-attention block
    is then larger than the hash block); a 12-token prefix computed in one chunk is hit
    to 12 tokens there, inside the second 8-token full-attention block, and not at all
    without dcp (coarse hits: the Mamba state is kept at 12, not at the scheduler block
    8). vLLM 0.33.0 gives the same (measured: off / 0 tokens, on / 12 tokens)."""
    prefix = [i // 4 for i in range(12)]
    results = []
    for name, m in managers(("full", "mamba"), "0.33.0", scheduler_block_size=8,
                            hash_block_size=BS, dcp_world_size=dcp):
        layer = getattr(m, "coordinator", m)  # the spec has no coordinator layer
        fine = getattr(layer, "enable_partial_hash_hits", None)
        if fine is None:
            fine = layer.fine_grained  # the spec's name
        assert fine is (dcp > 1), name
        hasher = v33.get_request_block_hasher(BS, K.sha256)
        owner = K.Request("owner", prefix + [99] * 3, block_hasher=hasher)
        computed = m.get_computed_blocks(owner)[0]
        assert m.allocate_slots(owner, 12, 0, computed) is not None
        owner.num_computed_tokens += 12
        m.new_step_starts()
        other = K.Request("other", prefix + [100] * 5, block_hasher=hasher)
        num_hit = m.get_computed_blocks(other)[1]
        assert num_hit == (12 if dcp > 1 else 0), (name, num_hit)
        results.append(num_hit)
    assert results[0] == results[1]


def test_the_0_33_draw_gives_one_group_context_parallel_configs_0_33_geometry() -> None:
    """conformance-0.33 draws ``full-dcp`` with 0.33.0's block geometry (block_size *
    dcp, pcp not scaled), which kvcache's 0.33 profile builds under pcp > 1, keeping
    0.25.1's (refused) in about one config in five."""
    import random

    from kvcache.kit.conformance import under_release
    from kvcache.kit.driver import CP_GEOMETRY_KEPT, random_config, release_cp_geometry
    from kvcache.kit.sides import CannotBuild, make_side

    family = under_release(FAMILIES["full-dcp"], "0.33.0")
    assert family.cp_geometry == "0.33.0" and FAMILIES["full-dcp"].cp_geometry == "0.25.1"
    pcp = [c for c in (random_config(random.Random(i), family) for i in range(300))
           if c.pcp_world_size > 1]  # fmt: skip
    kept = [c for c in pcp if c.scheduler_block_size_override is None]
    assert 0 < len(kept) < 2 * len(pcp) / CP_GEOMETRY_KEPT, (len(kept), len(pcp))
    for c in pcp[:20]:
        block = c.groups[0].block_size
        if c in kept:
            assert c.scheduler_block_size == c.hash_block_size == block * c.context_parallel
            with pytest.raises(CannotBuild, match="pcp_world_size"):
                make_side("kvcache-0.33", c)
        else:
            assert c.scheduler_block_size == c.hash_block_size == block * c.dcp_world_size
            make_side("kvcache-0.33", c)  # builds
    with pytest.raises(ValueError, match=r"release='0\.30\.0'"):
        release_cp_geometry(pcp[0], "0.30.0")
