"""Hand-written scenarios for spec/'s windowed, Mamba, cross-attention and hybrid groups.

Expected ids were checked against vLLM 0.25.1 with the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvcache.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvcache.kv_cache_utils import get_request_block_hasher, sha256
from kvcache.request import Request
from spec import KVCacheManager

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}


def make_manager(specs: Sequence[KVCacheSpec], num_blocks: int, scheduler_block_size: int,
                 hash_block_size: int, **kwargs: object) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheManager(KVCacheConfig(num_blocks, [], groups), 64, scheduler_block_size,
                          hash_block_size, **kwargs)  # type: ignore[arg-type]


def make_request(request_id: str, tokens: list[int], hash_block_size: int) -> Request:
    hasher = get_request_block_hasher(hash_block_size, sha256)
    return Request(request_id, tokens, block_hasher=hasher)


def test_sliding_window_frees_out_of_window_blocks_and_hits_with_nulls() -> None:
    manager = make_manager([SlidingWindowSpec(block_size=2, sliding_window=4, **ATTN)], 10, 2, 2)
    a = make_request("a", list(range(10)), 2)
    assert manager.allocate_slots(a, 10).get_block_ids() == ([1, 2, 3, 4, 5],)  # type: ignore[union-attr]
    a.num_computed_tokens = 10
    a.append_output_token_ids(10)
    # Token 10 reads tokens 7..10: blocks 0..2 (tokens 0..5) are skipped, freed tail first.
    assert manager.allocate_slots(a, 1).get_block_ids() == ([6],)  # type: ignore[union-attr]
    assert manager.get_block_ids("a") == ([0, 0, 0, 4, 5, 6],)
    assert manager.abstract_state()["free_queue"] == [7, 8, 9, 3, 2, 1]
    manager.check_invariants()
    manager.free(a)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", [*range(10), 50], 2))
    assert (hits.get_block_ids(), num_hit_tokens) == (([0, 0, 0, 4, 5],), 10)


def test_chunked_local_skips_whole_chunks() -> None:
    spec = ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4, **ATTN)
    manager = make_manager([spec], 10, 2, 2)
    manager.allocate_slots(make_request("a", list(range(10)), 2), 10)
    manager.free(make_request("a", [], 2))
    b = make_request("b", [*range(10), 50], 2)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert (hits.get_block_ids(), num_hit_tokens) == (([0, 0, 0, 0, 5],), 10)  # chunk 2 from 8
    assert manager.allocate_slots(b, 1, num_hit_tokens, hits).get_block_ids() == ([6],)  # type: ignore[union-attr]
    assert manager.get_block_ids("b") == ([0, 0, 0, 0, 5, 6],)
    manager.check_invariants()


def test_mamba_align_refuses_a_state_cached_this_step() -> None:
    spec = MambaSpec(block_size=4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                     num_speculative_blocks=1)
    manager = make_manager([spec], 10, 4, 4)
    a = make_request("a", [*range(8), 99], 4)
    # One running-state block plus one speculative block, nulls before them.
    assert manager.allocate_slots(a, 8).get_block_ids() == ([0, 1, 2],)  # type: ignore[union-attr]
    b = make_request("b", [*range(8), 7, 7], 4)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert (hits.get_block_ids(), num_hit_tokens) == (([0, 1],), 8)
    assert manager.allocate_slots(b, 2, num_hit_tokens, hits) is None  # a may not have written it
    manager.new_step_starts()
    assert manager.allocate_slots(b, 2, num_hit_tokens, hits).get_block_ids() == ([3, 4],)  # type: ignore[union-attr]
    assert manager.get_block_ids("b") == ([0, 1, 3, 4],)
    mamba = manager.single_type_managers[0]
    assert mamba.align is not None and mamba.align.last_state_block_idx == {"b": 1}
    manager.check_invariants()


def test_cross_attention_sized_by_encoder_tokens() -> None:
    specs = [FullAttentionSpec(block_size=2, **ATTN), CrossAttentionSpec(block_size=4, **ATTN)]
    manager = make_manager(specs, 10, 4, 2, enable_caching=False)
    r = make_request("r", [1, 2, 3], 2)
    new_blocks = manager.allocate_slots(r, 3, num_encoder_tokens=5)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([1, 2], [3, 4])
    assert manager.get_block_ids_for_computed_tokens("r", 1) == ([1], [3, 4])
    with pytest.raises(NotImplementedError):
        make_manager(specs, 10, 4, 2)


def test_hybrid_full_and_sliding_window_with_two_block_sizes() -> None:
    specs = [FullAttentionSpec(block_size=2, **ATTN),
             SlidingWindowSpec(block_size=4, sliding_window=4, **ATTN)]
    manager = make_manager(specs, 12, 4, 2)
    a = make_request("a", list(range(12)), 2)
    assert manager.allocate_slots(a, 12).get_block_ids() == ([1, 2, 3, 4, 5, 6], [7, 8, 9])  # type: ignore[union-attr]
    manager.free(a)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", [*range(12), 50], 2))
    assert (hits.get_block_ids(), num_hit_tokens) == (([1, 2, 3, 4, 5, 6], [0, 0, 9]), 12)


def test_sliding_window_caches_only_reachable_blocks() -> None:
    specs = [FullAttentionSpec(block_size=4, **ATTN),
             SlidingWindowSpec(block_size=2, sliding_window=3, **ATTN)]
    manager = make_manager(specs, 12, 4, 2)
    manager.allocate_slots(make_request("a", list(range(8)), 2), 8)
    swa_blocks = manager.get_block_ids("a")[1]
    hashed = manager.abstract_state()["block_hash"]
    # A hit ends on a 4-token boundary and needs one 2-token block before it.
    assert [b in hashed for b in swa_blocks] == [False, True, False, True]


def test_equal_specs_need_one_coordinator_group() -> None:
    spec = FullAttentionSpec(block_size=2, **ATTN)
    with pytest.raises(ValueError, match="distinct specs"):
        make_manager([spec, spec], 10, 2, 2)


def test_invariants_catch_a_block_in_two_groups() -> None:
    specs = [FullAttentionSpec(block_size=2, **ATTN),
             SlidingWindowSpec(block_size=2, sliding_window=2, **ATTN)]
    manager = make_manager(specs, 10, 2, 2)
    manager.allocate_slots(make_request("a", [1, 2, 3], 2), 3)
    manager.single_type_managers[1].req_to_blocks["a"][0] = 1  # group 0's block
    with pytest.raises(AssertionError, match="two groups"):
        manager.check_invariants()


def cached_positions(manager: KVCacheManager, request_id: str, group: int) -> list[int]:
    """Positions of the request's blocks in ``group`` that are in the prefix cache."""
    hashed = manager.abstract_state()["block_hash"]
    return [i for i, b in enumerate(manager.get_block_ids(request_id)[group]) if b in hashed]


@pytest.mark.parametrize("interval, expected", [
    (None, list(range(16))),        # dense: each 4-token block is a boundary
    (16, [3, 7, 11, 14, 15]),       # the block before each 16-token boundary, and before 60
    (0, [14]),                      # only the replay tail: hits stop at 63 -> 60
])
def test_sliding_window_retention_keeps_segment_and_replay_tails(
        interval: int | None, expected: list[int]) -> None:
    spec = SlidingWindowSpec(block_size=4, sliding_window=4, **ATTN)  # a hit reads 1 block
    manager = make_manager([spec], 20, 4, 4, prefix_cache_retention_interval=interval)
    manager.allocate_slots(make_request("a", list(range(64)), 4), 64)
    assert cached_positions(manager, "a", 0) == expected


@pytest.mark.parametrize("release, expected", [
    ("0.25.1", [14]),       # 0.25.1 has no junctions: the request's attribute is not read
    ("0.33.0", [7, 14]),    # shared_prefix_junctions: the tail before the junction at 32
])
def test_a_junction_is_kept_only_where_the_release_has_junctions(
        release: str, expected: list[int]) -> None:
    spec = SlidingWindowSpec(block_size=4, sliding_window=4, **ATTN)
    manager = make_manager([spec], 20, 4, 4, prefix_cache_retention_interval=0,
                           profile=release)
    request = make_request("a", list(range(64)), 4)
    request.shared_prefix_boundary = 32  # type: ignore[attr-defined]
    manager.allocate_slots(request, 64)
    assert cached_positions(manager, "a", 0) == expected


@pytest.mark.parametrize("interval, expected", [
    (4, list(range(16))),           # an interval of one block keeps every state
    (16, [3, 7, 11, 14, 15]),       # states after 16, 32, 48, 64 tokens, and after 60
    (0, [14]),
])
def test_mamba_retention_keeps_one_state_per_interval(interval: int,
                                                      expected: list[int]) -> None:
    spec = MambaSpec(block_size=4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="all")
    manager = make_manager([spec], 20, 4, 4, prefix_cache_retention_interval=interval)
    manager.allocate_slots(make_request("a", list(range(64)), 4), 64)
    assert cached_positions(manager, "a", 0) == expected


@pytest.mark.parametrize("specs, interval, match", [
    ([FullAttentionSpec(block_size=4, **ATTN)], 0, "needs a sliding-window or Mamba group"),
    ([SlidingWindowSpec(block_size=2, sliding_window=3, **ATTN)], 3, "a multiple of"),
    ([SlidingWindowSpec(block_size=2, sliding_window=3, **ATTN)], -2, "non-negative"),
])
def test_retention_interval_is_validated(specs: list[KVCacheSpec], interval: int,
                                         match: str) -> None:
    with pytest.raises(ValueError, match=f"prefix_cache_retention_interval={interval} .*{match}"):
        make_manager(specs, 10, specs[0].block_size, specs[0].block_size,
                     prefix_cache_retention_interval=interval)
