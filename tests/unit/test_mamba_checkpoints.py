"""vLLM 0.33.0's Mamba prefill checkpoints (switch ``mamba_prefill_checkpoints``) on kvcache.

A Mamba 'align' group whose spec has ``num_prefill_checkpoint_blocks`` and a
``prefill_checkpoint_alignment`` reserves, per prefill chunk, the column its backend
exports a mid-chunk state into, keys that block at the checkpoint's position when a
later lookup can reuse it and drops its keys otherwise, and offers the states it
caches to a KV connector (``take_boundary_state_offloads``). The chunk tables below
(block ids, the tokens each block's key covers, the offers, the free blocks) were
produced by vLLM 0.33.0 itself on the same calls, when these tests were written;
vLLM 0.33.0's own tests of the feature run in ``make upstream-0.33``.
Under 0.25.1 a spec with the fields is refused, naming them (vLLM 0.25.1's ``MambaSpec``
has neither).
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    sha256,
)
from kvcache import kv_cache_math as kmath
from kvcache import vllm_0_33 as v33
from kvcache.kv_cache_interface import KVCacheSpecMergeError
from kvcache.profile import Profile
from kvcache.single_type_kv_cache_manager import MambaManager, SingleTypeKVCacheManager

HBS = 16  # hash block = full-attention block
MBS = 32  # Mamba block


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    kcu.init_none_hash(sha256)


def mamba_spec(checkpoint_blocks: int = 1, alignment: int | None = 16, **kw: Any) -> MambaSpec:
    return MambaSpec(block_size=kw.pop("block_size", MBS), shapes=((1,),), dtypes=("float32",),
                     mamba_cache_mode="align", num_prefill_checkpoint_blocks=checkpoint_blocks,
                     prefill_checkpoint_alignment=alignment, **kw)


def config(spec: MambaSpec, retention: int | None = None) -> KVCacheConfig:
    cfg = KVCacheConfig(64, [], [
        KVCacheGroupSpec(["full"], FullAttentionSpec(
            block_size=HBS, num_kv_heads=1, head_size=1, dtype="float32")),
        KVCacheGroupSpec(["mamba"], spec),
    ])
    cfg.prefix_cache_retention_interval = retention  # type: ignore[attr-defined]
    return cfg


def manager(release: str, spec: MambaSpec, retention: int | None = None,
            use_eagle: bool = False) -> Any:
    cfg = config(spec, retention)
    if release == "0.33.0":
        return v33.KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=spec.block_size,
                                  hash_block_size=HBS, use_eagle=use_eagle,
                                  enable_kv_cache_events=True)
    return KVCacheManager(cfg, 1024, spec.block_size, HBS, use_eagle=use_eagle,
                          enable_kv_cache_events=True,
                          prefix_cache_retention_interval=retention)


def request(release: str, num_tokens: int) -> Request:
    hasher = (v33.get_request_block_hasher(HBS, sha256) if release == "0.33.0"
              else kcu.get_request_block_hasher(HBS, sha256))
    return Request("p", list(range(num_tokens)), block_hasher=hasher)


def run_chunks(m: Any, r: Request, chunks: list[int]) -> list[tuple[Any, ...]]:
    """Prefill ``r`` in ``chunks``; per chunk: the Mamba group's reserved checkpoint,
    its table (None for the null block, else (block id, tokens its key covers)),
    the boundary-state offers (0.33.0 only) and the free blocks."""
    mamba = m.coordinator.single_type_managers[1]
    out = []
    for chunk in chunks:
        assert m.allocate_slots(r, chunk) is not None
        table = [None if b.is_null else (b.block_id, b.block_hash_num_tokens)
                 for b in mamba.req_to_blocks[r.request_id]]
        offers = m.take_boundary_state_offloads() if hasattr(
            m, "take_boundary_state_offloads") else None
        out.append((mamba._checkpoints.get(r.request_id), table, offers,
                    m.block_pool.get_num_free_blocks()))
        r.num_computed_tokens += chunk
        m.new_step_starts()
    return out


# (mamba block, retention, chunks, EAGLE) -> per chunk (checkpoint, table, offers, free),
# as vLLM 0.33.0 gives them.
CASES = {
    "one-chunk": ((MBS, None, [120], False), [
        ((112, 2), [None, None, (9, 112), (10, None)], {"p": [(1, 9, 112)]}, 53)]),
    "dense-two-chunks": ((MBS, None, [64, 56], False), [
        ((48, 0), [(5, None), (6, 64)], {"p": [(1, 6, 64)]}, 57),
        ((112, 2), [None, (6, 64), (10, 112), (11, None)], {"p": [(1, 10, 112)]}, 52)]),
    "latest-only-two-chunks": ((MBS, 0, [64, 56], False), [
        (None, [None, (5, None)], {}, 58),
        ((112, 2), [None, (5, None), (10, 112), (11, None)], {"p": [(1, 10, 112)]}, 52)]),
    "retained-block-boundary": ((MBS, None, [48, 72], False), [
        ((32, 0), [(4, 32), (5, None)], {"p": [(1, 4, 32)]}, 58),
        ((112, 2), [None, (5, 64), (11, 112), (12, None)],
         {"p": [(1, 5, 64), (1, 11, 112)]}, 52)]),
    "coarse-mamba-block": ((64, None, [64, 100], False), [
        (None, [(5, 64)], {"p": [(1, 5, 64)]}, 58),
        ((160, 1), [(5, 64), (13, 160), (14, None)], {"p": [(1, 13, 160)]}, 49)]),
    "eagle": ((MBS, None, [120], True), [
        ((96, 2), [None, None, (9, 96), (10, None), (11, None)], {"p": [(1, 9, 96)]}, 52)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoints_follow_vllm_0_33(name: str) -> None:
    (block_size, retention, chunks, eagle), expected = CASES[name]
    spec = mamba_spec(block_size=block_size, num_speculative_blocks=int(eagle))
    m = manager("0.33.0", spec, retention, use_eagle=eagle)
    r = request("0.33.0", sum(chunks))
    assert run_chunks(m, r, chunks) == expected
    m.free(r)
    mamba = m.coordinator.single_type_managers[1]
    assert "p" not in mamba._checkpoints and m.take_boundary_state_offloads() == {}
    assert m.block_pool.get_num_free_blocks() == 63


@pytest.mark.parametrize(("blocks", "alignment"), [(1, 16), (1, None), (0, 16)])
def test_0_25_1_refuses_the_checkpoint_fields(blocks: int, alignment: int | None) -> None:
    """0.25.1 has no checkpoints: a spec with either field set cannot be built there,
    so kvcache's 0.25.1 profile refuses it, naming the fields; without them it builds."""
    with pytest.raises(ValueError, match="num_prefill_checkpoint_blocks") as info:
        manager("0.25.1", mamba_spec(blocks, alignment))
    assert "0.25.1" in str(info.value)
    mamba = manager("0.25.1", mamba_spec(0, None)).coordinator.single_type_managers[1]
    assert mamba._checkpoints == {} and not mamba.mamba_prefill_checkpoints


def test_admission_estimate_counts_the_checkpoint_block() -> None:
    """The full-sequence admission check reserves the checkpoint's block too, without
    recording a checkpoint; the allocation then takes exactly the estimate."""
    m = manager("0.33.0", mamba_spec())
    r = request("0.33.0", 120)
    mamba = m.coordinator.single_type_managers[1]
    estimate = mamba.get_num_blocks_to_allocate("p", 120, [], 0, 120, prefill_end=120,
                                                apply_admission_cap=True)
    assert "p" not in mamba._checkpoints
    without = v33.MambaManager(mamba_spec(0, None), m.block_pool, True, 1, MBS)
    assert estimate == without.get_num_blocks_to_allocate("p", 120, [], 0, 0, 120) + 1
    free = m.block_pool.get_num_free_blocks()
    assert m.allocate_slots(r, 120, full_sequence_must_fit=True) is not None
    assert mamba._checkpoints["p"] == (112, 2)
    assert free - m.block_pool.get_num_free_blocks() == 8 + estimate  # 8 full-attention blocks


def test_checkpoint_validity_rule() -> None:
    """Each condition of ``mamba_prefill_checkpoint_valid`` refuses on its own."""
    valid = kmath.mamba_prefill_checkpoint_valid
    assert valid(0, 120, 112, 16, 32, 16)
    assert not valid(0, 120, 112, 16, 32, None)  # the backend exports nothing
    assert not valid(8, 120, 112, 16, 32, 8)  # start off the hash grid
    assert not valid(64, 96, 80, 16, 32, 16)  # column 1 holds the initial state
    assert not valid(64, 120, 64, 16, 32, 16)  # less than a hash block into the chunk
    assert not valid(0, 112, 112, 16, 32, 16)  # at the chunk's end
    assert not valid(0, 120, 112, 16, 32, 48)  # not a whole number of alignment steps
    assert valid(0, 120, 96, 16, 32, 48)


def test_spec_fields_validation_merge_and_memory() -> None:
    base = mamba_spec(0, None)
    assert (base.num_prefill_checkpoint_blocks, base.prefill_checkpoint_alignment) == (0, None)
    for kwargs in ({"checkpoint_blocks": -1}, {"checkpoint_blocks": True}, {"alignment": 0}):
        name = ("num_prefill_checkpoint_blocks" if "checkpoint_blocks" in kwargs
                else "prefill_checkpoint_alignment")
        with pytest.raises(ValueError, match=name):
            mamba_spec(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(KVCacheSpecMergeError):
        MambaSpec.merge([mamba_spec(1, 16), mamba_spec(1, 32)])
    assert not mamba_spec(1, 16).is_uniform_with_collection({"a": mamba_spec(2, 16)})
    assert mamba_spec(1, 16).is_uniform_with_collection({"a": mamba_spec(1, 16)})

    class Cfg:
        class cache_config:
            mamba_cache_mode = "align"

    page = base.page_size_bytes
    assert mamba_spec(3, 16, num_speculative_blocks=1).max_memory_usage_bytes(Cfg) == 6 * page
    Cfg.cache_config.mamba_cache_mode = "none"
    assert mamba_spec(3, 16).max_memory_usage_bytes(Cfg) == page


def test_every_manager_switch_comes_from_its_pool_profile() -> None:
    """A drop-in manager built on its own (over a 0.33.0 pool) reads the same switches as one a
    KVCacheManager builds; 0.25.1's managers have every one off."""
    names = ("cache_within_hashed_tokens", "external_blocks_floor_zero",
             "partial_hit_copy_on_write", "shared_prefix_junctions", "mamba_frees_processed_states",
             "mamba_caps_new_state_blocks", "mamba_prompt_tail_state", "mamba_prefill_checkpoints",
             "has_prefill_checkpoint_blocks", "offers_boundary_states")
    inside = manager("0.33.0", mamba_spec()).coordinator.single_type_managers[1]
    alone = v33.MambaManager(mamba_spec(), v33.BlockPool(8, True, HBS), True, 0, MBS)
    old = manager("0.25.1", mamba_spec(0, None)).coordinator.single_type_managers[1]
    assert isinstance(inside, MambaManager) and isinstance(alone, SingleTypeKVCacheManager)
    for name in names:
        assert getattr(inside, name) is True and getattr(alone, name) is True, name
        assert getattr(old, name) is False, name
    full = v33.FullAttentionManager(FullAttentionSpec(
        block_size=HBS, num_kv_heads=1, head_size=1, dtype="float32"),
        v33.BlockPool(8, True, HBS), True, 0, HBS)
    assert full.partial_prompt_tail_entries is Profile("0.33.0").partial_prompt_tail_entries


@pytest.mark.parametrize("use_eagle", [False, True])
def test_shared_prefix_checkpoint_is_narrowed(use_eagle: bool) -> None:
    """enable_mamba_shared_prefix_checkpoint takes effect only with EAGLE groups and
    fine-grained hits, as in vLLM 0.33.0; then the Mamba managers key the junction."""
    cfg = config(mamba_spec(0, None))
    m = v33.KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=MBS,
                           hash_block_size=HBS, use_eagle=use_eagle,
                           enable_mamba_shared_prefix_checkpoint=True)
    assert m.coordinator.enable_partial_hash_hits
    assert m.mamba_shared_prefix_checkpoint is use_eagle
    assert m.coordinator.single_type_managers[1].shared_prefix_checkpoint is use_eagle
    off = v33.KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=MBS,
                             hash_block_size=HBS, use_eagle=True)
    assert not off.mamba_shared_prefix_checkpoint


@pytest.mark.parametrize(("in_flight", "expected"), [(1, []), (0, [(1, 8, 112)])])
def test_partial_tail_offload_waits_for_in_flight_tokens(
        in_flight: int, expected: list[tuple[int, int, int]]) -> None:
    """A request that finishes right after the chunk ending at its prompt tail inside a
    block (no checkpoint blocks: the tail is the request's own state) hands that state
    to a KV producer only if no token is in flight; either way once. As vLLM 0.33.0
    (the blocks below are its own, on the same calls)."""
    m = manager("0.33.0", mamba_spec(0, None))
    r = request("0.33.0", 120)
    blocks = m.allocate_slots(r, 112)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 8])
    r.num_computed_tokens = 112
    assert m.take_boundary_state_offloads() == {}  # the tail is not offered before the end
    m.new_step_starts()
    r.num_in_flight_tokens = in_flight  # type: ignore[attr-defined]
    assert m.finalize_partial_tail_offloads(r) == expected
    assert m.finalize_partial_tail_offloads(r) == []
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 63
