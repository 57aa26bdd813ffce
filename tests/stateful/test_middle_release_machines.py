"""The stateful machines under every release between 0.25.1 and 0.33.0: kvcache's
``KVCacheManager(profile=release)`` against the spec's, step for step.

``test_manager_machine.py`` and its siblings hold kvcache to the spec under vLLM
0.25.1's profile, ``test_profile_machines.py`` under 0.33.0's. A release between
them turns on a set of switches neither end has (0.26.0-0.32.0 cache Mamba 'all'
groups beside 0.26.0's fine-grained hits, 0.33.0 refuses them; 0.29.0 trims every
full-attention hit while dropping no null head): an interaction of two switches
that one side gets wrong shows only under such a set. Here the manager, hybrid and
new-kinds machines run under each of 0.26.0-0.32.0 on both sides.

Every switch is as the release has it on both sides, the classes of what is reported
too (each release's event fields, ``kv_events.EVENT_FIELDS``; ``stats_hits_by_source``).

A reduced run (``CI_EXAMPLES`` of the CI profile's 600 examples per machine and
release) keeps the budget; ``HYPOTHESIS_PROFILE=nightly`` scales it as it scales
the others. Teeth: one switch turned back in the spec alone fails the machine.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings

import kvcache
import spec
import spec.profile as spec_profile
from kvcache.profile import Profile

from .runner import run_machine
from .test_hybrid_machine import HybridMachine
from .test_manager_machine import ManagerMachine
from .test_new_kinds_machine import NewKindsMachine
from .test_profile_machines import TEETH_SEEDS, first_failure

MIDDLE = spec_profile.RELEASES[1:-1]
"""Every release between 0.25.1 and 0.33.0."""
CI_EXAMPLES = 16
BASES = {"manager": ManagerMachine, "hybrid": HybridMachine, "new-kinds": NewKindsMachine}


def spec_profile_for(release: str, flipped: str | None = None) -> spec_profile.Profile:
    """The spec's profile of ``release`` (with ``flipped``, if given, set to the other
    value)."""
    switches: dict[str, bool] = {}
    if flipped is not None:
        switches[flipped] = flipped not in spec_profile.ON[release]
    return spec_profile.Profile(release, **switches)


def machine_class(base: type[ManagerMachine], release: str,
                  flipped: str | None = None) -> type[ManagerMachine]:
    """``base`` with both managers built under ``release`` (the spec's with
    ``flipped`` turned over, for the teeth), the requests hashed by its rules."""
    side = spec_profile_for(release, flipped)
    impl = Profile(release)

    def spec_factory(config: Any, **kwargs: Any) -> Any:
        return spec.KVCacheManager(config, **kwargs, profile=side)

    def impl_factory(config: Any, **kwargs: Any) -> Any:
        return kvcache.KVCacheManager(config, **kwargs, profile=release)

    namespace: dict[str, Any] = {
        "spec_manager_cls": staticmethod(spec_factory),
        "impl_manager_cls": staticmethod(impl_factory),
        "hasher_switches": {"tagged_extra_keys": impl.tagged_extra_keys,
                            "mm_keys_by_window": impl.mm_keys_by_window},
        "counters": {"steps": 0, "examples": 0},
    }
    name = f"{base.__name__}_{release.replace('.', '_')}" + (f"_without_{flipped}"
                                                           if flipped else "")
    return type(name, (base,), namespace)


@pytest.mark.parametrize("release", MIDDLE)
@pytest.mark.parametrize("name", sorted(BASES))
def test_machine_under_a_middle_release(name: str, release: str,
                                        stateful_settings: settings,
                                        record_property: Any) -> None:
    """kvcache's profile of ``release`` agrees with the spec's on every step."""
    added = run_machine(machine_class(BASES[name], release), stateful_settings,
                        record_property, share=CI_EXAMPLES)
    assert added["steps"] > 0


def test_the_middle_machines_cover_every_middle_release() -> None:
    assert MIDDLE == ("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
                      "0.31.0", "0.32.0")
    for release in MIDDLE:  # each has switches of its own: neither end's set
        assert spec_profile.ON["0.25.1"] < spec_profile.ON[release] < spec_profile.ON["0.33.0"]


def test_a_switch_turned_back_in_the_spec_fails_a_middle_machine() -> None:
    """0.32.0's ``cascade_always_zero`` at 0.25.1's value in the spec alone: within a
    bounded, seeded run the manager machine's common-prefix counts differ, or the
    tables they leave (0.25.1's count reads a request's table, creating an empty one
    for an unknown id, as vLLM's defaultdict does; 0.32.0's reads none)."""
    cls = machine_class(ManagerMachine, "0.32.0", flipped="cascade_always_zero")
    assert not spec_profile_for("0.32.0", "cascade_always_zero").cascade_always_zero
    frame = first_failure(cls)
    assert frame is not None, f"no run of seeds {TEETH_SEEDS} failed"
    assert frame.name in ("get_num_common_prefix_blocks", "states_agree"), frame
