"""The hybrid machine with issue 14's kinds: kvcache against spec.

``NewKindsMachine`` is ``HybridMachine`` (``test_hybrid_machine.py``) that also
draws, for every full-attention or sliding-window group, its MLA variant
(``MLAAttentionSpec``: full attention whose fresh blocks are reported for
zeroing and whose events say ``mla_attention``; ``SlidingWindowMLASpec``: a
sliding window whose events say ``sliding_window_mla``), and, for a layout of
one full-attention group, decode / prefill context parallelism
(``dcp_world_size``, ``pcp_world_size``: a block spans ``block_size * dcp *
pcp`` tokens; ``scheduler_block_size`` and ``hash_block_size`` are that size).
A subclass, so ``HybridMachine``'s own examples stay what they were.
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar

from hypothesis import seed, settings
from hypothesis.stateful import run_state_machine_as_test

from .test_hybrid_machine import HybridMachine

# Examples of the CI profile for this machine (the hybrid machine runs 400).
CI_EXAMPLES = 120


class NewKindsMachine(HybridMachine):
    """``HybridMachine`` drawing MLA variants and context parallelism too."""

    counters: ClassVar[dict[str, int]] = {"steps": 0, "examples": 0}
    NEW_KINDS: ClassVar[bool] = True


def test_new_kinds_machine(stateful_settings: settings, record_property: Any) -> None:
    """kvcache agrees with spec on layouts with MLA groups and context parallelism."""
    run_seed = int(os.environ.get("STATEFUL_SEED") or random.SystemRandom().getrandbits(64))
    examples = stateful_settings.max_examples * CI_EXAMPLES // 600

    @seed(run_seed)
    def machine() -> NewKindsMachine:
        return NewKindsMachine()

    before = dict(NewKindsMachine.counters)
    try:
        run_state_machine_as_test(
            machine, settings=settings(stateful_settings, max_examples=examples)
        )
    except Exception as error:
        error.add_note(f"reproduce with: STATEFUL_SEED={run_seed} (and the same profile)")
        raise
    finally:
        record_property("stateful_seed", run_seed)
        for key, value in NewKindsMachine.counters.items():
            record_property(f"stateful_{key}", value - before[key])
