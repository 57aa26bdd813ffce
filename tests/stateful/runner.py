"""One runner for every Hypothesis state machine of this directory.

Each run draws a fresh seed (or takes ``STATEFUL_SEED``), names it on failure so the
run can be reproduced, and reports the machine's counters (examples, steps) to the
terminal summary of ``conftest.py``.
"""

from __future__ import annotations

import os
import random
from typing import Any, Protocol

from hypothesis import seed, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test


class CountingMachine(Protocol):
    """A machine class with the class-level counters the runner reports."""

    counters: dict[str, int]

    def __call__(self) -> RuleBasedStateMachine: ...


def run_machine(
    cls: CountingMachine,
    stateful_settings: settings,
    record_property: Any,
    share: int | None = None,
) -> dict[str, int]:
    """Run machine ``cls`` under ``stateful_settings``; the counters this run added.

    ``share`` scales the profile's examples for a machine that runs a reduced budget:
    ``share`` examples per 600 of the profile's (at least one); None runs them all.
    """
    run_seed = int(os.environ.get("STATEFUL_SEED") or random.SystemRandom().getrandbits(64))
    run_settings = stateful_settings
    if share is not None:
        examples = max(1, stateful_settings.max_examples * share // 600)
        run_settings = settings(stateful_settings, max_examples=examples)

    @seed(run_seed)
    def machine() -> RuleBasedStateMachine:
        return cls()

    before = dict(cls.counters)
    added: dict[str, int] = {}
    try:
        run_state_machine_as_test(machine, settings=run_settings)
    except Exception as error:
        error.add_note(f"reproduce with: STATEFUL_SEED={run_seed} (and the same profile)")
        raise
    finally:
        record_property("stateful_seed", run_seed)
        for key, value in cls.counters.items():
            added[key] = value - before.get(key, 0)
            record_property(f"stateful_{key}", added[key])
    return added
