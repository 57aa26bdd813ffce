"""kvcache against the spec on every layout family of the kit, seeded (docs/mutation.md).

The hybrid machine draws its layout at random, so a short run (the mutation
profile's) may never build, say, a Mamba group in "all" mode. Here each
family of ``kvcache.kit.driver.FAMILIES`` (full, sliding window, chunked local,
Mamba in each mode, cross attention, EAGLE, mixed block sizes) runs a fixed set
of seeded scheduler sequences in lockstep with the spec, comparing every result,
event, statistic and the abstract state after each call. No vLLM needed.
"""

from __future__ import annotations

import pytest

from kvcache.kit.driver import FAMILIES, run_sequence

SEEDS = range(8)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_agrees_with_spec(family: str) -> None:
    # A family of a later release's kinds (ring buffers) runs under that profile.
    later = FAMILIES[family].since != "0.25.1"
    subject, reference = ("kvcache-0.33", "spec-0.33") if later else ("kvcache", "spec")
    for seed in SEEDS:
        result = run_sequence(seed, family, subject, reference=reference, num_steps=(20, 80))
        assert result.cannot_build is None, f"{family} seed {seed}: {result.cannot_build}"
        assert result.mismatch is None, f"{family} seed {seed}: {result.mismatch}"
