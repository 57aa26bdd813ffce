"""kvcache's 0.33.0 profile against the spec's 0.33.0 profile, call by call.

The real vLLM 0.33.0 check is ``make conformance-0.33`` (it needs ``.venv-0.33``);
this one runs wherever the tests run: the same random scheduler sequences
(``kvcache.kit.driver``) in lockstep on ``kvcache-0.33`` (``kvcache.vllm_0_33``) and
``spec-0.33`` (the spec with ``profile="0.33.0"``), both of the 0.33 line, so no
ledger rule normalises anything. ``PROFILE_SEQUENCES`` (default 30) sequences per
family of ``kvcache.kit.conformance`` (the families vLLM 0.33.0 cannot build are not
run there either).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache.kit.conformance import (
    both_refuse,
    conformant_families,
    diverged_required,
    family_index,
    family_seed,
)
from kvcache.kit.driver import FAMILIES, Family, SequenceResult, Stats, run_sequence

pytestmark = pytest.mark.conformance

SEQUENCES = int(os.environ.get("PROFILE_SEQUENCES", "30"))
FAMILY_LIST = conformant_families()


@pytest.fixture(autouse=True)
def keep_none_hash() -> Iterator[None]:
    """The kit sets kvcache's process-wide NONE_HASH per sequence (each with its own
    hash function); later tests (the stateful machines) expect it as it was."""
    saved = kcu.NONE_HASH
    yield
    kcu.NONE_HASH = saved


@pytest.mark.parametrize("family", FAMILY_LIST, ids=[f.name for f in FAMILY_LIST])
def test_kvcache_0_33_matches_spec_0_33(family: Family) -> None:
    stats = Stats()
    failures = []
    index = family_index(family.name)
    for i in range(SEQUENCES):
        result = run_sequence(family_seed(7, index, i), family, "kvcache-0.33", "spec-0.33", stats)
        if result.cannot_build is not None and both_refuse(result, "kvcache-0.33", "spec-0.33"):
            stats.events["both_refuse"] += 1  # a layout 0.33.0 removed: refused by both
            continue
        if result.mismatch is not None or result.cannot_build is not None:
            failures.append(result)
    print(f"\n{stats.summary('profile-0.33 vs spec')}")
    assert not stats.known, f"a ledger rule normalised a same-release comparison: {stats.known}"
    assert not failures, (
        f"{len(failures)} sequence(s) differ, first seed {failures[0].seed}, config "
        f"{failures[0].config}:\n{failures[0].mismatch or failures[0].cannot_build}"
    )
    built = SEQUENCES - stats.events["both_refuse"]  # layouts 0.33.0 removed are not run
    assert built > 0 and stats.events["get_computed_blocks"] > 0 and stats.calls > 50 * built
    if diverged_required(family):  # the connector lookup's divergent hits, and the fallback
        assert stats.events["connector_diverged"] > 0 and stats.events["connector_fallback"] > 0


def first_mismatch(impl: str, name: str, what: str) -> SequenceResult:
    """The first of family ``name``'s first 100 sequences (seed 7) where ``impl``
    differs from the spec's 0.33.0 profile; fails naming ``what`` if none does."""
    family = FAMILIES[name]
    index = list(FAMILIES).index(family.name)
    for i in range(100):
        result = run_sequence(family_seed(7, index, i), family, impl, "spec-0.33", Stats())
        if result.mismatch is not None:
            return result
    raise AssertionError(f"{what} went unnoticed in 100 sequences")


# (planted bug, what it gets wrong): each a kvcache-0.33 with one retention rule of
# 0.33.0 turned back (tests/conformance/mutants.py), which spec-0.33 must tell apart.
PLANTED = [
    ("conformance.mutants:OneReplayBoundary", "retention_replay_boundaries"),
    ("conformance.mutants:NoJunctionTails", "shared_prefix_junctions"),
]


@pytest.mark.parametrize(("impl", "switch"), PLANTED, ids=[s for _, s in PLANTED])
def test_planted_retention_bug_under_0_33_is_caught(impl: str, switch: str) -> None:
    """Teeth for the sparse-retention switches: kvcache's 0.33.0 drop-in with 0.25.1's
    single replay boundary, or ignoring the request's shared-prefix boundary, differs
    from the spec's 0.33.0 profile in ``full+swa-retention`` (4 and 11 of its first 100
    sequences here, the first at once) at which window blocks are cached."""
    result = first_mismatch(impl, "full+swa-retention", f"{switch} turned back")
    if switch == "retention_replay_boundaries":
        assert result.config.use_eagle, result.config  # the rules differ only with EAGLE
    detail = str(result.mismatch)
    assert "cached" in detail or "block_hash" in detail, detail


# (planted bug, the family it shows in): kvcache-0.33 with the connector lookup
# (``get_computed_blocks_for_connector``) wrong beside Mamba.
PLANTED_CONNECTOR = [
    ("conformance.mutants:PlainConnectorLookup", "full+mamba-align"),
    ("conformance.mutants:NoConnectorFallback", "full+mamba-align"),
]


@pytest.mark.parametrize(("impl", "name"), PLANTED_CONNECTOR, ids=[i for i, _ in PLANTED_CONNECTOR])
def test_planted_connector_lookup_bug_is_caught(impl: str, name: str) -> None:
    """Teeth for the connector lookup: the plain lookup in its place (never diverged),
    or the per-group hits kept where a Mamba group hit deeper than full attention,
    differ from the spec's 0.33.0 profile at that call (20 and 13 of the first 100
    sequences here)."""
    result = first_mismatch(impl, name, impl)
    assert result.mismatch.op == "get_computed_blocks_for_connector", result.mismatch


def test_planted_zeroing_bug_is_caught() -> None:
    """Teeth for the zeroing duties the driver draws: a drop-in that reports an async
    load's blocks for zeroing although the load writes them (``skip_zeroing_group_ids``
    ignored) differs from the spec's 0.33.0 profile in the blocks it reports."""
    result = first_mismatch("conformance.mutants:IgnoresSkipZeroing", "full+swa+mamba",
                            "skip_zeroing_group_ids ignored")
    assert "new_block_ids" in str(result.mismatch) or result.mismatch.op == "take_new_block_ids", (
        result.mismatch)
