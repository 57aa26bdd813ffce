"""TurboQuant and hidden-state groups have teeth: a bug planted in how kvcache
treats each of these full-attention spec classes is caught by the kit's lockstep
run against the spec (families ``tq`` and ``full+hidden-state``), with no vLLM.

vLLM 0.25.1 manages ``TQFullAttentionSpec`` and ``HiddenStateCacheSpec`` groups
as full attention; what sets them apart is observable only in the blocks they
report for zeroing and their events' kind. Each test patches kvcache (on the pure
build: the conftest's monkeypatch skips kvcache patches on the compiled one) and
expects a mismatch within a fixed number of seeded sequences; the control runs
unpatched and must find none.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import kvcache.single_type_kv_cache_manager as single_type
from kvcache.kit.driver import run_sequence

SEEDS = range(20)


def first_mismatch(family: str) -> int | None:
    """The first seed whose kvcache-vs-spec sequence of ``family`` mismatches."""
    for seed in SEEDS:
        if run_sequence(seed, family, "kvcache", reference="spec").mismatch is not None:
            return seed
    return None


def without_tracking(spec_class: str) -> Callable[[pytest.MonkeyPatch], None]:
    """A bug: groups of ``spec_class`` stop reporting fresh blocks for zeroing."""

    def patch(mp: pytest.MonkeyPatch) -> None:
        mp.setattr(single_type, "_TRACKING_SPECS", single_type._TRACKING_SPECS - {spec_class})

    return patch


BUGS: dict[str, tuple[str, Callable[[pytest.MonkeyPatch], None]]] = {
    "TQ groups do not report fresh blocks for zeroing": (
        "tq",
        without_tracking("TQFullAttentionSpec"),
    ),
    "hidden-state groups do not report fresh blocks for zeroing": (
        "full+hidden-state",
        without_tracking("HiddenStateCacheSpec"),
    ),
}


@pytest.mark.parametrize("family", sorted({family for family, _ in BUGS.values()}))
def test_unpatched_families_agree_with_the_spec(family: str) -> None:
    assert first_mismatch(family) is None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    family, plant = BUGS[bug]
    plant(monkeypatch)
    assert first_mismatch(family) is not None, f"the lockstep run missed: {bug}"
