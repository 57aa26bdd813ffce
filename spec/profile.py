"""The spec's release profiles: which named switches each vLLM release turns on.

The switches and releases are data, not code: ``releases.toml`` beside this module
(installed as ``kvcache_spec/releases.toml``), the one table kvcache's
``kvcache/profile.py`` reads too (a test holds the two readings equal). The spec
reads it itself, so it still imports nothing from kvcache. A switch is on in a
release iff its ``since`` is at or before it: ``Profile("0.25.1")`` (the default)
has every switch off, ``Profile("0.33.0")`` every one on, a release between them
the switches measured to have come by then. What each switch changes is its rule
in ``spec/releases.py``; the spec reads the rules, never the switches.
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Any

from .releases import ReleaseRules, rules_for

TABLE_PATH = Path(__file__).resolve().with_name("releases.toml")
"""The table of releases and switches (shipped beside this module)."""


def _release_key(release: str) -> tuple[int, ...]:
    """``(0, 29, 0)`` for ``"0.29.0"``.

    Raises:
        ValueError: ``release`` is not a dotted version of numbers.
    """
    parts = release.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"release={release!r}: expected major.minor.patch, like 0.29.0")
    return tuple(int(p) for p in parts)


def read_table(path: Path = TABLE_PATH) -> tuple[tuple[str, ...], str, dict[str, str]]:
    """The table's releases (oldest first), default release and each switch's ``since``
    (in the table's order): what the spec needs to build profiles.

    Raises:
        ValueError: the table names a switch twice, gives a switch no ``since`` of its
            releases, lists releases out of order, or defaults to no release of its own.
    """
    data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    releases = tuple(str(r) for r in data["releases"])
    if [_release_key(r) for r in releases] != sorted({_release_key(r) for r in releases}):
        raise ValueError(f"{path}: releases={releases!r} are not strictly ascending")
    default = str(data["default"])
    if default not in releases:
        raise ValueError(f"{path}: default={default!r} is none of {releases}")
    since: dict[str, str] = {}
    for raw in data["switch"]:
        name, first = str(raw["name"]), str(raw["since"])
        if name in since:
            raise ValueError(f"{path}: switch {name!r} is listed twice")
        if first not in releases:
            raise ValueError(
                f"{path}: switch {name!r} has since={first!r}, no release of {releases}"
            )
        since[name] = first
    return releases, default, since


RELEASES, DEFAULT_RELEASE, SINCE = read_table()
"""Every release with a profile (oldest first), the default one, each switch's first
release."""

SWITCHES = tuple(SINCE)
"""Every switch, in the table's order (kvcache's)."""

ON = {
    release: frozenset(
        name for name, first in SINCE.items() if _release_key(first) <= _release_key(release)
    )
    for release in RELEASES
}
"""The switches each release turns on."""


class Profile:
    """One release's switches, as attributes (``profile.<name>``, for callers that
    compare profiles), and its rules (``profile.rules``, see ``spec/releases.py``), the
    only thing the spec reads; frozen once built. ``switches`` turns named switches on
    or off against the release (a profile no release has, for tests that flip one).

    Raises ValueError for a release the spec has no profile for, naming the argument
    and the releases it has, or for a switch the table does not name.
    """

    def __init__(self, release: str = DEFAULT_RELEASE, **switches: bool) -> None:
        if release not in ON:
            raise ValueError(
                f"release={release!r}: the spec has profiles for {', '.join(RELEASES)}"
            )
        unknown = sorted(set(switches) - set(SWITCHES))
        if unknown:
            raise ValueError(f"{unknown}: no switch of {TABLE_PATH.name}")
        self.release = release
        self.on = frozenset(name for name in SWITCHES
                            if switches.get(name, name in ON[release]))
        self.__dict__.update(self.switches())  # plain attributes: read on every step
        self.__dict__["rules"] = rules_for(self.on)

    rules: ReleaseRules

    def __getattr__(self, name: str) -> bool:
        raise AttributeError(name)  # every switch is set above; this types them for mypy

    def __setattr__(self, name: str, value: object) -> None:
        if "on" in self.__dict__:
            raise AttributeError(f"Profile is frozen: cannot set {name!r}")
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple[Any, tuple[str, frozenset[str]]]:
        """Pickles as its release and switches (its rules are functions of them)."""
        return profile_with, (self.release, self.on)

    def switches(self) -> dict[str, bool]:
        """Every switch's value, by name."""
        return {name: name in self.on for name in SWITCHES}


@functools.cache
def profile_with(release: str, on: frozenset[str]) -> Profile:
    """The profile of ``release`` with exactly the switches ``on`` on (unpickling)."""
    return Profile(release, **{name: name in on for name in SWITCHES})


def resolve_profile(profile: object) -> Profile:
    """None -> the default release, a release string -> its profile, a Profile -> itself.

    Anything else (e.g. kvcache's own Profile object) is read by its ``release``.
    """
    if profile is None:
        return Profile()
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, str):
        return Profile(profile)
    release = getattr(profile, "release", None)
    if not isinstance(release, str):
        raise ValueError(f"profile={profile!r}: expected a release string or a Profile")
    return Profile(release)
