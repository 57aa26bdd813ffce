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


def test_every_switch_of_the_table_is_a_rule() -> None:
    """Each switch of releases.toml has its rule, named after it, and ReleaseRules has a
    field for each rule and nothing else."""
    assert sorted(RULES) == sorted(spec_profile.SWITCHES)
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


def test_no_switch_is_read_as_a_flag() -> None:
    """The spec reads a switch only through ``profile.rules``: no ``profile.<switch>``
    (or ``p.<switch>``) anywhere in spec/."""
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
    assert old.mamba_caps_new_state_blocks is False and new.mamba_caps_new_state_blocks
    tail = Profile("0.26.0").rules.mamba_partial_prompt_tail  # the whole prompt, floored
    assert old.mamba_partial_prompt_tail is None and tail is not None and tail.inside_only
    assert (tail.boundary(13, 2, False, 0), tail.boundary(13, 2, True, 0)) == (12, 10)
    assert Profile("0.31.0").rules.mamba_prompt_tail_state is None
    assert new.mamba_tail_engine_eagle(True, False) and not old.mamba_eagle_state_drop(True)
    assert not old.adopt_computed_without_new_tokens(16)
    assert new.adopt_computed_without_new_tokens(16)
    assert not new.adopt_computed_without_new_tokens(0)


def test_the_readme_names_every_switch_with_its_release() -> None:
    """spec/README.md lists every switch once, by release (what 0.33.0 changes reads in
    one place), each line giving its switch's first release."""
    text = (SPEC_DIR / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(\w+)`", text))
    assert set(spec_profile.SWITCHES) <= named, set(spec_profile.SWITCHES) - named
    lines = re.findall(r"^- (\d+\.\d+\.\d+) `(\w+)`:", text, re.MULTILINE)
    assert sorted(name for _, name in lines) == sorted(spec_profile.SWITCHES)
    for release, name in lines:
        assert spec_profile.SINCE[name] == release, name


def test_admission_rules_refuse_what_old_releases_lack() -> None:
    """0.25.1 admits no ring buffer, HiSparse group, checkpoint field or lookahead;
    0.33.0 admits them and refuses a caching Mamba group outside 'align'."""
    class CircularBufferSpec:
        pass

    class MambaSpec:
        def __init__(self, mode: str) -> None:
            self.mamba_cache_mode = mode
            self.num_prefill_checkpoint_blocks, self.prefill_checkpoint_alignment = 1, 32

    old, new = Profile("0.25.1").rules, Profile("0.33.0").rules
    ring, none_mode, align = CircularBufferSpec(), MambaSpec("none"), MambaSpec("align")
    assert not old.circular_buffer_groups(ring) and new.circular_buffer_groups(ring)
    assert not old.hisparse_groups(object(), "hisparse_source")
    assert old.hisparse_groups(object(), None) and new.hisparse_groups(object(), "hisparse_source")
    assert old.mamba_prefill_checkpoints(align) is None
    assert new.mamba_prefill_checkpoints(align) == (1, 32)
    assert old.lookahead_arguments(0) and not old.lookahead_arguments(2)
    assert new.lookahead_arguments(2)
    assert old.mamba_align_only(none_mode) and not new.mamba_align_only(none_mode)
    assert new.mamba_align_only(align) and new.mamba_align_only(ring)
    assert old.retention_zero_without_window(0, False)
    assert not new.retention_zero_without_window(0, False)
    assert new.retention_zero_without_window(0, True)
    assert new.retention_zero_without_window(32, False)


def test_path_and_vocabulary_rules() -> None:
    """The rules of the switches that add a step or set a vocabulary argument."""
    from spec.vocab import sha256, xxhash

    old, new = Profile("0.25.1").rules, Profile("0.33.0").rules
    assert old.none_hash_fixed_seed(None, sha256) is None
    assert new.none_hash_fixed_seed(None, sha256) == "vllm-none-hash"
    assert new.none_hash_fixed_seed(None, xxhash) is None
    assert new.none_hash_fixed_seed("7", sha256) == "7"
    assert (old.tagged_extra_keys, old.mm_keys_by_window) == (False, False)
    assert new.tagged_extra_keys and new.mm_keys_by_window
    assert old.event_fields("BlockStored") == old.event_fields("BlockRemoved") == ()
    assert Profile("0.30.0").rules.event_fields("BlockStored") == (
        "locality", "ownership", "session_id")
    assert new.event_fields("BlockStored") == (
        "locality", "ownership", "session_id", "lookahead_token_ids")
    assert new.event_fields("BlockRemoved") == ("locality", "ownership")
    assert old.pcp_not_scaled(2, 3) == 6 and new.pcp_not_scaled(2, 3) == 2
    assert old.dcp_sharded_geometry.refusal is ValueError
    assert new.dcp_sharded_geometry.refusal is AssertionError
    with pytest.raises(NotImplementedError, match="context parallelism"):
        old.dcp_sharded_geometry.check_hybrid([], 2, 1)
    new.dcp_sharded_geometry.check_hybrid([], 2, 2)  # no group to refuse
    assert old.mamba_frees_processed_states.free_by(10, 2) == 8
    assert old.mamba_frees_processed_states.free_by(1, 2) == 0
    assert new.mamba_frees_processed_states.free_by(10, 2) == 10
    tail = new.mamba_prompt_tail_state
    assert old.mamba_prompt_tail_state is None and tail is not None and not tail.inside_only
    assert (tail.boundary(13, 2, False, 0), tail.boundary(13, 2, True, 0)) == (12, 10)
    assert new.mamba_eagle_state_drop(True) and not new.mamba_eagle_state_drop(False)
    assert not old.partial_hit_copy_on_write(20, 16)
    assert new.partial_hit_copy_on_write(20, 16) and not new.partial_hit_copy_on_write(32, 16)
    assert old.shared_prefix_junctions(48) == 0 and new.shared_prefix_junctions(48) == 48
    calls: list[tuple[str, int]] = []

    class Manager:
        def cache_prompt_tail(self, request: str, num_tokens: int) -> None:
            calls.append((request, num_tokens))

        def enable_fine_grained_hits(self) -> None:
            calls.append(("fine", 0))

    old.partial_prompt_tail_entries(Manager(), "r", 40)
    old.mamba_fine_grained_hits(Manager())
    assert calls == []
    new.partial_prompt_tail_entries(Manager(), "r", 40)
    new.mamba_fine_grained_hits(Manager())
    assert calls == [("r", 40), ("fine", 0)]
