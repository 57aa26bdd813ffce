"""Differences between releases recognised by explanation, not by pattern.

The ledger's rules (``kvcache.kit.ledger``) recognise a known difference by the shape
of the two results. This module asks kvcache instead: a difference between the old
line (0.25.1) and a newer release R is *explained* when kvcache under R's profile
reproduces R's result at that call, replaying the same calls; and it is explained by
switch S when kvcache under R's profile with S turned back off no longer does. The
ledger entries of those switches (``spec/releases.toml``: each switch names its
entry) are the difference's known entries. One rule for every entry a switch
covers, with no pattern to keep in step with the code, and it cannot recognise what
the profile does not reproduce: a difference kvcache's R profile misses stays
unknown.

Replays run on kvcache (0.25.1's API, ``kvcache.KVCacheManager(profile=...)``), so a
release whose API the kit drives through another adapter is compared after the
ledger's own normalisers (hash renaming, new event fields) have had their say.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvcache.kit.adapter_base import Adapter, CannotBuild, HarnessError
from kvcache.kit.config import ManagerConfig
from kvcache.kit.ledger import Judge
from kvcache.profile import RELEASES, SWITCHES, Profile, release_key

Outcome = dict[str, Any]
Calls = Sequence[tuple[str, Mapping[str, Any]]]
Replayed = tuple[Outcome, dict[str, Any] | None]


def profile_release(version: str | None) -> str | None:
    """The newest release kvcache has a profile for at or below ``version`` within
    its major.minor line ("0.27" -> "0.27.1"; "0.33.0" -> "0.33.0"), else None."""
    if not version:
        return None
    parts = version.split(".")
    line = ".".join(parts[:2])
    key = release_key(version) if len(parts) >= 3 else (*release_key(line + ".0")[:2], 10**9)
    same_line = [r for r in RELEASES if r.startswith(line + ".") and release_key(r) <= key]
    return same_line[-1] if same_line else None


class Explainer:
    """Explains differences of one sequence between the 0.25.1 line and ``release``."""

    def __init__(self, config: ManagerConfig, hash_seed: str, release: str) -> None:
        self.config = config
        self.hash_seed = hash_seed
        self.profile = Profile(release)
        base = Profile(RELEASES[0]).switches()
        self.switches = [s for s in SWITCHES if getattr(self.profile, s.name) and not base[s.name]]

    def _replay(self, profile: Profile, calls: Calls) -> Replayed | None:
        """The last call's outcome and state on kvcache under ``profile`` (None: it
        cannot be built or driven for these calls)."""
        import kvcache
        from kvcache.kit.lockstep import outcome
        from kvcache.kit.sides import Side

        factory = functools.partial(kvcache.KVCacheManager, profile=profile)
        try:
            side = Side(Adapter(f"kvcache {profile!r}", factory), self.config, self.hash_seed)
            result: Outcome = {}
            for op, args in calls:
                result = outcome(side, op, args)
            return result, side.raw_state()
        except (CannotBuild, HarnessError):
            return None

    def explain(self, calls: Calls, same: Callable[[Replayed], bool]) -> tuple[str, ...]:
        """The ledger entries whose switches explain the last call's difference: ``same``
        says whether a replay's (outcome, state) is the newer release's; () when the
        full profile does not reproduce it, or no switch with an entry is needed."""
        full = self._replay(self.profile, calls)
        if full is None or not same(full):
            return ()
        needed = []
        for switch in self.switches:
            if not switch.ledger_id:
                continue
            without = self._replay(self.profile.with_switches(**{switch.name: False}), calls)
            if without is not None and not same(without):
                needed.append(switch.ledger_id)
        return tuple(dict.fromkeys(needed))


def _equal(expected: Outcome, actual: Outcome) -> bool:
    from kvcache.kit.lockstep import compare_outcomes  # lockstep imports this module

    return compare_outcomes(expected, actual)[0]


def explain_outcome(
    explainer: Explainer | None,
    judge: Judge | None,
    calls: Calls,
    expected: Outcome,
    actual: Outcome,
) -> tuple[str, ...]:
    """The ledger entries whose switches explain the last call's outcome, which the
    ledger's rules did not recognise (``expected`` / ``actual``: the reference's and
    the subject's, ``judge`` orienting them by release); () when none does."""
    if explainer is None or judge is None:
        return ()
    newer = actual if judge.old_is_expected else expected
    op, args = calls[-1]

    def same(replayed: Replayed) -> bool:
        result = replayed[0]
        if _equal(result, newer):
            return True
        old_first = (result, newer) if judge.old_is_expected else (newer, result)
        return judge.outcome(op, args, *old_first, _equal).ok

    return explainer.explain(calls, same)


def explain_state(
    explainer: Explainer | None,
    judge: Judge | None,
    calls: Calls,
    expected: dict[str, Any],
    observed: dict[str, Any],
) -> tuple[str, ...]:
    """The ledger entries whose switches explain the canonical state after the last
    call, which the ledger's rules did not recognise; () when none does."""
    if explainer is None or judge is None:
        return ()
    from kvcache.kit.trace import canon_state, state_diff

    newer = observed if judge.old_is_expected else expected
    op = calls[-1][0]

    def same(replayed: Replayed) -> bool:
        if replayed[1] is None:
            return False
        state = canon_state(replayed[1])
        if not state_diff(state, newer):
            return True
        old_first = (state, newer) if judge.old_is_expected else (newer, state)
        return judge.state(op, *old_first)[0].ok

    return explainer.explain(calls, same)
