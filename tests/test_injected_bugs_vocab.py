"""Vocabulary bugs planted in kvcache are caught by kvcache-vs-spec alone.

spec computes block hashes, extra keys and events itself (``spec/vocab.py``), so
a slip in kvcache's hashing or event fields shows up against it, with vLLM out of
reach (``sys.modules["vllm"] = None`` during each run). As in
``tests/test_injected_bugs.py``, each test monkeypatches one kvcache function
with a buggy version written here and runs ``ManagerMachine``
(``tests/injected_harness.py``): two directed programs, which reach the
situations at once, then a small pinned budget. The control runs the same
unpatched and must pass. Nothing in kvcache/ or spec/ is edited.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from injected_harness import budget, machine_failure, raised_in, timed_catch
from stateful.programs import Step, tokens
from stateful.test_manager_machine import ManagerMachine

import kvcache.kv_cache_utils as kv_cache_utils
from kvcache import BlockPool

BUDGET = budget(max_examples=10)
MAX_SECONDS = 10  # per catch


def start(**draws: Any) -> Step:
    """init_managers: 2-token blocks, caching on, one first request (its draws)."""
    args = dict(num_blocks=12, block_size=2, enable_caching=True, watermark=0.0,
                use_eagle=False, log_stats=True, max_model_len=20, max_num_batched_tokens=20)
    return Step("init_managers", args, {"num_first_requests": 1, **draws})


# r0: 5 tokens (2 full blocks) with a salt and an image at token 3 (block 1, offset 1).
KEYED_REQUEST = dict(**tokens("tokens", [0, 1, 2, 0, 1]), extra_keys=True, lora="",
                     cache_salt="salt", num_mm=1, mm_offset=3, mm_length=1, mm_id="img-a")
PROGRAMS = [
    # The invariant compares r0's hashes (kvcache's hasher) with spec's at once.
    [start(**KEYED_REQUEST)],
    # r0 is admitted and cached (BlockStored with extra keys), its blocks evicted
    # (BlockRemoved), and the events taken and compared field by field.
    [start(**KEYED_REQUEST),
     Step("get_computed_blocks", {}, {"consider r0": True, "mode": "sync", "whole": True}),
     Step("evict_blocks", {}, {"ids": [1, 2]}),
     Step("take_events")],
]


# ---------------------------------------------------------------- the bugs


def hash_without_parent(original: Callable[..., Any]) -> Callable[..., Any]:
    """Every block hashed as a first block: the chain is lost."""

    def hash_block_tokens(hash_function: Any, parent: Any, *args: Any) -> Any:
        return original(hash_function, None, *args)

    return hash_block_tokens


def salt_on_every_block(original: Callable[..., Any]) -> Callable[..., Any]:
    """The cache salt enters every block's keys, not only the first's."""

    def generate(request: Any, start: int, *args: Any) -> Any:
        keys, mm_idx = original(request, start, *args)
        if start > 0 and request.cache_salt:
            keys = (*(keys or ()), request.cache_salt)
        return keys, mm_idx

    return generate


def mm_offset_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    """A multimodal key loses the item's offset within the block."""

    def gen(*args: Any) -> Any:
        keys, mm_idx = original(*args)
        return [(identifier, 0) for identifier, _ in keys], mm_idx

    return gen


def stored_without_extra_keys(original: Callable[..., None]) -> Callable[..., None]:
    """BlockStored events lose their extra keys."""

    def emit(self: BlockPool, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.kv_event_queue[-1].extra_keys = None

    return emit


def removed_without_group(original: Callable[..., bool]) -> Callable[..., bool]:
    """BlockRemoved events lose their group index."""

    def evict(self: BlockPool, block: Any) -> bool:
        num_events = len(self.kv_event_queue)
        evicted = original(self, block)
        if len(self.kv_event_queue) > num_events:
            self.kv_event_queue[-1].group_idx = None
        return evicted

    return evict


BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "block hash not chained to its parent": lambda mp: mp.setattr(
        kv_cache_utils, "hash_block_tokens", hash_without_parent(kv_cache_utils.hash_block_tokens)
    ),
    "cache salt on every block": lambda mp: mp.setattr(
        kv_cache_utils,
        "generate_block_hash_extra_keys",
        salt_on_every_block(kv_cache_utils.generate_block_hash_extra_keys),
    ),
    "multimodal offset dropped": lambda mp: mp.setattr(
        kv_cache_utils,
        "_gen_mm_extra_hash_keys",
        mm_offset_dropped(kv_cache_utils._gen_mm_extra_hash_keys),
    ),
    "BlockStored without extra keys": lambda mp: mp.setattr(
        BlockPool, "_emit_block_stored", stored_without_extra_keys(BlockPool._emit_block_stored)
    ),
    "BlockRemoved without group index": lambda mp: mp.setattr(
        BlockPool, "_evict", removed_without_group(BlockPool._evict)
    ),
}


def run_without_vllm(monkeypatch: pytest.MonkeyPatch) -> BaseException | None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # any import of vllm fails
    return machine_failure(ManagerMachine, BUDGET, PROGRAMS)


def test_unpatched_machine_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_without_vllm(monkeypatch) is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_machine_catches(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    BUGS[bug](monkeypatch)
    began = time.monotonic()
    error = timed_catch(bug, lambda: run_without_vllm(monkeypatch))
    assert error is not None, f"the machine missed: {bug}"
    assert "/spec/" not in raised_in(error), f"{bug}: spec raised {error!r}"
    assert time.monotonic() - began < MAX_SECONDS, f"{bug}: caught, but too slowly"
