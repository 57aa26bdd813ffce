"""Ring-buffer groups have teeth: a bug planted in kvcache's ``CircularBufferManager``
or in how the coordinator treats a ring group is caught by the kit's lockstep run of
kvcache's 0.33.0 profile against the spec's (family ``full+circular``), with no vLLM.

Each test patches kvcache (on the pure build: the conftest's monkeypatch skips
kvcache patches on the compiled one) and expects a mismatch within a fixed number
of seeded sequences; the control runs unpatched and must find none.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import kvcache.kv_cache_coordinator as coordinator
import kvcache.single_type_kv_cache_manager as single_type
from kvcache.kit.driver import run_sequence

SEEDS = range(20)
FAMILY = "full+circular"


def first_mismatch() -> int | None:
    """The first seed whose kvcache-0.33 vs spec-0.33 sequence mismatches."""
    for seed in SEEDS:
        result = run_sequence(seed, FAMILY, "kvcache-0.33", reference="spec-0.33")
        if result.mismatch is not None:
            return seed
    return None


def ring_grows(mp: pytest.MonkeyPatch) -> None:
    """A bug: the ring claims a new block at every allocation, as full attention would."""
    cls = single_type.CircularBufferManager

    def claim(self: single_type.CircularBufferManager, request_id: str) -> list[object]:
        new_blocks = self.block_pool.get_new_blocks(1)
        self.req_to_blocks[request_id].extend(new_blocks)
        return list(new_blocks)

    mp.setattr(cls, "_claim_ring_block", claim)


def ring_searched(mp: pytest.MonkeyPatch) -> None:
    """A bug: the ring group joins the hybrid hit search (its empty hit cuts every hit)."""
    mp.setattr(coordinator, "is_prefix_cacheable", lambda spec: True)


def ring_costs_nothing(mp: pytest.MonkeyPatch) -> None:
    """A bug: admission does not count the ring block a new request will claim."""
    mp.setattr(
        single_type.CircularBufferManager, "get_num_blocks_to_allocate", lambda self, *a, **k: 0
    )


BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "the ring grows with the request": ring_grows,
    "the ring group is searched for hits": ring_searched,
    "admission does not count the ring block": ring_costs_nothing,
}


def test_unpatched_family_agrees_with_the_spec() -> None:
    assert first_mismatch() is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    BUGS[bug](monkeypatch)
    assert first_mismatch() is not None, f"the lockstep run missed: {bug}"
