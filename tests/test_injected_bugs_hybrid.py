"""The hybrid stateful machine has teeth: hybrid bugs planted in kvcache are caught.

As ``tests/test_injected_bugs.py``, for ``HybridMachine``
(``tests/stateful/test_hybrid_machine.py``): every test monkeypatches one
kvcache method with a small buggy version written here, replays the machine's
directed programs and runs it on a fixed budget (``tests/injected_harness.py``),
and expects a failure; the control runs the same unpatched and must pass. Each
bug here fails one of the directed programs (a situation the budget reaches
only by luck, if at all), whatever the budget draws.
Nothing in kvcache/ or spec/ is edited.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from injected_harness import budget, machine_failure, raised_in, timed_catch
from stateful.test_hybrid_machine import PROGRAMS, HybridMachine

from kvcache import (
    FullAttentionSpec,
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)

# The machine's directed programs, then the same examples for every test and
# every run (tests/injected_harness.py).
BUDGET = budget(max_examples=200)
DIRECTED = [PROGRAMS[name] for name in sorted(PROGRAMS)]


def hybrid_machine_failure() -> BaseException | None:
    return machine_failure(HybridMachine, BUDGET, DIRECTED)


@pytest.fixture(scope="module")
def control_failure() -> BaseException | None:
    """The unpatched machine's outcome (run once per module)."""
    return hybrid_machine_failure()


# ---------------------------------------------------------------- the bugs


def interleaved_computed_blocks(
    self: KVCacheCoordinator,
    request_id: str,
    new_computed_blocks: tuple[Sequence[Any], ...],
    num_local_computed_tokens: int,
    num_external_computed_tokens: int,
    skip_zeroing_group_ids: Sequence[int] = (),
) -> None:
    """Touches hits and allocates external blocks group by group, so one group's
    external allocation can evict another group's hits not yet touched."""
    managers = self.single_type_managers
    if any(request_id in m.num_cached_block for m in managers):
        return
    for i, manager in enumerate(managers):
        manager.add_local_computed_blocks(
            request_id,
            new_computed_blocks[i],
            num_local_computed_tokens,
            num_external_computed_tokens,
        )
        if num_external_computed_tokens > 0:
            manager.allocate_external_computed_blocks(
                request_id,
                num_local_computed_tokens,
                num_external_computed_tokens,
                i not in skip_zeroing_group_ids,
            )


def window_skip_off_by_one(self: SlidingWindowManager, num_computed_tokens: int) -> int:
    """Skips one token too many: frees a block the next token still attends to."""
    return max(0, num_computed_tokens - self.sliding_window + 2)


def single_pass_cache_hit(
    self: HybridKVCacheCoordinator, block_hashes: list[Any], max_cache_hit_length: int
) -> tuple[tuple[list[Any], ...], int]:
    """kvcache's fixed point, except that it stops after the first pass even
    when a later kind shortened the hit that earlier (non-full) kinds found."""
    hit_length = max_cache_hit_length
    longest_hit_length = 0
    hit_blocks_by_group: list[list[Any] | None] = [None] * len(self.kv_cache_config.kv_cache_groups)
    eagle_verified: set[int] = set()
    while True:
        curr_hit_length = hit_length
        for idx, (spec, group_ids, manager_cls, use_eagle) in enumerate(self.attention_groups):
            if (
                isinstance(spec, FullAttentionSpec)
                and hit_blocks_by_group[group_ids[0]] is not None
            ):
                curr_hit_length = curr_hit_length // spec.block_size * spec.block_size
                continue
            drop_eagle_block = use_eagle and idx not in eagle_verified
            max_length = curr_hit_length
            if drop_eagle_block:
                max_length = min(curr_hit_length + spec.block_size, max_cache_hit_length)
            hit_blocks = manager_cls.find_longest_cache_hit(
                block_hashes=self._block_hashes_for(block_hashes, spec),
                max_length=max_length,
                kv_cache_group_ids=group_ids,
                block_pool=self.block_pool,
                kv_cache_spec=spec,
                drop_eagle_block=drop_eagle_block,
                alignment_tokens=self.scheduler_block_size,
            )
            new_hit_length = len(hit_blocks[0]) * spec.block_size
            if drop_eagle_block:
                eagle_verified.add(idx)
            elif new_hit_length < curr_hit_length:
                eagle_verified.clear()  # a shorter candidate must be re-verified
            curr_hit_length = new_hit_length
            for group_id, blocks in zip(group_ids, hit_blocks, strict=True):
                hit_blocks_by_group[group_id] = blocks
            longest_hit_length = max(longest_hit_length, curr_hit_length)
        if curr_hit_length >= hit_length:
            break
        hit_length = curr_hit_length
        break  # BUG: was `if is_simple_hybrid: break`
    first = self.attention_groups[0]
    if isinstance(first.spec, FullAttentionSpec):
        num_blocks = hit_length // first.spec.block_size
        for group_id in first.group_ids:
            full_blocks = hit_blocks_by_group[group_id]
            if full_blocks is not None:
                del full_blocks[num_blocks:]
    self.num_uncached_common_prefix_tokens = longest_hit_length - hit_length
    return tuple(b if b is not None else [] for b in hit_blocks_by_group), hit_length


def mamba_keeping_previous_state(
    self: MambaManager,
    request_id: str,
    total_computed_tokens: int,
    num_prompt_tokens: int | None = None,
) -> None:
    """Align mode frees no old state (they leak until the request is freed)."""
    if self.mamba_cache_mode == "align":
        return
    num_computed_tokens = max(0, total_computed_tokens - self.num_speculative_blocks)
    SingleTypeKVCacheManager.remove_skipped_blocks(
        self, request_id, num_computed_tokens, num_prompt_tokens
    )


_swa_mask = SlidingWindowManager.reachable_block_mask
_mamba_mask = MambaManager.reachable_block_mask


def swa_replay_tail_uncapped(
    cls: type[SlidingWindowManager],
    start_block: int,
    end_block: int,
    alignment_tokens: int | None,
    kv_cache_spec: Any,
    use_eagle: bool,
    retention_interval: int | None = None,
    num_prompt_tokens: int | None = None,
) -> list[bool] | None:
    """Sparse retention keeps the window before the prompt's end, forgetting that a
    replay's hit stops one token short: a segment late when the prompt is aligned."""
    if num_prompt_tokens is not None:
        num_prompt_tokens += 1
    return _swa_mask(
        start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
        retention_interval, num_prompt_tokens,
    )  # fmt: skip


def mamba_states_one_block_early(
    cls: type[MambaManager],
    start_block: int,
    end_block: int,
    alignment_tokens: int | None,
    kv_cache_spec: Any,
    use_eagle: bool,
    retention_interval: int | None = None,
    num_prompt_tokens: int | None = None,
) -> list[bool] | None:
    """Sparse retention keeps the state one block before each interval boundary."""
    if not retention_interval:
        return _mamba_mask(
            start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
            retention_interval, num_prompt_tokens,
        )  # fmt: skip
    early = _mamba_mask(
        start_block + 1, end_block + 1, alignment_tokens, kv_cache_spec, use_eagle,
        retention_interval,
    )  # fmt: skip
    replay = _mamba_mask(
        start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle, 0, num_prompt_tokens
    )
    if early is None or replay is None:
        return early
    return [a or b for a, b in zip(early, replay, strict=True)]


BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "external allocation interleaved with hits per group": lambda mp: mp.setattr(
        KVCacheCoordinator, "allocate_new_computed_blocks", interleaved_computed_blocks
    ),
    "sliding window frees a block inside the window": lambda mp: mp.setattr(
        SlidingWindowManager, "get_num_skipped_tokens", window_skip_off_by_one
    ),
    "cache-hit fixed point stops after one pass": lambda mp: mp.setattr(
        HybridKVCacheCoordinator, "find_longest_cache_hit", single_pass_cache_hit
    ),
    "Mamba align keeps the previous state": lambda mp: mp.setattr(
        MambaManager, "remove_skipped_blocks", mamba_keeping_previous_state
    ),
    "retention's replay tail ignores the num_prompt - 1 cap": lambda mp: mp.setattr(
        SlidingWindowManager, "reachable_block_mask", classmethod(swa_replay_tail_uncapped)
    ),
    "Mamba retention keeps states one block early": lambda mp: mp.setattr(
        MambaManager, "reachable_block_mask", classmethod(mamba_states_one_block_early)
    ),
}


def test_unpatched_hybrid_machine_passes_the_budget(
    control_failure: BaseException | None,
) -> None:
    assert control_failure is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_hybrid_machine_catches(
    bug: str, monkeypatch: pytest.MonkeyPatch, control_failure: BaseException | None
) -> None:
    if control_failure is not None:
        pytest.fail(f"the unpatched machine fails already: {control_failure!r}")
    BUGS[bug](monkeypatch)
    error = timed_catch(bug, lambda: hybrid_machine_failure())
    assert error is not None, f"the machine missed: {bug}"
    # A failure inside spec would be the machine's or the oracle's fault, not a catch;
    # one in the replay itself, a program gone astray (its steps or targets).
    assert "/spec/" not in raised_in(error), f"{bug}: spec raised {error!r}"
    assert not raised_in(error).endswith("programs.py"), f"{bug}: {error!r}"
