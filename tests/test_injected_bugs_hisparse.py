"""The HiSparse differential test has teeth: bugs planted in kvcache's HiSparse
managers (``kvcache/hisparse.py``) and in the pool's unpin path are caught by
``tests/unit/test_hisparse_vs_spec.py`` (kvcache vs the spec through one stand-in
coordinator per side).

Each test monkeypatches one piece of kvcache (the pure build) with a small buggy
version and expects the differential sequences to fail; the control runs unpatched
and must pass. Nothing in kvcache/ or spec/ is edited.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from injected_harness import timed_catch, unit_failure
from unit.test_hisparse_vs_spec import NUM_SEQUENCES, run_sequence

import kvcache.block_pool as block_pool
import kvcache.hisparse as hisparse
from kvcache import init_none_hash, sha256
from kvcache.kv_cache_math import cdiv
from kvcache.kv_cache_utils import KVCacheBlock


def differential_failure() -> BaseException | None:
    """The differential sequences, in order, up to the first failure."""
    init_none_hash(sha256)
    seen: Counter[str] = Counter()
    return unit_failure(*[lambda seed=seed: run_sequence(seed, seen)
                          for seed in range(NUM_SEQUENCES)])


# ---------------------------------------------------------------- the bugs


def resident_import_without_tail(
    self: hisparse.HiSparseResidentManager, request_id: str, num_tokens: int,
    new_computed_blocks: Any, total_computed_tokens: int, num_local_computed_tokens: int,
    num_tokens_main_model: int, apply_admission_cap: bool = False, prefill_end: int = 0,
) -> int:
    """An import's last page is not counted: admission under-counts by one block."""
    existing = len(self.req_to_blocks.get(request_id, ()))
    required = cdiv(num_tokens, self.block_size)
    if total_computed_tokens > num_local_computed_tokens:
        return max(required - max(cdiv(total_computed_tokens, self.block_size), existing), 0)
    if apply_admission_cap:
        required = min(required, self.max_admission_blocks_per_request)
    return max(required - max(existing, cdiv(num_local_computed_tokens, self.block_size)), 0)


def drop_without_overlay(
    self: hisparse.HiSparseResidentManager, request_id: str, block_idx: int
) -> KVCacheBlock | None:
    """Dropping a page returns its block but leaves it resident."""
    return self.get_resident_page(request_id, block_idx)


def hot_only_for_local_hits(
    self: hisparse.HiSparseHotManager, request_id: str, new_computed_blocks: Any,
    num_local_computed_tokens: int, num_external_computed_tokens: int,
) -> None:
    """Without resident groups a new request is not given its region up front."""
    self.num_cached_block[request_id] = 0
    if num_local_computed_tokens > 0:
        self.require_hot(request_id)


def hot_count_ignoring_requests(
    self: hisparse.HiSparseHotManager, request_id: str, num_tokens: int,
    new_computed_blocks: Any, total_computed_tokens: int, num_local_computed_tokens: int,
    num_tokens_main_model: int, apply_admission_cap: bool = False, prefill_end: int = 0,
) -> int:
    """A running request's ``require_hot`` is not counted at admission."""
    if total_computed_tokens > num_local_computed_tokens or (
            num_local_computed_tokens > 0 and request_id not in self.num_cached_block):
        return self.get_num_required_blocks(request_id)
    return 0


def unpin_to_the_front(self: block_pool.BlockPool, blocks: Any, on_reuse: Any) -> None:
    """Unpinned blocks are handed out first, not last."""
    blocks = list(blocks)
    ORIGINAL_UNPIN(self, blocks, on_reuse)
    released = [b for b in blocks if b.ref_cnt == 0]
    for block in released:
        self.free_block_queue.remove(block)
    self.free_block_queue.prepend_n(released)


ORIGINAL_UNPIN = block_pool.BlockPool.unpin_blocks


def source_free_without_coordinator(
    self: hisparse.HiSparseSourceManager, request_id: str
) -> list[KVCacheBlock]:
    """The source forgets the request without telling the coordinator."""
    return hisparse.FullAttentionManager.pop_blocks_for_free(self, request_id)


BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "resident admission leaves out an import's last page": lambda mp: mp.setattr(
        hisparse.HiSparseResidentManager, "get_num_blocks_to_allocate",
        resident_import_without_tail),
    "drop_resident_page leaves the page resident": lambda mp: mp.setattr(
        hisparse.HiSparseResidentManager, "drop_resident_page", drop_without_overlay),
    "a hot group without resident groups waits for require_hot": lambda mp: mp.setattr(
        hisparse.HiSparseHotManager, "add_local_computed_blocks", hot_only_for_local_hits),
    "the hot count ignores require_hot": lambda mp: mp.setattr(
        hisparse.HiSparseHotManager, "get_num_blocks_to_allocate",
        hot_count_ignoring_requests),
    "the source does not tell the coordinator of a free": lambda mp: mp.setattr(
        hisparse.HiSparseSourceManager, "pop_blocks_for_free", source_free_without_coordinator),
    "unpinned blocks join the front of the free queue": lambda mp: mp.setattr(
        block_pool.BlockPool, "unpin_blocks", unpin_to_the_front),
}


def test_the_unpatched_sequences_pass() -> None:
    assert differential_failure() is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_hisparse_bug_is_caught(bug: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        BUGS[bug](mp)
        error = timed_catch(bug, differential_failure)
    assert error is not None, f"not caught: {bug}"
