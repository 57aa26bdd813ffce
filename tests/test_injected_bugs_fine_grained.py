"""The 0.33.0 check of fine-grained hits has teeth: bugs planted in kvcache are caught.

``tests/conformance/test_profile_0_33.py`` holds kvcache's 0.33.0 profile to the
spec's on the kit's random scheduler sequences, among them the Mamba 'align'
families where vLLM 0.33.0 turns on fine-grained (sub-block) hits
(``mamba_fine_grained_hits``) and copies partial hits on write
(``partial_hit_copy_on_write``), the driver taking the copies and releasing the
blocks they retain as 0.33.0's scheduler does. Each test here monkeypatches one kvcache method
with a small buggy version written here (as ``tests/test_injected_bugs*.py`` do)
and expects the same comparison to find a sequence that differs; the control runs
the same seeds unpatched and must agree on every one. Nothing in kvcache/ or spec/
is edited. Pure-Python build only (the compiled classes cannot be patched).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache import FullAttentionManager, MambaManager, SingleTypeKVCacheManager
from kvcache.kit.conformance import both_refuse, family_seed
from kvcache.kit.driver import FAMILIES, Stats, run_sequence
from kvcache.vllm_0_33 import KVCacheManager as DropInManager

pytestmark = pytest.mark.skipif(
    __import__("kvcache").COMPILED, reason="monkeypatching needs the pure-Python classes"
)

SEQUENCES = 40  # per family; the first difference ends a mutant's run
FAMILY_NAMES = ("full+mamba-align", "eagle-hybrid")


@pytest.fixture(autouse=True)
def keep_none_hash() -> Iterator[None]:
    """The kit sets the process-wide NONE_HASH per sequence; restore it after."""
    saved = kcu.NONE_HASH
    yield
    kcu.NONE_HASH = saved


def first_difference() -> str | None:
    """The first sequence (of ``SEQUENCES`` per family) where kvcache-0.33 and
    spec-0.33 differ, described; None if they agree on all of them."""
    for name in FAMILY_NAMES:
        family, index = FAMILIES[name], list(FAMILIES).index(name)
        for i in range(SEQUENCES):
            result = run_sequence(
                family_seed(7, index, i), family, "kvcache-0.33", "spec-0.33", Stats()
            )
            if result.cannot_build is not None and both_refuse(
                result, "kvcache-0.33", "spec-0.33"
            ):
                continue
            if result.mismatch is not None or result.cannot_build is not None:
                return f"{name} seed {result.seed}: {result.mismatch or result.cannot_build}"
    return None


# ---------------------------------------------------------------- the bugs


def full_hit_ignores_sub_block(
    cls: type[FullAttentionManager],
    block_hashes: Sequence[Any],
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: Any,
    kv_cache_spec: Any,
    drop_eagle_block: bool,
    hash_block_size: int,
) -> tuple[tuple[list[Any], ...], int]:
    """Full attention finds whole cached blocks only: a partial entry inside the
    next block is never a hit (the EAGLE drop of one hash block is kept)."""
    block_size = kv_cache_spec.block_size
    scale = block_size // hash_block_size
    hits: tuple[list[Any], ...] = tuple([] for _ in kv_cache_group_ids)
    for i in range(min(max_length // block_size, len(block_hashes) // scale)):
        cached = block_pool.get_cached_block(block_hashes[(i + 1) * scale - 1], kv_cache_group_ids)
        if cached is None:
            break
        for group_hits, block in zip(hits, cached, strict=True):
            group_hits.append(block)
    length = len(hits[0]) * block_size
    if drop_eagle_block and length:
        length -= hash_block_size
    num_blocks = -(-length // block_size)
    for group_hits in hits:
        del group_hits[num_blocks:]
    return hits, length


def mamba_hit_on_block_ends_only(
    cls: type[MambaManager],
    block_hashes: Sequence[Any],
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: Any,
    kv_cache_spec: Any,
    drop_eagle_block: bool,
    hash_block_size: int,
) -> tuple[tuple[list[Any], ...], int]:
    """Mamba probes only the states ending on a block boundary: a state keyed inside
    a block (the prompt tail's partial entry) is never hit."""
    scale = kv_cache_spec.block_size // hash_block_size
    for i in range(min(max_length // hash_block_size, len(block_hashes)) - 1, -1, -1):
        if (i + 1) % scale:
            continue
        cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
        if cached is not None:
            nulls = [block_pool.null_block] * (i // scale)
            return tuple([*nulls, b] for b in cached), (i + 1) * hash_block_size
    return tuple([] for _ in kv_cache_group_ids), 0


def never_a_partial_hit(
    self: SingleTypeKVCacheManager, new_computed_blocks: Sequence[Any], num_local: int
) -> bool:
    """A hit ending inside a block is taken as is: no copy, no extra block."""
    return False


def copy_left_out_of_table(
    self: SingleTypeKVCacheManager, request_id: str, block_idx: int, source: Any, copy: Any
) -> None:
    """The copy is queued, but the request keeps writing into the shared hit block."""
    self._pending_cow_copies.append((source, copy))
    copy.ref_cnt += 1
    self.req_to_blocks[request_id].append(copy)


def tail_state_only_on_block_ends(
    self: MambaManager, request: Any, num_tokens: int
) -> Any:
    """Mamba keys its prompt-tail state only when it ends on a block boundary."""
    if num_tokens % self.block_size:
        return None
    return ORIGINAL_TAIL(self, request, num_tokens)


ORIGINAL_TAIL = MambaManager._cache_prompt_tail_state


def retained_hit_never_released(self: DropInManager) -> tuple[list[Any], list[Any]]:
    """The copies are handed over, but only the copies' blocks as retained: the
    shared hit block's extra reference is never released."""
    copies, retained = ORIGINAL_TAKE(self)
    return copies, retained[1::2]


def retained_released_at_take(self: DropInManager) -> tuple[list[Any], list[Any]]:
    """The manager drops the retentions itself when the copies are taken, before
    the step that runs them: nothing is left for the caller to release."""
    copies, retained = ORIGINAL_TAKE(self)
    self.block_pool.free_blocks(retained)
    return copies, []


ORIGINAL_TAKE = DropInManager.take_kv_cache_block_copies

BUGS: dict[str, tuple[type, str, Callable[..., Any], bool]] = {
    # name: (class, method, replacement, is a classmethod)
    "full_hit_ignores_sub_block": (
        FullAttentionManager, "find_fine_grained_hit", full_hit_ignores_sub_block, True
    ),
    "mamba_hit_on_block_ends_only": (
        MambaManager, "find_fine_grained_hit", mamba_hit_on_block_ends_only, True
    ),
    "never_a_partial_hit": (
        SingleTypeKVCacheManager, "_has_partial_local_hit", never_a_partial_hit, False
    ),
    "copy_left_out_of_table": (
        SingleTypeKVCacheManager, "_copy_partial_hit", copy_left_out_of_table, False
    ),
    "tail_state_only_on_block_ends": (
        MambaManager, "_cache_prompt_tail_state", tail_state_only_on_block_ends, False
    ),
    "retained_hit_never_released": (
        DropInManager, "take_kv_cache_block_copies", retained_hit_never_released, False
    ),
    "retained_released_at_take": (
        DropInManager, "take_kv_cache_block_copies", retained_released_at_take, False
    ),
}


# ---------------------------------------------------------------- the tests


def test_unpatched_kvcache_agrees_with_the_spec() -> None:
    assert first_difference() is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_fine_grained_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, method, replacement, is_classmethod = BUGS[bug]
    monkeypatch.setattr(cls, method, classmethod(replacement) if is_classmethod else replacement)
    difference = first_difference()
    assert difference is not None, f"{bug}: no sequence differs from the spec"
