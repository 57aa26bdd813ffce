"""Directed tests for bug classes that random search meets only after minutes.

Each test pins one situation down exactly, with values computed here
independently of kvcache (and, where both run, kvcache compared with spec):

* hash chaining beyond the first block: every block's hash, computed here with
  ``hashlib`` and ``pickle`` from its parent's, for a prompt hashed at once and for
  blocks completed one decode token at a time, with extra keys on later blocks;
* a long sliding-window admission whose hits reach far beyond the window's
  admission cap: ``get_num_blocks_to_allocate`` predicts exactly the blocks the
  allocation takes, and with a pool one block short both kvcache and spec refuse;
* a multi-group admission with connector (external) tokens on a full pool whose
  free queue starts with the groups' own hit blocks: every group must touch its
  hits before any group takes a block for the external tokens.

``tests/test_injected_bugs*.py`` plant the matching bugs and run these tests.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any

import pytest

import kvcache
import kvcache.kv_cache_utils as kcu
import spec
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    LoRARequest,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)

HEADS: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}

# ---------------------------------------------------------------- hash chaining


def digest(value: Any) -> bytes:
    """vLLM's default block hash, written out: SHA-256 of the protocol-5 pickle."""
    return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()


def none_hash() -> bytes:
    """The chain's seed as vLLM defines it: the hash of ``PYTHONHASHSEED``."""
    seed = os.environ.get("PYTHONHASHSEED")
    return digest(seed) if seed is not None else kcu.NONE_HASH


def expected_chain(tokens: list[int], block_size: int,
                   extra: dict[int, tuple[Any, ...]] | None = None) -> list[bytes]:
    """Each full block's hash: ``digest((parent, block tokens, extra keys))``."""
    hashes: list[bytes] = []
    parent = none_hash()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start:start + block_size])
        parent = digest((parent, block, (extra or {}).get(start // block_size)))
        hashes.append(parent)
    return hashes


def hashed_request(tokens: list[int], block_size: int, **kwargs: Any) -> Request:
    init_none_hash(sha256)  # other tests may have seeded the chain with another function
    return Request("r", tokens, block_hasher=get_request_block_hasher(block_size, sha256),
                   **kwargs)


def test_chain_seed_is_the_hash_of_pythonhashseed() -> None:
    init_none_hash(sha256)
    if "PYTHONHASHSEED" not in os.environ:
        pytest.skip("PYTHONHASHSEED is unset: the seed is random bytes")
    assert digest(os.environ["PYTHONHASHSEED"]) == kcu.NONE_HASH


def test_every_block_hash_chains_over_its_parent() -> None:
    tokens = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9]
    request = hashed_request(tokens, 4)
    assert request.block_hashes == expected_chain(tokens, 4)
    # Equal blocks at different depths hash differently: only the parent differs.
    assert len(set(request.block_hashes)) == 3


def test_chain_pinned_to_literal_values_for_seed_zero() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        pytest.skip("the literals are for PYTHONHASHSEED=0")
    request = hashed_request([1, 2, 1, 2, 1, 2], 2)
    # Three equal blocks: the prefixes of SHA-256 digests computed outside this code.
    assert [h.hex()[:16] for h in request.block_hashes] == [
        "c128b7907a1dcdcf", "f6a35a0a60d19c57", "895c95b03b151f71"]


def test_blocks_completed_by_decode_tokens_chain_to_the_last_hash() -> None:
    request = hashed_request([3, 1, 4], 2)
    for token in [1, 5, 9, 2, 6]:
        request.append_output_token_ids(token)
    assert request.block_hashes == expected_chain([3, 1, 4, 1, 5, 9, 2, 6], 2)


def test_extra_keys_enter_every_block_of_the_chain() -> None:
    tokens = list(range(9))
    request = hashed_request(tokens, 3, lora_request=LoRARequest("ad", 1), cache_salt="s")
    extra = {0: ("ad", "s"), 1: ("ad",), 2: ("ad",)}
    assert request.block_hashes == expected_chain(tokens, 3, extra)


def test_coarse_blocks_take_the_fine_hash_at_their_end() -> None:
    tokens = list(range(12))
    fine = expected_chain(tokens, 2)
    view = kvcache.BlockHashListWithBlockSize(hashed_request(tokens, 2).block_hashes, 2, 6)
    assert list(view) == [fine[2], fine[5]]


# ---------------------------------------------------------------- sliding-window admission


def managers(specs: list[Any], num_blocks: int, **kwargs: Any) -> tuple[Any, Any]:
    """(spec, kvcache) managers over one config."""
    def config() -> KVCacheConfig:
        groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
        return KVCacheConfig(num_blocks, [], groups)

    block_size = min(s.block_size for s in specs)
    kwargs = {"scheduler_block_size": block_size, "hash_block_size": block_size,
              "enable_caching": True, **kwargs}
    return spec.KVCacheManager(config(), **kwargs), kvcache.KVCacheManager(config(), **kwargs)


def run_whole(manager: Any, request: Request) -> None:
    """Admit a waiting request's whole prompt and compute it."""
    hits, num_hits = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits)


def twin_requests(tokens: list[int], block_size: int) -> tuple[Request, Request]:
    hasher = get_request_block_hasher(block_size, sha256)
    return Request("r", list(tokens), block_hasher=hasher), Request("r", list(tokens),
                                                                     block_hasher=hasher)


def cached_then_extended(num_blocks: int) -> tuple[Any, Any, Request, Request]:
    """Full attention + a 2-token window (block size 1, max 2 batched tokens: the
    window's admission cap is 4 blocks). A 16-token prompt is computed and freed;
    a second request extends it by one token, so it hits 16 tokens, 12 beyond the
    cap. Returns both managers and the second request (spec's, kvcache's)."""
    layout = [FullAttentionSpec(block_size=1, **HEADS),
              SlidingWindowSpec(block_size=1, sliding_window=2, **HEADS)]
    pair = managers(layout, num_blocks, max_model_len=32, max_num_batched_tokens=2)
    prompt = [i % 3 for i in range(16)]
    for manager, first in zip(pair, twin_requests(prompt, 1), strict=True):
        run_whole(manager, first)
        first.num_computed_tokens = first.num_tokens
        first.status = RequestStatus.FINISHED_STOPPED
        manager.free(first)
    spec_req, impl_req = twin_requests([*prompt, 7], 1)
    for request in (spec_req, impl_req):
        request.request_id = "s"
    return pair[0], pair[1], spec_req, impl_req


def test_window_cap_is_below_the_hits() -> None:
    window = SlidingWindowSpec(block_size=1, sliding_window=2, **HEADS)
    assert window.max_admission_blocks_per_request(2, 32) == 4


def test_long_window_admission_takes_what_it_predicts() -> None:
    spec_m, impl_m, spec_req, impl_req = cached_then_extended(40)
    counts = []
    for manager, request in ((spec_m, spec_req), (impl_m, impl_req)):
        hits, num_hits = manager.get_computed_blocks(request)
        assert num_hits == 16
        predicted = getattr(manager, "coordinator", manager).get_num_blocks_to_allocate(
            request_id="s", num_tokens=17, new_computed_blocks=hits.blocks,
            num_encoder_tokens=0, total_computed_tokens=16, num_tokens_main_model=17)
        free_before = manager.block_pool.get_num_free_blocks()
        assert manager.allocate_slots(request, 1, 16, hits) is not None
        taken = free_before - manager.block_pool.get_num_free_blocks()
        assert predicted == taken, f"{manager.__module__}: predicted {predicted}, took {taken}"
        counts.append((predicted, manager.get_block_ids("s")))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("spare", [0, -1])
def test_long_window_admission_gate_with_no_block_to_spare(spare: int) -> None:
    """With all but ``need + spare`` free blocks reserved for other requests, the
    admission fits exactly (spare 0) or misses by one block (spare -1), on both."""
    spec_m, impl_m, spec_req, impl_req = cached_then_extended(40)
    hits, _ = spec_m.get_computed_blocks(spec_req)
    need = getattr(spec_m, "coordinator", spec_m).get_num_blocks_to_allocate(
        request_id="s", num_tokens=17, new_computed_blocks=hits.blocks, num_encoder_tokens=0,
        total_computed_tokens=16, num_tokens_main_model=17)
    reserved = spec_m.block_pool.get_num_free_blocks() - need - spare
    granted = []
    for manager, request in ((spec_m, spec_req), (impl_m, impl_req)):
        hits, num_hits = manager.get_computed_blocks(request)
        out = manager.allocate_slots(request, 1, num_hits, hits, reserved_blocks=reserved)
        granted.append(out is not None)
    assert granted == [spare == 0] * 2


# ---------------------------------------------------------------- connector tokens, full pool


def test_every_group_touches_its_hits_before_external_blocks() -> None:
    """Two full-attention groups, 10 usable blocks. r0 [0, 0] and r1 [1, 1, 1] fill
    the pool; freeing r0 first puts its blocks at the head of the free queue: group
    0's [2, 1], then group 1's [4, 3]. r2 = [0, 0, 2, 2] hits r0's two blocks in both
    groups and loads one token through the connector: no group may take an external
    block before every group has touched its hits (block 4 is group 1's hit)."""
    layout = [FullAttentionSpec(block_size=1, **HEADS),
              FullAttentionSpec(block_size=1, num_kv_heads=2, head_size=8, dtype="float16")]
    tables = []
    for manager in managers(layout, 11, max_model_len=8):
        hasher = get_request_block_hasher(1, sha256)
        r0, r1 = Request("r0", [0, 0], block_hasher=hasher), Request("r1", [1, 1, 1],
                                                                     block_hasher=hasher)
        for request in (r0, r1):
            run_whole(manager, request)
            request.num_computed_tokens = request.num_tokens
        assert manager.block_pool.get_num_free_blocks() == 0
        for request in (r0, r1):
            request.status = RequestStatus.FINISHED_STOPPED
            manager.free(request)
        r2 = Request("r2", [0, 0, 2, 2], block_hasher=hasher)
        hits, num_hits = manager.get_computed_blocks(r2)
        assert num_hits == 2 and hits.get_block_ids() == ([1, 2], [3, 4])
        assert manager.allocate_slots(r2, 1, 2, hits, num_external_computed_tokens=1)
        tables.append(manager.get_block_ids("r2"))
    # The free queue after the touches is [7, 6, 5, 10, 9, 8]: each group's external
    # block first, then each group's new block.
    assert tables[1] == ([1, 2, 7, 5], [3, 4, 6, 10])
    assert tables[0] == tables[1]
