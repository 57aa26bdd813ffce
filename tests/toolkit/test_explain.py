"""Differences recognised by explanation (``kvcache.kit.explain``): kvcache under the
newer release's profile reproduces the newer result, and turning a switch off undoes
it; the switch's ledger entry is the difference's known entry. Checked with a
stand-in for a newer vLLM release (kvcache's 0.33.0 drop-in under another name, as
the kit never explains kvcache's own sides) and the ledger's pattern rule for one
entry taken away.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from kvcache.kit import ledger, lockstep
from kvcache.kit.adapter_base import ProfileAdapter
from kvcache.kit.explain import profile_release
from kvcache.kit.fuzz import fuzz
from kvcache.kit.ledger_rules import Rule
from kvcache.kit.sides import ADAPTERS
from kvcache.profile import Profile

STAND_IN = "release-0.33-stand-in"


@pytest.fixture
def stand_in() -> Iterator[str]:
    ADAPTERS[STAND_IN] = lambda: ProfileAdapter(STAND_IN, "kvcache.vllm_0_33", "0.33")
    try:
        yield STAND_IN
    finally:
        del ADAPTERS[STAND_IN]


def census(subject: str) -> dict[str, int]:
    out = fuzz(subject, reference="kvcache", families=["full+full+full"], max_sequences=60,
               seconds=None, stream=io.StringIO(), census=True)  # fmt: skip
    assert out.failure is None
    return dict(out.census)


def test_with_switches_is_a_different_profile() -> None:
    full = Profile("0.33.0")
    less = full.with_switches(trim_every_full_group=False)
    assert not less.trim_every_full_group and full.trim_every_full_group
    assert less != full and less == full.with_switches(trim_every_full_group=False)
    assert hash(less) == hash(full.with_switches(trim_every_full_group=False))
    assert repr(less) == "Profile('0.33.0', trim_every_full_group=False)"
    assert full == Profile("0.33.0") and repr(full) == "Profile('0.33.0')"
    with pytest.raises(ValueError, match="no_such_switch"):
        full.with_switches(no_such_switch=True)


def test_profile_release_of_a_version_or_line() -> None:
    assert profile_release("0.33.0") == "0.33.0"
    assert profile_release("0.27") == "0.27.1"
    assert profile_release("0.26.5") == "0.26.0"
    assert profile_release("0.34.0") is None and profile_release(None) is None


def test_a_difference_without_its_pattern_rule_is_explained_by_its_switch(
    stand_in: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ledger.RULES, "three_full_groups_hit", Rule)  # the pattern gone
    explained = census(stand_in)
    assert explained.get("known:bug-three-full-groups-trim", 0) >= 1, explained
    assert not [kind for kind in explained if not kind.startswith(("known:", "cannot"))]
    # Without the explanation the same run meets the difference as unknown.
    monkeypatch.setattr(lockstep, "explainable_release", lambda side: None)
    unexplained = census(stand_in)
    assert [kind for kind in unexplained if not kind.startswith(("known:", "cannot"))]


def test_kvcache_is_not_explained_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ledger.RULES, "three_full_groups_hit", Rule)
    kinds = census("kvcache-0.33")
    assert [kind for kind in kinds if not kind.startswith(("known:", "cannot"))], kinds
