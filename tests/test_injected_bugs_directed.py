"""Bugs the random search meets only after minutes, caught at once by directed tests.

Each test monkeypatches one kvcache function with a small buggy version written
here (or shares one with ``tests/test_injected_bugs_hybrid.py``) and runs the
directed tests of ``tests/unit/test_fast_kills.py`` and, where one exists, the
hybrid machine's directed program for the situation against it: each must catch
it (timed by ``tests/injected_harness.py``). The control runs the same tests
unpatched, and they must pass. Nothing in kvcache/ or spec/ is edited.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from injected_harness import catch_by_all, unit_failure
from stateful.programs import replay
from stateful.test_hybrid_machine import PROGRAMS, HybridMachine
from test_injected_bugs_hybrid import interleaved_computed_blocks
from unit import test_fast_kills as fast

import kvcache.kv_cache_utils as kv_cache_utils
from kvcache import KVCacheCoordinator, SlidingWindowManager

# ---------------------------------------------------------------- the bugs

_hash_block_tokens = kv_cache_utils.hash_block_tokens
_count = SlidingWindowManager.get_num_blocks_to_allocate


def hash_without_parent(hash_function: Callable[[Any], bytes], parent_block_hash: Any,
                        curr_block_token_ids: Sequence[int],
                        extra_keys: tuple[Any, ...] | None = None) -> Any:
    """Every block hashed as if it were the first: the chain is lost."""
    return _hash_block_tokens(hash_function, None, curr_block_token_ids, extra_keys)


def window_count_always_capped(self: SlidingWindowManager, request_id: str, num_tokens: int,
                               new_computed_blocks: Sequence[Any], total_computed_tokens: int,
                               num_tokens_main_model: int,
                               apply_admission_cap: bool = False,
                               num_local_computed_tokens: int = 0,
                               prefill_end: int = 0) -> int:
    """The window's admission cap applied to every count, not only the admission gate's."""
    return _count(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                  num_tokens_main_model, True, num_local_computed_tokens, prefill_end)


def hybrid_program(name: str) -> BaseException | None:
    """One of the hybrid machine's directed programs (``tests/stateful``)."""
    try:
        replay(HybridMachine, PROGRAMS[name])
    except Exception as error:
        return error
    return None


HASH_TESTS = (fast.test_every_block_hash_chains_over_its_parent,
              fast.test_blocks_completed_by_decode_tokens_chain_to_the_last_hash,
              fast.test_chain_pinned_to_literal_values_for_seed_zero)
WINDOW_TESTS = (fast.test_long_window_admission_takes_what_it_predicts,
                functools.partial(fast.test_long_window_admission_gate_with_no_block_to_spare,
                                  spare=-1))
CONNECTOR_TESTS = (fast.test_every_group_touches_its_hits_before_external_blocks,)

Catcher = Callable[[], BaseException | None]

# Each bug, and the directed tests that must each catch it.
BUGS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], tuple[Catcher, ...]]] = {
    "block hash not chained to its parent": (
        lambda mp: mp.setattr(kv_cache_utils, "hash_block_tokens", hash_without_parent),
        (lambda: unit_failure(*HASH_TESTS),)),
    "sliding-window admission cap applied to every count": (
        lambda mp: mp.setattr(SlidingWindowManager, "get_num_blocks_to_allocate",
                              window_count_always_capped),
        (lambda: unit_failure(*WINDOW_TESTS),
         lambda: hybrid_program("a window admission with hits beyond its cap"))),
    # The same plant as test_injected_bugs_hybrid.py's, caught here by a unit test too.
    "one group's connector blocks allocated before another group touches its hits": (
        lambda mp: mp.setattr(KVCacheCoordinator, "allocate_new_computed_blocks",
                              interleaved_computed_blocks),
        (lambda: unit_failure(*CONNECTOR_TESTS),
         lambda: hybrid_program("one group's external blocks after every group's hits"))),
}


def test_directed_tests_pass_unpatched() -> None:
    assert unit_failure(*HASH_TESTS, *WINDOW_TESTS, *CONNECTOR_TESTS) is None
    for _, catchers in BUGS.values():
        assert all(catch() is None for catch in catchers[1:])


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_directed_tests_catch(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, catchers = BUGS[bug]
    plant(monkeypatch)
    error = catch_by_all(bug, catchers)
    assert isinstance(error, AssertionError), f"{bug}: {error!r}"
