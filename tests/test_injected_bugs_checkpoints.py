"""The 0.33.0 check of Mamba prefill checkpoints has teeth: bugs planted in kvcache are caught.

``tests/conformance/test_profile_0_33.py`` holds kvcache's 0.33.0 profile to the
spec's on the kit's random scheduler sequences, among them the checkpoint families
(``full+mamba-checkpoint``, ``full+mamba-checkpoint-retention``, ``mamba-checkpoint``:
Mamba 'align' groups with vLLM 0.33.0's prefill checkpoint blocks). Each test here
monkeypatches one kvcache method with a small buggy version written here (as
``tests/test_injected_bugs_fine_grained.py`` does) and expects the same comparison
to find a sequence that differs; the control runs the same seeds unpatched and must
agree on every one. Nothing in kvcache/ or spec/ is edited. Pure-Python build only
(the compiled classes cannot be patched).

The boundary-state offloads (``take_boundary_state_offloads``,
``finalize_partial_tail_offloads``: the exact blocks a KV connector may save) are
compared too: the driver drains them every step as vLLM 0.33.0's scheduler does, and
the spec models them. Two bugs no sequence can show are caught by unit tests instead
(``UNIT_CAUGHT``, with why).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from injected_harness import timed_catch, unit_failure
from unit import test_mamba_checkpoints as unit

import kvcache.kv_cache_utils as kcu
from kvcache import KVCacheCoordinator, MambaManager
from kvcache.kit.conformance import both_refuse, family_seed
from kvcache.kit.driver import FAMILIES, Stats, run_sequence
from kvcache.kv_cache_math import cdiv

pytestmark = pytest.mark.skipif(
    __import__("kvcache").COMPILED, reason="monkeypatching needs the pure-Python classes"
)

SEQUENCES = 40  # per family; the first difference ends a mutant's run
REACHED = ("checkpoint_chunk", "cow_copies", "boundary_offloads", "partial_tail_offloads",
           "finalize_partial_tail_offloads")
FAMILY_NAMES = ("full+mamba-checkpoint", "full+mamba-checkpoint-retention", "mamba-checkpoint")


@pytest.fixture(autouse=True)
def keep_none_hash() -> Iterator[None]:
    """The kit sets the process-wide NONE_HASH per sequence; restore it after."""
    saved = kcu.NONE_HASH
    yield
    kcu.NONE_HASH = saved


def first_difference(stats: Stats | None = None) -> str | None:
    """The first sequence (of ``SEQUENCES`` per family) where kvcache-0.33 and
    spec-0.33 differ, described; None if they agree on all of them."""
    for name in FAMILY_NAMES:
        family, index = FAMILIES[name], list(FAMILIES).index(name)
        for i in range(SEQUENCES):
            result = run_sequence(
                family_seed(7, index, i), family, "kvcache-0.33", "spec-0.33",
                Stats() if stats is None else stats,
            )
            if result.cannot_build is not None and both_refuse(
                result, "kvcache-0.33", "spec-0.33"
            ):
                continue
            if result.mismatch is not None or result.cannot_build is not None:
                return f"{name} seed {result.seed}: {result.mismatch or result.cannot_build}"
    return None


# ---------------------------------------------------------------- the bugs

ORIGINAL_POSITION = MambaManager._prefill_checkpoint
ORIGINAL_COUNT = MambaManager.get_num_blocks_to_allocate
ORIGINAL_ALLOCATE = MambaManager.allocate_new_blocks
ORIGINAL_POP = MambaManager.pop_blocks_for_free
ORIGINAL_COORDINATOR_COUNT = KVCacheCoordinator.get_num_blocks_to_allocate


def checkpoint_one_hash_block_early(
    self: MambaManager, request_id: str, query_start: int, query_end: int, prefill_end: int
) -> int:
    """The checkpoint is placed one hash block before the reusable boundary."""
    position = ORIGINAL_POSITION(self, request_id, query_start, query_end, prefill_end)
    hash_block_size = self.block_pool.hash_block_size
    return position - hash_block_size if position > hash_block_size else position


def checkpoint_not_counted_at_admission(
    self: MambaManager, request_id: str, *args: Any, **kwargs: Any
) -> int:
    """The admission estimate (``apply_admission_cap``) leaves the checkpoint's block out."""
    admission = kwargs.get("apply_admission_cap", args[4] if len(args) > 4 else False)
    if not admission or not self.has_prefill_checkpoint_blocks:
        return ORIGINAL_COUNT(self, request_id, *args, **kwargs)
    self.has_prefill_checkpoint_blocks = False
    try:
        return ORIGINAL_COUNT(self, request_id, *args, **kwargs)
    finally:
        self.has_prefill_checkpoint_blocks = True


def stale_checkpoint_kept(self: MambaManager, request_id: str, *args: Any, **kwargs: Any) -> int:
    """A chunk without a checkpoint keeps the previous chunk's reservation."""
    stale = self._checkpoints.get(request_id)
    count = ORIGINAL_COUNT(self, request_id, *args, **kwargs)
    if stale is not None and request_id not in self._checkpoints:
        self._checkpoints[request_id] = stale
    return count


def checkpoint_keeps_old_keys(
    self: MambaManager, request: Any, checkpoint: tuple[int, int], retention_interval: int | None
) -> Any:
    """The checkpoint block is keyed at the checkpoint, but the keys it had (the
    full-block key just given to its column covers a later state than the one
    written there) are never dropped, for a transient checkpoint either."""
    pool = self.block_pool
    pool._evict = lambda block: False  # type: ignore[method-assign]
    try:
        return ORIGINAL_CHECKPOINT_STATE(self, request, checkpoint, retention_interval)
    finally:
        del pool._evict


def transient_checkpoint_keeps_keys(
    self: MambaManager, request: Any, checkpoint: tuple[int, int], retention_interval: int | None
) -> Any:
    """A checkpoint no lookup can reuse (the next chunk overwrites its block) keeps
    the block's full-block key instead of dropping it."""
    pool = self.block_pool
    pool._maybe_evict_cached_block = lambda block: False  # type: ignore[method-assign]
    try:
        return ORIGINAL_CHECKPOINT_STATE(self, request, checkpoint, retention_interval)
    finally:
        del pool._maybe_evict_cached_block


ORIGINAL_CHECKPOINT_STATE = MambaManager._cache_checkpoint_state


def prefill_end_ignored(self: KVCacheCoordinator, *args: Any, **kwargs: Any) -> int:
    """Under latest-only retention every chunk may reserve a checkpoint, not only
    the one reaching the prefill's end."""
    kwargs["prefill_end"] = 0
    return ORIGINAL_COORDINATOR_COUNT(self, *args, **kwargs)


def freeing_keeps_offers(self: MambaManager, request_id: str) -> list[Any]:
    """Freeing a request leaves its pending boundary-state offloads (and its own
    partial prompt-tail state) behind: the connector is then offered blocks the
    pool may already have handed to another request."""
    tail = self._producer_partial_tail_reqs.get(request_id)
    pending = list(self._pending_boundary_state_offloads)
    blocks = ORIGINAL_POP(self, request_id)
    if tail is not None:
        self._producer_partial_tail_reqs[request_id] = tail
    self._pending_boundary_state_offloads = pending
    return blocks


def freeing_keeps_checkpoint(self: MambaManager, request_id: str) -> list[Any]:
    """Freeing a request leaves its prefill checkpoint reservation behind."""
    checkpoint = self._checkpoints.get(request_id)
    blocks = ORIGINAL_POP(self, request_id)
    if checkpoint is not None:
        self._checkpoints[request_id] = checkpoint
    return blocks


def relocation_moves_checkpoint_column(
    self: MambaManager, request_id: str, num_tokens: int, num_tokens_main_model: int
) -> list[Any]:
    """Moving last step's speculative blocks up ignores the checkpoint: a
    speculative block sitting in the checkpoint's column moves too (nulling it),
    and a fresh block is taken for the column's slot at the table's end."""
    blocks = self.req_to_blocks[request_id]
    checkpoint = self._checkpoints.get(request_id)
    num_spec = self.num_speculative_blocks
    if (
        checkpoint is None
        or not num_spec
        or request_id not in self._allocated_block_reqs
        or request_id in self._partial_hit_reqs
        or self.mamba_cache_mode != "align"
    ):
        return ORIGINAL_ALLOCATE(self, request_id, num_tokens, num_tokens_main_model)
    column = checkpoint[1]
    prev_len = len(blocks)
    if not prev_len - num_spec <= column < prev_len:
        return ORIGINAL_ALLOCATE(self, request_id, num_tokens, num_tokens_main_model)
    # As the original, but the relocation loop stops at the skipped blocks' end
    # (the running state's column), not one short of it.
    num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
    self.last_state_block_idx[request_id] = prev_len - 1 - num_spec
    num_skipped = num_required - num_spec - 1
    if prev_len < num_skipped - 1:
        blocks.extend([self._null_block] * (num_skipped - 1 - prev_len))
    for idx in range(prev_len - num_spec, prev_len):
        if idx >= num_skipped:
            break
        self._relocate_speculative_block(blocks, idx)
    num_new = max(num_required - len(blocks), 0)
    blocks.extend(self.block_pool.get_new_blocks(num_new))
    return blocks[prev_len:]


ORIGINAL_CACHE = MambaManager.cache_blocks


def offload_misses_retained_block(self: MambaManager, request: Any, *args: Any) -> None:
    """Of the states one ``cache_blocks`` call caches, only the newest is offered to
    the connector: an earlier block the retention keeps in the same call is not."""
    num_before = len(self._pending_boundary_state_offloads)
    ORIGINAL_CACHE(self, request, *args)
    pending = self._pending_boundary_state_offloads
    if len(pending) - num_before > 1:
        del pending[num_before:-1]


def offload_names_the_source(
    self: MambaManager, request_id: str, num_tokens: int, num_tokens_main_model: int
) -> list[Any]:
    """A running request's own prompt-tail state moved to its copy is offered in
    the block it leaves (the copy's source), not in the copy."""
    num_offers, num_copies = len(self._pending_boundary_state_offloads), len(
        self._pending_cow_copies
    )
    blocks = ORIGINAL_ALLOCATE(self, request_id, num_tokens, num_tokens_main_model)
    sources = {copy.block_id: src for src, copy in self._pending_cow_copies[num_copies:]}
    pending = self._pending_boundary_state_offloads
    for i in range(num_offers, len(pending)):
        rid, group_id, block, tokens = pending[i]
        if block.block_id in sources:
            pending[i] = (rid, group_id, sources[block.block_id], tokens)
    return blocks


def finalize_ignores_in_flight(
    self: MambaManager, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
) -> Any:
    """A finishing request's partial prompt-tail state is handed over even while
    tokens scheduled into its block are still in flight."""
    return ORIGINAL_FINALIZE(self, request_id, num_computed_tokens, 0)


ORIGINAL_FINALIZE = MambaManager.finalize_partial_tail_offload

BUGS: dict[str, tuple[type, str, Callable[..., Any]]] = {
    # name: (class, method, replacement)
    "checkpoint_one_hash_block_early": (
        MambaManager, "_prefill_checkpoint", checkpoint_one_hash_block_early
    ),
    "checkpoint_not_counted_at_admission": (
        MambaManager, "get_num_blocks_to_allocate", checkpoint_not_counted_at_admission
    ),
    "stale_checkpoint_kept": (MambaManager, "get_num_blocks_to_allocate", stale_checkpoint_kept),
    "checkpoint_keeps_old_keys": (
        MambaManager, "_cache_checkpoint_state", checkpoint_keeps_old_keys
    ),
    "transient_checkpoint_keeps_keys": (
        MambaManager, "_cache_checkpoint_state", transient_checkpoint_keeps_keys
    ),
    "prefill_end_ignored": (KVCacheCoordinator, "get_num_blocks_to_allocate", prefill_end_ignored),
    "freeing_keeps_offers": (MambaManager, "pop_blocks_for_free", freeing_keeps_offers),
    "freeing_keeps_checkpoint": (MambaManager, "pop_blocks_for_free", freeing_keeps_checkpoint),
    "offload_misses_retained_block": (
        MambaManager, "cache_blocks", offload_misses_retained_block
    ),
    "offload_names_the_source": (MambaManager, "allocate_new_blocks", offload_names_the_source),
    "finalize_ignores_in_flight": (
        MambaManager, "finalize_partial_tail_offload", finalize_ignores_in_flight
    ),
    "relocation_moves_checkpoint_column": (
        MambaManager, "allocate_new_blocks", relocation_moves_checkpoint_column
    ),
}


#: Bugs no scheduler sequence can show, with the unit tests that catch them instead.
#: A checkpoint left behind by ``free`` is only a leak: the request's next sizing
#: (every allocation sizes first) records or drops its checkpoint before anything
#: reads it. A partial prompt-tail state exists only from the chunk ending at it
#: until the request's next allocation (which moves it to a copy) or its end, so a
#: request finishing with one is rare (about one sequence in 100 reaches it).
UNIT_CAUGHT: dict[str, tuple[Callable[[], object], ...]] = {
    "freeing_keeps_checkpoint": tuple(
        functools.partial(unit.test_checkpoints_follow_vllm_0_33, name)
        for name in sorted(unit.CASES)
    ),
    "finalize_ignores_in_flight": (
        functools.partial(unit.test_partial_tail_offload_waits_for_in_flight_tokens, 1, []),
    ),
}


# ---------------------------------------------------------------- the tests


def test_unpatched_kvcache_agrees_with_the_spec() -> None:
    """No difference unpatched, on sequences that reach what the bugs break: chunks
    with a checkpoint inside, copies of a partial prompt tail, offloads offered."""
    stats = Stats()
    assert first_difference(stats) is None
    reached = {path: stats.events[path] for path in REACHED}
    assert all(reached.values()), reached
    for tests in UNIT_CAUGHT.values():
        assert unit_failure(*tests) is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_checkpoint_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, method, replacement = BUGS[bug]
    monkeypatch.setattr(cls, method, replacement)
    if bug in UNIT_CAUGHT:
        error = timed_catch(bug, lambda: unit_failure(*UNIT_CAUGHT[bug]))
        assert error is not None, f"{bug}: no unit test fails"
        return
    difference = timed_catch(bug, lambda: None if (d := first_difference()) is None
                             else AssertionError(d))
    assert difference is not None, f"{bug}: no sequence differs from the spec"
