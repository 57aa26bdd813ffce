"""Bugs planted in the R-SWA and sink managers are caught, every run.

Each test monkeypatches one kvcache method with a small buggy version written
here and runs the directed tests that must catch it (timed by
``tests/injected_harness.py``): the vLLM 0.25.1 comparisons of
``tests/unit/test_rswa_sink.py`` (seeded manager walks, the sink manager's
construction) and, for R-SWA, the hybrid machine's directed program "an R-SWA
request decodes past its window" (kvcache against spec, no vLLM), and
``KindManagerMachine`` (``tests/stateful/test_kind_managers_machine.py``) on a
pinned budget (``injected_harness.budget``: the same examples every run). The control
runs the same tests unpatched, and they must pass. Nothing in kvcache/ or spec/
is edited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from injected_harness import budget, catch_by_all, machine_failure, unit_failure
from stateful.programs import replay
from stateful.test_hybrid_machine import PROGRAMS, HybridMachine
from stateful.test_kind_managers_machine import KindManagerMachine
from unit import test_rswa_sink as kinds

from kvcache import RSWAManager, SinkFullAttentionManager, kv_cache_math

pytestmark = pytest.mark.usefixtures("vllm_reference")

# ---------------------------------------------------------------- the bugs


def _release(manager: RSWAManager, request_id: str, first: int, last: int) -> None:
    """Release the live blocks of ``[first, last)`` as the real method does."""
    blocks = manager.req_to_blocks.get(request_id)
    if blocks is None:
        return
    start, stop = kv_cache_math.gap_blocks_to_free(blocks, manager._null_block, first, last)
    if start < stop:
        manager.block_pool.release_blocks(blocks[start:stop][::-1])
        blocks[start:stop] = [manager._null_block] * (stop - start)


def gap_from_prompt_tail(
    self: RSWAManager, request_id: str, total_computed_tokens: int, num_prompt_tokens: Any = None
) -> None:
    """The gap starts at the block holding the prompt's last token (floor, not ceil)."""
    if num_prompt_tokens is None:
        return
    window_start = max(num_prompt_tokens, total_computed_tokens - self.rswa_window)
    first = num_prompt_tokens // self.block_size  # BUG: was cdiv
    _release(self, request_id, first, window_start // self.block_size)


def window_one_token_short(
    self: RSWAManager, request_id: str, total_computed_tokens: int, num_prompt_tokens: Any = None
) -> None:
    """The window keeps ``rswa_window - 1`` tokens: frees a block it still reads."""
    if num_prompt_tokens is None:
        return
    window_start = max(num_prompt_tokens, total_computed_tokens - self.rswa_window + 1)
    first = kv_cache_math.cdiv(num_prompt_tokens, self.block_size)
    _release(self, request_id, first, window_start // self.block_size)


def gap_without_prompt_length(
    self: RSWAManager, request_id: str, total_computed_tokens: int, num_prompt_tokens: Any = None
) -> None:
    """Without the prompt length, treats the prompt as empty (vLLM frees nothing)."""
    num_prompt_tokens = num_prompt_tokens or 0
    window_start = max(num_prompt_tokens, total_computed_tokens - self.rswa_window)
    first = kv_cache_math.cdiv(num_prompt_tokens, self.block_size)
    _release(self, request_id, first, window_start // self.block_size)


_sink_init = SinkFullAttentionManager.__init__


def sinks_from_the_tail(self: SinkFullAttentionManager, *args: Any, **kwargs: Any) -> None:
    """Takes the sink blocks, but from the back of the free queue."""
    _sink_init(self, *args, **kwargs)
    queue = self.block_pool.free_block_queue
    tail = queue.get_all_free_blocks()[-len(self.sink_blocks) :]
    for block in tail:
        queue.remove(block)
    queue.prepend_n(self.sink_blocks)  # the front ones go back
    self.sink_blocks = tail


def one_sink_block_short(self: SinkFullAttentionManager, *args: Any, **kwargs: Any) -> None:
    """Takes one sink block fewer than ``sink_len // block_size``."""
    _sink_init(self, *args, **kwargs)
    self.block_pool.free_block_queue.prepend_n(self.sink_blocks[-1:])
    self.sink_blocks = self.sink_blocks[:-1]


def rswa_program() -> BaseException | None:
    try:
        replay(HybridMachine, PROGRAMS["an R-SWA request decodes past its window"])
    except Exception as error:
        return error
    return None


Catcher = Callable[[], BaseException | None]
MACHINE: Catcher = lambda: machine_failure(KindManagerMachine, budget(100, 40), [])  # noqa: E731
WALKS: Catcher = lambda: unit_failure(kinds.test_rswa_manager_walks_match_vllm)  # noqa: E731
SINKS: Catcher = lambda: unit_failure(kinds.test_sink_manager_takes_its_blocks_as_vllm)  # noqa: E731

# Each bug, and the directed tests that must each catch it.
BUGS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], tuple[Catcher, ...]]] = {
    "R-SWA gap starts in the prompt's last block": (
        lambda mp: mp.setattr(RSWAManager, "remove_skipped_blocks", gap_from_prompt_tail),
        (WALKS, rswa_program, MACHINE),
    ),
    "R-SWA window one token short": (
        lambda mp: mp.setattr(RSWAManager, "remove_skipped_blocks", window_one_token_short),
        (WALKS, rswa_program, MACHINE),
    ),
    "R-SWA frees a gap without the prompt length": (
        lambda mp: mp.setattr(RSWAManager, "remove_skipped_blocks", gap_without_prompt_length),
        (WALKS, MACHINE),
    ),
    "sink blocks taken from the tail of the free queue": (
        lambda mp: mp.setattr(SinkFullAttentionManager, "__init__", sinks_from_the_tail),
        (SINKS, MACHINE),
    ),
    "one sink block short": (
        lambda mp: mp.setattr(SinkFullAttentionManager, "__init__", one_sink_block_short),
        (SINKS, MACHINE),
    ),
}


def test_directed_tests_pass_unpatched() -> None:
    assert WALKS() is None and SINKS() is None and rswa_program() is None
    assert MACHINE() is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_directed_tests_catch(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, catchers = BUGS[bug]
    plant(monkeypatch)
    error = catch_by_all(bug, catchers)
    assert isinstance(error, AssertionError), f"{bug}: {error!r}"
