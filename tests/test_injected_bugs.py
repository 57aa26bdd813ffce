"""The stateful machine has teeth: each plausible bug, planted in kvcache, is caught.

Every test monkeypatches one kvcache method (or constant) with a small buggy
version written here, runs ``ManagerMachine`` (kvcache against spec) on a fixed
budget (``tests/injected_harness.py``) and expects it to fail. The control runs
the same budget unpatched and must pass. Nothing in kvcache/ or spec/ is edited.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from injected_harness import budget, machine_failure, raised_in, timed_catch
from stateful.test_manager_machine import ManagerMachine

import kvcache.kv_cache_manager as kv_cache_manager
from kvcache import (
    BlockPool,
    FullAttentionManager,
    KVCacheManager,
    RequestStatus,
    SingleTypeKVCacheManager,
)

# The same examples for every test and every run (tests/injected_harness.py).
BUDGET = budget(max_examples=150)


@pytest.fixture(scope="module")
def control_failure() -> BaseException | None:
    """The unpatched machine's outcome on BUDGET (run once per module)."""
    return machine_failure(ManagerMachine, BUDGET)


# ---------------------------------------------------------------- the bugs


def free_in_allocation_order(self: SingleTypeKVCacheManager, request_id: str) -> None:
    """Frees head first, so a chain's head is evicted before its tail."""
    self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))


def hit_whole_prompt(self: KVCacheManager, request: Any) -> tuple[Any, int]:
    """Lets the hit cover the last token (max length num_tokens, not num_tokens - 1)."""
    if not self.enable_caching or request.skip_reading_prefix_cache:
        return self.empty_kv_cache_blocks, 0
    blocks, num_hits = self.coordinator.find_longest_cache_hit(
        request.block_hashes, request.num_tokens
    )
    if self.prefix_cache_stats is not None:
        self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)
    return self.create_kv_cache_blocks(blocks), num_hits


def stats_ignore_preemption(self: KVCacheManager, request: Any) -> tuple[Any, int]:
    """Counts a resumed request's lookup as a new request's."""
    if not self.enable_caching or request.skip_reading_prefix_cache:
        return self.empty_kv_cache_blocks, 0
    blocks, num_hits = self.coordinator.find_longest_cache_hit(
        request.block_hashes, request.num_tokens - 1
    )
    if self.prefix_cache_stats is not None:
        self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted=False)
    return self.create_kv_cache_blocks(blocks), num_hits


def touch_leaving_free(self: BlockPool, blocks: Iterable[Any]) -> None:
    """A hit on a free cached block takes a reference but leaves it in the free queue."""
    for block in blocks:
        block.ref_cnt += 1


def evict_leaving_map_entry(self: BlockPool, block: Any) -> bool:
    """Forgets the block's hash but leaves it in the prefix-cache map."""
    if block._hash is None:
        return False
    block.reset_hash()
    return True


def release_unhashed_to_back(self: BlockPool, ordered_blocks: Iterable[Any]) -> None:
    """Queues every released block at the back, so blocks that can never hit
    outlive cached ones."""
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0 and not block.is_null:
            self.free_block_queue.append(block)


def common_prefix_counting_first(self: FullAttentionManager, running_request_id: str) -> int:
    """Counts a block before checking it is shared (one too many on a mismatch)."""
    blocks = self.req_to_blocks[running_request_id]
    num_requests = len(self.req_to_blocks)
    num_common = 0
    for block in blocks:
        num_common += 1
        if block.ref_cnt != num_requests:
            break
    return num_common


def stored_event_without_parent(original: Callable[..., None]) -> Callable[..., None]:
    """BlockStored events lose their parent hash."""

    def emit(self: BlockPool, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.kv_event_queue[-1].parent_block_hash = None

    return emit


def take_new_block_ids_keeping(self: SingleTypeKVCacheManager) -> list[int]:
    """Returns the new ids but does not clear them (blocks zeroed twice)."""
    return list(self.new_block_ids)


def hit_keeping_eagle_block(original: Any) -> Any:
    """EAGLE's last hit block is not dropped (the drafter would miss its KV)."""

    def find_longest_cache_hit(cls: type, *args: Any, **kwargs: Any) -> Any:
        # The coordinators pass the arguments positionally: bind them by name.
        bound = inspect.signature(original.__func__).bind(cls, *args, **kwargs)
        bound.arguments["drop_eagle_block"] = False
        return original.__func__(*bound.args, **bound.kwargs)

    return classmethod(find_longest_cache_hit)


BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "free order not reversed": lambda mp: mp.setattr(
        SingleTypeKVCacheManager, "free", free_in_allocation_order
    ),
    "hit not capped at num_tokens - 1": lambda mp: mp.setattr(
        KVCacheManager, "get_computed_blocks", hit_whole_prompt
    ),
    "stats count a resumed request as new": lambda mp: mp.setattr(
        KVCacheManager, "get_computed_blocks", stats_ignore_preemption
    ),
    "watermark applied to running requests": lambda mp: mp.setattr(
        kv_cache_manager,
        "_WATERMARKED",
        (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING),
    ),
    "touched free block left in the free queue": lambda mp: mp.setattr(
        BlockPool, "touch", touch_leaving_free
    ),
    "evicted block left in the hash map": lambda mp: mp.setattr(
        BlockPool, "_evict", evict_leaving_map_entry
    ),
    # free_blocks (the public entry) checks its argument, then calls release_blocks.
    "unhashed blocks freed to the back": lambda mp: mp.setattr(
        BlockPool, "release_blocks", release_unhashed_to_back
    ),
    "common-prefix count off by one": lambda mp: mp.setattr(
        FullAttentionManager, "get_num_common_prefix_blocks", common_prefix_counting_first
    ),
    "BlockStored without parent hash": lambda mp: mp.setattr(
        BlockPool, "_emit_block_stored", stored_event_without_parent(BlockPool._emit_block_stored)
    ),
    "take_new_block_ids does not clear": lambda mp: mp.setattr(
        SingleTypeKVCacheManager, "take_new_block_ids", take_new_block_ids_keeping
    ),
    "EAGLE block not dropped from hits": lambda mp: mp.setattr(
        FullAttentionManager,
        "find_longest_cache_hit",
        hit_keeping_eagle_block(FullAttentionManager.__dict__["find_longest_cache_hit"]),
    ),
}


def test_unpatched_machine_passes_the_budget(control_failure: BaseException | None) -> None:
    assert control_failure is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_machine_catches(
    bug: str, monkeypatch: pytest.MonkeyPatch, control_failure: BaseException | None
) -> None:
    if control_failure is not None:
        pytest.fail(f"the unpatched machine fails already: {control_failure!r}")
    BUGS[bug](monkeypatch)
    error = timed_catch(bug, lambda: machine_failure(ManagerMachine, BUDGET))
    assert error is not None, f"the machine missed: {bug}"
    # A failure inside spec would be the machine's or the oracle's fault, not a catch.
    assert "/spec/" not in raised_in(error), f"{bug}: spec raised {error!r}"
