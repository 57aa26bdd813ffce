"""The spec's release rules (``spec/releases.py``): one table, read under one name."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from spec import profile as spec_profile
from spec.profile import Profile
from spec.releases import RULES, ReleaseRules, rules_for

SPEC_DIR = Path(spec_profile.__file__).parent


def test_every_rule_is_a_switch_of_the_table() -> None:
    """Each rule is named after a switch of releases.toml, and ReleaseRules has a field
    for each rule and nothing else."""
    assert set(RULES) <= set(spec_profile.SWITCHES)
    assert list(ReleaseRules.__dataclass_fields__) == list(RULES)


@pytest.mark.parametrize("release", spec_profile.RELEASES)
def test_a_release_follows_the_new_rule_of_each_switch_it_turns_on(release: str) -> None:
    """``Profile(release).rules`` picks, per switch, 0.25.1's rule or the switch's."""
    rules = Profile(release).rules
    for name, (before, after) in RULES.items():
        expected = after if name in spec_profile.ON[release] else before
        assert getattr(rules, name) is expected, (release, name)


def test_a_switch_flipped_by_hand_flips_its_rule() -> None:
    """A profile no release has (one switch off against 0.33.0) follows 0.25.1's rule
    for that switch only."""
    rules = Profile("0.33.0", pop_drops_null_head=False).rules
    assert rules.pop_drops_null_head is RULES["pop_drops_null_head"][0]
    assert rules.cascade_always_zero is RULES["cascade_always_zero"][1]
    assert rules == rules_for(Profile("0.33.0").on - {"pop_drops_null_head"})


def test_no_rule_switch_is_read_as_a_flag() -> None:
    """The flow reads a rule's switch only through ``profile.rules``: no
    ``profile.<switch>`` (or ``p.<switch>``) for a switch that has a rule."""
    pattern = re.compile(r"\b(?:profile|p)\.(" + "|".join(RULES) + r")\b")
    reads = [f"{path.name}: {m.group(0)}" for path in sorted(SPEC_DIR.glob("*.py"))
             for m in pattern.finditer(path.read_text(encoding="utf-8"))]
    assert reads == []


@pytest.mark.parametrize("release", ["0.25.1", "0.29.0", "0.33.0"])
def test_a_profile_pickles_with_its_rules(release: str) -> None:
    """A pickled profile (the exhaustive search pickles states) comes back with the
    same switches and rules, and stays frozen."""
    profile = Profile(release, trim_every_full_group=True)
    copy = pickle.loads(pickle.dumps(profile))
    assert copy.release == release and copy.on == profile.on
    assert copy.rules == profile.rules
    with pytest.raises(AttributeError, match="frozen"):
        copy.release = "0.25.1"


def test_rules_map_values_as_their_releases_do() -> None:
    """Spot checks of the table's rules against the releases' documented behaviour."""
    old, new = Profile("0.25.1").rules, Profile("0.33.0").rules
    assert old.pop_drops_null_head([0, 0, 5, 0, 7]) == [0, 0, 5, 0, 7]
    assert new.pop_drops_null_head([0, 0, 5, 0, 7]) == [5, 0, 7]
    assert old.external_blocks_floor_zero(-2) == -2 and new.external_blocks_floor_zero(-2) == 0
    assert old.eagle_master_switch({0, 1}, False) == {0, 1}
    assert new.eagle_master_switch({0, 1}, False) == set()
    assert new.eagle_master_switch({0, 1}, True) == {0, 1}
    assert old.retention_replay_boundaries(33, 16, True) == (32,)
    assert old.mamba_no_eagle_margin(object()) and old.eagle_peek_to_hashed_length(64, 31) == 31
    assert new.eagle_peek_to_hashed_length(64, 31) == 64
    assert old.mamba_caps_new_state_blocks(3, 1, 2) == 3
    assert new.mamba_caps_new_state_blocks(3, 1, 2) == 2
    assert new.mamba_caps_new_state_blocks(0, 1, 2) == 0
    assert not old.adopt_computed_without_new_tokens(16)
    assert new.adopt_computed_without_new_tokens(16)
    assert not new.adopt_computed_without_new_tokens(0)


def test_the_module_names_every_switch_without_a_rule() -> None:
    """``spec/releases.py``'s docstring names each switch read as a flag, so it and
    ``RULES`` together list every switch of releases.toml once."""
    import spec.releases

    named = set(re.findall(r"``(\w+)``", spec.releases.__doc__ or "")) & set(
        spec_profile.SWITCHES)
    assert named.isdisjoint(RULES)
    assert named | set(RULES) == set(spec_profile.SWITCHES)


def test_the_readme_marks_the_rules_it_lists() -> None:
    """spec/README.md's release lines say "(rule)" exactly for the switches of ``RULES``."""
    text = (SPEC_DIR / "README.md").read_text(encoding="utf-8")
    lines = re.findall(r"^- \d+\.\d+\.\d+ `(\w+)`( \(rule\))?:", text, re.MULTILINE)
    assert lines, "no release lines found in spec/README.md"
    for name, mark in lines:
        assert name in spec_profile.SWITCHES, name
        assert bool(mark) == (name in RULES), name
