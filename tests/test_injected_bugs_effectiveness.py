"""Silent prefix-cache losses that equality cannot see, caught by the effectiveness rules.

Each bug below is planted in *both* kvcache and the spec (a misunderstanding written
twice agrees with itself), so kvcache still equals the spec call for call. It
silently shortens a lookup's hit (or, the last one, never caches a state a lookup
needs). What catches it is the effectiveness judge
(``spec.effectiveness``): the stateful machine judges every lookup against what the
spec's pool could serve (``ManagerMachine.judge_lookup``), and the scenario suite
(``kvcache.kit.effectiveness.run_suite``, what ``python -m kvcache effectiveness``
runs) flags the lookups of kvcache alone. Each bug breaks a different named rule; the
control runs both catchers unpatched and they must pass. The write-side bug (a
retention that drops the replay tail) is planted in kvcache alone and caught by the
suite, whose judge sees what each request computed (the machine judges lookups only).

The bugs act on a lookup's result (one full-attention group, as the manager machine
and the suite's ``full`` family build), so one statement serves both sides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from injected_harness import budget, catch_by_all, machine_failure
from stateful.test_manager_machine import ManagerMachine

import kvcache
import kvcache.kv_cache_math as kv_cache_math
import spec
from kvcache.kit.effectiveness import run_suite

BUDGET = budget(max_examples=150)

#: A bug: (manager, request, hit tokens, tokens per block) -> the shorter hit it keeps.
Bug = Callable[[Any, Any, int, int], int]


def eagle_drop_twice(manager: Any, request: Any, hit: int, block: int) -> int:
    """EAGLE's dropped block dropped again (an off-by-one in the drop)."""
    return hit - block if manager.use_eagle else hit


def last_token_off_by_one(manager: Any, request: Any, hit: int, block: int) -> int:
    """Hits capped at ``num_tokens - 2``: one token more recomputed than the logits need."""
    return min(hit, (request.num_tokens - 2) // block * block)


def alignment_doubled(manager: Any, request: Any, hit: int, block: int) -> int:
    """Hits rounded down to two blocks, not one."""
    return hit // (2 * block) * (2 * block)


def salted_requests_skip_the_cache(manager: Any, request: Any, hit: int, block: int) -> int:
    """A request with a cache salt (or a LoRA) treated as one that reads no cache."""
    salted = getattr(request, "cache_salt", None) or getattr(request, "lora_request", None)
    return 0 if salted else hit


BUGS: dict[str, tuple[Bug, str]] = {
    "EAGLE drop applied twice": (eagle_drop_twice, "eagle"),
    "last token off by one": (last_token_off_by_one, ""),
    "hits aligned to two blocks": (alignment_doubled, ""),
    "salted requests skip the cache": (salted_requests_skip_the_cache, "salt"),
}


def planted(bug: Bug, lookup: Callable[..., Any]) -> Callable[..., Any]:
    """``get_computed_blocks`` whose hit ``bug`` shortens, to whole blocks."""

    def get_computed_blocks(self: Any, request: Any) -> Any:
        blocks, hit = lookup(self, request)
        if not hit:
            return blocks, hit
        size = hit // len(blocks.blocks[0])
        kept = max(0, bug(self, request, hit, size)) // size
        if kept == 0:
            return self.empty_kv_cache_blocks, 0
        trimmed = tuple(list(group[:kept]) for group in blocks.blocks)
        return dataclasses.replace(blocks, blocks=trimmed), kept * size

    return get_computed_blocks


def plant(monkeypatch: pytest.MonkeyPatch, bug: Bug, *classes: type) -> None:
    for cls in classes:
        monkeypatch.setattr(cls, "get_computed_blocks", planted(bug, cls.get_computed_blocks))


def machine_catch() -> BaseException | None:
    """The manager machine (kvcache against the spec) on a fixed budget."""
    return machine_failure(ManagerMachine, BUDGET)


def suite_catch(feature: str) -> Callable[[], BaseException | None]:
    """The scenario suite on kvcache's ``full`` family: an error if any row is flagged.
    The salt bug needs salted requests, which the suite does not draw: only the
    machine judges it."""

    def catch() -> BaseException | None:
        flagged = [row for row in run_suite("kvcache", ["full"]) if row.flags]
        if flagged:
            return AssertionError(f"flagged: {[(r.scenario, r.eagle, r.flags) for r in flagged]}")
        return None

    return catch


@pytest.mark.parametrize("name", sorted(BUGS))
def test_silent_loss_shared_by_both_sides_is_caught(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bug, feature = BUGS[name]
    plant(monkeypatch, bug, spec.KVCacheManager, kvcache.KVCacheManager)
    catchers = [machine_catch] + ([] if feature == "salt" else [suite_catch(feature)])
    error = catch_by_all(name, catchers)
    assert error is not None and "loss" in str(error), error


def test_control_without_a_bug_passes() -> None:
    assert machine_catch() is None
    assert suite_catch("")() is None


# ------------------------------------------------- the write side: what was never kept

_retention_mask = kv_cache_math.mamba_retention_mask


def replay_tail_dropped(
    start_block: int, end_block: int, block_size: int, alignment_tokens: int,
    retention_interval: int, boundaries: Sequence[int],
) -> list[bool] | None:
    """A sparse Mamba retention that keeps no replay boundary: the prompt's tail
    state, the one a repeat resumes at, is never cached."""
    return _retention_mask(start_block, end_block, block_size, alignment_tokens,
                           retention_interval, ())  # fmt: skip


def retention_catch() -> BaseException | None:
    """The scenario suite on kvcache, full + align-mode Mamba, retention unset / 0 / 2
    blocks, EAGLE off (with EAGLE, vLLM 0.25.1's own retention flaw is flagged: it
    keeps the boundary before EAGLE's drop, ``bug-retention-eagle-replay-boundary``):
    an error if any row is flagged."""
    rows = run_suite("kvcache", ["full+mamba-align"], ["repeat", "multi_turn"],
                     lookaheads=["none"])  # fmt: skip
    flagged = [row for row in rows if row.flags and not row.eagle]
    if flagged:
        return AssertionError(f"flagged: {[(r.scenario, r.retention, r.flags) for r in flagged]}")
    return None


def test_a_retention_tail_not_kept_is_caught_on_the_write_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lookup has nothing to lose (the pool never held the state), so only the
    write side sees it: the state at the replay boundary was computed, and the
    retention rule keeps that boundary. The control (no bug) passes."""
    assert retention_catch() is None
    monkeypatch.setattr(kv_cache_math, "mamba_retention_mask", replay_tail_dropped)
    error = catch_by_all("retention tail not kept", [retention_catch])
    assert error is not None and "unexplained loss" in str(error), error
