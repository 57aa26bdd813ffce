"""vLLM 0.33.0's ring buffer (``CircularBufferSpec`` / ``CircularBufferManager``) in
kvcache and in the spec, under ``Profile("0.33.0")`` (switch ``circular_buffer_groups``).

A ring group holds one block per request for the request's whole life, takes no
part in prefix caching (no hit, no hash, no event, no zeroing) and is left out of
the hybrid hit search; the 0.25.1 profile refuses it. Conformance with the real
vLLM 0.33.0 is the kit's ``full+circular`` and ``full+swa+circular`` families.
"""

from __future__ import annotations

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
    MambaSpec,
    Request,
    sha256,
)
from kvcache import vllm_0_33 as v33
from kvcache.kv_cache_interface import CircularBufferSpec, KVCacheSpecMergeError
from kvcache.single_type_kv_cache_manager import (
    CircularBufferManager,
    get_manager_class_for_kv_cache_spec,
)

HASH = 2


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    kcu.init_none_hash(sha256)


def ring(block_size: int = 8, heads: int = 1) -> CircularBufferSpec:
    return CircularBufferSpec(block_size=block_size, num_kv_heads=heads, head_size=8,
                              dtype="float16")


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")


def config(*specs: Any, num_blocks: int = 16) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec([f"l{i}"], s)
                                          for i, s in enumerate(specs)])


def manager(cfg: KVCacheConfig, **kwargs: Any) -> v33.KVCacheManager:
    kwargs.setdefault("enable_kv_cache_events", True)
    return v33.KVCacheManager(cfg, max_model_len=64, scheduler_block_size=8,
                              hash_block_size=HASH, **kwargs)


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), block_hasher=v33.get_request_block_hasher(HASH, sha256))


def admit(m: Any, r: Request) -> Any:
    blocks, hit, _ = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    return hit, new


# ---------------------------------------------------------------- the spec class


def test_ring_spec_is_one_page_per_request_and_not_prefix_cacheable() -> None:
    s = ring(block_size=16, heads=2)
    assert s.page_size_bytes == 2 * 16 * 2 * 8 * 2  # K and V, heads, head size, fp16
    assert s.max_memory_usage_bytes(None) == s.page_size_bytes
    assert s.max_num_blocks_per_req(None, 10_000) == 1
    assert not s.prefix_cacheable and not s.uses_slot_mapping
    assert s.block_table_token_alignment is None
    assert s.is_uniform_with_collection({"a": ring(4), "b": ring(8)})
    assert not s.is_uniform_with_collection({"a": ring(4), "b": full()})
    assert CircularBufferSpec.merge([ring(), ring()]) == ring()
    with pytest.raises(KVCacheSpecMergeError):
        CircularBufferSpec.merge([ring(heads=1), ring(heads=2)])
    assert get_manager_class_for_kv_cache_spec(s) is CircularBufferManager


# ---------------------------------------------------------------- the manager


def test_one_ring_block_for_the_request_lifetime_never_cached() -> None:
    m = manager(config(full(), ring(8)))
    r = request("r", 13)
    hit, new = admit(m, r)
    assert hit == 0 and len(new.blocks[1]) == 1
    ring_block = new.blocks[1][0]
    for _ in range(20):  # decode past the ring's capacity: still that one block
        r.append_output_token_ids(7)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens = r.num_tokens
    assert m.coordinator.get_blocks("r")[1] == [ring_block]
    assert ring_block.block_hash is None
    assert m.take_new_block_ids() == []
    stored = [e for e in m.take_events() if type(e).__name__ == "BlockStored"]
    assert stored and all(e.group_idx == 0 for e in stored)
    free_before = m.block_pool.get_num_free_blocks()
    held = len(m.coordinator.get_blocks("r")[0]) + 1
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == free_before + held
    assert ring_block.ref_cnt == 0 and ring_block.block_hash is None


def test_a_resent_prompt_hits_full_attention_and_takes_a_fresh_ring_block() -> None:
    m = manager(config(full(), ring(8)))
    first = request("a", 13)
    admit(m, first)
    m.free(first)
    second = request("b", 13)
    hit, new_b = admit(m, second)
    assert hit == 8  # 12 cached tokens, cut to the scheduler block (8), not by the ring
    assert len(m.coordinator.get_blocks("b")[1]) == 1 and len(new_b.blocks[1]) == 1


def test_external_load_claims_the_ring_block_once() -> None:
    m = manager(config(full(), ring(8)))
    r = request("r", 13)
    new = m.allocate_slots(r, 4, num_external_computed_tokens=8)
    assert new is not None and len(m.coordinator.get_blocks("r")[1]) == 1
    r.num_computed_tokens = 12
    assert m.allocate_slots(r, 1) is not None
    assert len(m.coordinator.get_blocks("r")[1]) == 1


def test_ring_needs_one_free_block_to_admit() -> None:
    m = manager(config(full(), ring(8), num_blocks=5))  # 4 usable blocks
    r = request("r", 16)  # 4 full-attention blocks, and the ring's one: too many
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 16, hit, blocks) is None
    assert m.allocate_slots(r, 12, hit, blocks) is not None  # 3 + 1


def test_ring_records_nothing_for_zeroing_beside_mamba() -> None:
    mamba = MambaSpec(block_size=8, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="none")
    m = manager(config(full(8), mamba, ring(8)), enable_caching=False)
    r = request("r", 13)
    _, new = admit(m, r)
    ring_id = new.blocks[2][0].block_id
    ids = m.take_new_block_ids()
    assert new.blocks[0][0].block_id in ids and ring_id not in ids
    ring_manager = m.coordinator.single_type_managers[2]
    assert isinstance(ring_manager, CircularBufferManager)
    assert not ring_manager.records_new_block_ids


def test_constructor_takes_vllm_0_33_arguments() -> None:
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=4)
    m = CircularBufferManager(ring(4), block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                              scheduler_block_size=4, needs_kv_cache_zeroing=True,
                              max_admission_blocks_per_request=1)
    assert m.get_num_blocks_to_allocate("x", 100, [pool.blocks[1]], 0, 100,
                                        num_local_computed_tokens=0) == 1
    m.allocate_external_computed_blocks("x", 16, 4, record_for_zeroing=False)
    assert m.get_num_blocks_to_allocate("x", 400, [], 399, 400) == 0
    assert m.allocate_new_blocks("x", 400, 400) == []
    m.cache_blocks("x", 400, replay_boundaries=(0,))
    assert m.take_new_block_ids() == [] and len(m.req_to_blocks["x"]) == 1


# ---------------------------------------------------------------- coordinator and profiles


def test_ring_block_size_need_not_be_a_multiple_of_the_hash_block() -> None:
    # ring block 3 with hash block 2: only prefix-cacheable groups must divide
    m = v33.KVCacheManager(config(full(2), ring(3)), max_model_len=64, scheduler_block_size=6,
                           hash_block_size=2)
    assert m.coordinator.attention_groups[0].group_ids == [0]
    assert len(m.coordinator.attention_groups) == 1


def test_a_layout_of_ring_groups_only_is_refused_with_caching() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        manager(config(ring(8, heads=1), ring(8, heads=2)))
    m = manager(config(ring(8, heads=1), ring(8, heads=2)), enable_caching=False)
    assert m.allocate_slots(request("r", 5), 5) is not None


def test_0_25_1_profile_refuses_a_ring_group_in_kvcache_and_spec() -> None:
    cfg = config(full(), ring(8))
    with pytest.raises(NotImplementedError, match="CircularBufferSpec"):
        KVCacheManager(cfg, 64, 8, HASH)
    with pytest.raises(NotImplementedError, match="CircularBufferSpec"):
        spec.KVCacheManager(cfg, 64, 8, HASH)
    built = spec.KVCacheManager(cfg, 64, 8, HASH, profile="0.33.0")
    assert built.single_type_managers[1].rules is spec.KINDS["CircularBufferSpec"]
