"""Release profiles: the named switches where vLLM releases 0.25.1 to 0.33.0 differ.

kvcache has one implementation of the KV-cache lifecycle. Where vLLM releases
differ, the code consults a switch of the manager's ``Profile`` at the point of
difference; there is no forked module per release. ``Profile("0.25.1")`` (the
default) is bit-for-bit vLLM 0.25.1; ``Profile("0.33.0")`` turns on every switch
vLLM 0.33.0 needs; a release between them (``RELEASES``) turns on each switch whose
first release (``Switch.since``) is at or before it. ``kvcache.vllm_0_33`` is the
drop-in import path that builds managers with the 0.33.0 profile and 0.33.0's names.

The releases and switches are data, not code: one table, ``releases.toml`` in the
spec's package (``find_table``), read here and by the spec (``spec/profile.py``,
which imports nothing from kvcache); a test holds the two readings equal, and
docs/profiles.md's switch table is generated from it
(``scripts/gen_profiles_table.py``). ``SWITCHES`` documents every switch: what it
changes, the entry of the known-differences ledger (``kvcache/kit/ledger.toml``) it
covers, and whether its first release was measured by ``python -m kvcache bisect``.
``GAPS`` lists what some releases do that no profile reproduces
(``Profile.not_reproduced``).

This module is part of the vocabulary: it is never compiled (``kvcache._builds``).
Compiled managers copy the switches they read into their own attributes at
construction, so a switch costs one attribute read at the point of difference.
"""

from __future__ import annotations

import functools
import importlib.util
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "DEFAULT_RELEASE",
    "GAPS",
    "RELEASES",
    "SWITCHES",
    "TABLE_PATH",
    "Gap",
    "Profile",
    "Switch",
    "find_table",
    "load_table",
]

TABLE_NAME = "releases.toml"
"""The table's file name, in the spec's package directory."""


def find_table() -> Path:
    """The table of releases and switches: ``releases.toml`` in the spec's package,
    beside kvcache's own (``kvcache_spec/`` in an installed wheel, ``spec/`` in the
    checkout). The spec owns the file so that it stays standalone; kvcache reads it
    by path and imports nothing from the spec.

    Raises:
        FileNotFoundError: neither place holds it (naming both paths).
    """
    root = Path(__file__).resolve().parent.parent
    candidates = [root / package / TABLE_NAME for package in ("kvcache_spec", "spec")]
    # Wherever the installed spec package is (an editable install maps it to the
    # checkout's spec/; a copy of kvcache elsewhere still finds it): located, not
    # imported.
    located = importlib.util.find_spec("kvcache_spec")
    for where in (located.submodule_search_locations or []) if located else []:
        candidates.append(Path(where) / TABLE_NAME)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"kvcache's release table is missing: none of {', '.join(map(str, candidates))}"
    )


def release_key(release: str) -> tuple[int, int, int]:
    """``(0, 29, 0)`` for ``"0.29.0"``, for ordering releases.

    Raises:
        ValueError: ``release`` is not ``major.minor.patch`` in numbers.
    """
    parts = release.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"release={release!r}: expected major.minor.patch, like 0.29.0")
    major, minor, patch = (int(p) for p in parts)
    return major, minor, patch


def in_range(release: str, releases: str) -> bool:
    """Whether ``release`` is in ``releases``, a range in the ledger's syntax
    (comma-separated clauses ``>=X``, ``<X``, ``==X``, all of which must hold).

    Raises:
        ValueError: a clause of ``releases`` with another operator or no version.
    """
    key = release_key(release)
    for clause in releases.split(","):
        clause = clause.strip()
        op = next((o for o in (">=", "==", "<") if clause.startswith(o)), None)
        if op is None:
            raise ValueError(f"releases={releases!r}: clause {clause!r} is not >=X, <X or ==X")
        bound = release_key(clause[len(op):].strip())
        if not {">=": key >= bound, "==": key == bound, "<": key < bound}[op]:
            return False
    return True


class Switch(NamedTuple):
    """One documented switch: its name, the ledger entry it covers ("": a difference
    no kit rule needs, as the kit never drives that case or both sides already agree
    there), what it changes, the first release where it is on, whether that release
    was measured (``measured_by``: ``"bisect"``, ``python -m kvcache bisect`` on
    the ledger entry, docs/bisect.md; ``"conformance"``, kvcache's profile against
    that vLLM release), the earliest release it may have come where the measurement
    could not tell (else ``since``), and how it was measured where that is not
    plain."""

    name: str
    ledger_id: str
    what: str
    since: str
    measured: bool = False
    earliest: str = ""
    note: str = ""
    measured_by: str = ""


class Gap(NamedTuple):
    """A difference of some releases that no profile reproduces: the ledger entry
    ("" for none), the releases it is in (the ledger's range syntax) and what."""

    ledger_id: str
    releases: str
    what: str


def load_table(
    path: Path | None = None,
) -> tuple[tuple[str, ...], str, tuple[Switch, ...], tuple[Gap, ...]]:
    """The table's releases (oldest first), default release, switches and gaps,
    checked.

    Raises:
        ValueError: a release out of order or malformed, a default or a switch's
            ``since`` / ``earliest`` that is no release of the table (or an
            ``earliest`` after ``since``), a switch named twice, a switch without
            its ``what``, or a gap whose range holds no release of the table;
            each naming the field and value.
    """
    path = path or find_table()
    data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    releases = tuple(str(r) for r in data["releases"])
    keys = [release_key(r) for r in releases]
    if keys != sorted(set(keys)):
        raise ValueError(f"{path}: releases={releases!r} are not strictly ascending")
    default = str(data["default"])
    if default not in releases:
        raise ValueError(f"{path}: default={default!r} is none of {releases}")
    switches: list[Switch] = []
    for raw in data["switch"]:
        switch = Switch(
            name=str(raw["name"]),
            ledger_id=str(raw["ledger"]),
            what=str(raw["what"]),
            since=str(raw["since"]),
            measured=bool(raw["measured"]),
            earliest=str(raw.get("earliest", raw["since"])),
            note=str(raw.get("note", "")),
            measured_by=str(raw.get("measured_by", "bisect")) if raw["measured"] else "",
        )
        if switch.measured_by not in ("", "bisect", "conformance"):
            raise ValueError(f"{path}: switch {switch.name!r}: measured_by="
                             f"{switch.measured_by!r} is not 'bisect' or 'conformance'")
        for field in ("since", "earliest"):
            value = getattr(switch, field)
            if value not in releases:
                raise ValueError(f"{path}: switch {switch.name!r}: {field}={value!r} is "
                                 f"none of {releases}")
        if release_key(switch.earliest) > release_key(switch.since):
            raise ValueError(f"{path}: switch {switch.name!r}: earliest={switch.earliest!r} "
                             f"is after since={switch.since!r}")
        if not switch.what or any(s.name == switch.name for s in switches):
            raise ValueError(f"{path}: switch {switch.name!r} has no 'what' or is listed twice")
        switches.append(switch)
    gaps = tuple(
        Gap(str(raw["ledger"]), str(raw["releases"]), str(raw["what"]))
        for raw in data.get("gap", [])
    )
    for gap in gaps:
        if not any(in_range(r, gap.releases) for r in releases):
            raise ValueError(f"{path}: gap {gap.ledger_id!r}: releases={gap.releases!r} "
                             f"holds none of {releases}")
    return releases, default, tuple(switches), gaps


TABLE_PATH = find_table()
"""Where this process read the table from."""

RELEASES: tuple[str, ...]
"""The vLLM releases kvcache has a profile for, oldest first."""
DEFAULT_RELEASE: str
"""The profile a manager gets when none is given."""
SWITCHES: tuple[Switch, ...]
"""Every switch, in the order of the ledger's entries."""
GAPS: tuple[Gap, ...]
"""The differences of some releases that no profile reproduces."""
RELEASES, DEFAULT_RELEASE, SWITCHES, GAPS = load_table(TABLE_PATH)

_SWITCH_NAMES = tuple(s.name for s in SWITCHES)


class Profile:
    """The switch values of one vLLM release (see ``SWITCHES``).

    Args:
        release: One of ``RELEASES`` (default ``"0.25.1"``).

    Raises:
        ValueError: for a release kvcache has no profile for (naming the argument
            and the releases it has).
    """

    __slots__ = ("release", *_SWITCH_NAMES)

    release: str
    stats_at_admission: bool
    stats_hits_by_source: bool
    event_locality: bool
    event_ownership: bool
    event_lookahead_tokens: bool
    tagged_extra_keys: bool
    mm_keys_by_window: bool
    none_hash_fixed_seed: bool
    new_block_ids_zeroing_only: bool
    pop_drops_null_head: bool
    cascade_always_zero: bool
    trim_every_full_group: bool
    partial_prompt_tail_entries: bool
    prompt_tail_before_last_token: bool
    eagle_master_switch: bool
    eagle_peek_to_hashed_length: bool
    adopt_computed_without_new_tokens: bool
    free_on_processed_tokens: bool
    mamba_align_only: bool
    mamba_frees_processed_states: bool
    zero_every_attention_group: bool
    mamba_no_eagle_margin: bool
    mamba_partial_prompt_tail: bool
    mamba_eagle_state_drop: bool
    mamba_tail_engine_eagle: bool
    mamba_prompt_tail_state: bool
    mamba_caps_new_state_blocks: bool
    retention_replay_boundaries: bool
    retention_zero_without_window: bool
    shared_prefix_junctions: bool
    junction_eagle_tail: bool
    tq_spec_removed: bool
    circular_buffer_groups: bool
    prefill_lookahead_argument: bool
    lookahead_arguments: bool
    cache_within_hashed_tokens: bool
    pcp_not_scaled: bool
    dcp_sharded_geometry: bool
    dcp_full_attention_only: bool
    dcp_sharded_field: bool
    mamba_fine_grained_hits: bool
    fine_grained_hits_under_dcp: bool
    cache_mask_hit_alignment: bool
    partial_hit_copy_on_write: bool
    event_session_id: bool
    full_report_mode: bool
    external_blocks_floor_zero: bool
    mamba_prefill_checkpoints: bool
    mamba_checkpoint_at_prefill_end: bool
    mamba_prompt_checkpoint_kept: bool
    mamba_checkpoint_hit_alignment: bool
    mamba_checkpoint_eagle_whole_prompt: bool
    mamba_checkpoint_relocates_speculative: bool
    mamba_checkpoint_retention_mask: bool
    hisparse_groups: bool

    def __init__(self, release: str = DEFAULT_RELEASE) -> None:
        if release not in RELEASES:
            raise ValueError(
                f"release={release!r}: kvcache has profiles for {', '.join(RELEASES)}"
            )
        object.__setattr__(self, "release", release)
        key = release_key(release)
        for switch in SWITCHES:
            object.__setattr__(self, switch.name, release_key(switch.since) <= key)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            f"Profile is frozen: {name}={value!r} cannot be set on {self!r} "
            "(with_switches returns a changed copy)"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Profile is frozen: {name} cannot be deleted")

    def __reduce__(self) -> tuple[object, tuple[str, frozenset[str]]]:
        # Pickling (the exhaustive search pickles every state) names the release and
        # the switches on; unpickling shares one frozen profile per such pair.
        on = frozenset(name for name in _SWITCH_NAMES if getattr(self, name))
        return _profile_from, (self.release, on)

    def switches(self) -> dict[str, bool]:
        """Every switch's value, by name (for reports and tests)."""
        return {name: bool(getattr(self, name)) for name in _SWITCH_NAMES}

    def not_reproduced(self) -> tuple[Gap, ...]:
        """What this release does that the profile does not reproduce (``GAPS`` whose
        range holds it), so a user can see how exact the profile is."""
        return tuple(gap for gap in GAPS if in_range(self.release, gap.releases))

    def unmeasured(self) -> tuple[str, ...]:
        """The switches whose value in this release no measurement backs: a switch
        without a bisected first release, in a release between the two kvcache is
        checked against (0.25.1 and 0.33.0, conformance-tested), and a switch off
        here although the bisect could not rule out that it had come
        (``earliest <= release < since``)."""
        key, ends = release_key(self.release), (RELEASES[0], RELEASES[-1])
        return tuple(
            s.name for s in SWITCHES
            if (not s.measured and self.release not in ends)
            or release_key(s.earliest) <= key < release_key(s.since)
        )

    def with_switches(self, **values: bool) -> Profile:
        """This profile with the named switches set to ``values`` (the kit explains a
        difference by the switch whose value reproduces it: ``kvcache.kit.explain``).

        Raises:
            ValueError: naming an argument that is no switch.
        """
        unknown = sorted(set(values) - set(_SWITCH_NAMES))
        if unknown:
            raise ValueError(f"{unknown[0]}=...: not a switch of Profile ({len(SWITCHES)} exist)")
        copy = object.__new__(Profile)
        object.__setattr__(copy, "release", self.release)
        for name in _SWITCH_NAMES:
            object.__setattr__(copy, name, bool(values.get(name, getattr(self, name))))
        return copy

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Profile)
            and other.release == self.release
            and other.switches() == self.switches()
        )

    def __hash__(self) -> int:
        return hash((self.release, tuple(self.switches().values())))

    def __repr__(self) -> str:
        release = Profile(self.release).switches()
        changed = [f", {k}={v}" for k, v in self.switches().items() if release[k] != v]
        return f"Profile({self.release!r}{''.join(changed)})"


@functools.cache
def _profile_from(release: str, on: frozenset[str]) -> Profile:
    """The profile of ``release`` with exactly the switches ``on`` on (unpickling a
    ``Profile``; profiles are frozen, so one per pair serves every copy)."""
    return Profile(release).with_switches(**{name: name in on for name in _SWITCH_NAMES})


def resolve_profile(profile: Profile | str | None) -> Profile:
    """``profile`` as a ``Profile``: None is the default release, a string a release.

    Raises:
        ValueError: for an unknown release or a value that is no profile.
    """
    if profile is None:
        return Profile(DEFAULT_RELEASE)
    if isinstance(profile, str):
        return Profile(profile)
    if not isinstance(profile, Profile):
        raise ValueError(f"profile={profile!r}: expected a kvcache Profile or a release string")
    return profile
