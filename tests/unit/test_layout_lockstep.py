"""kvcache against the spec on every layout family of the kit, seeded (docs/mutation.md).

The hybrid machine draws its layout at random, so a short run (the mutation
profile's) may never build, say, a Mamba group in "all" mode. Here each
family of ``kvcache.kit.driver.FAMILIES`` (full, sliding window, chunked local,
Mamba in each mode, cross attention, EAGLE, mixed block sizes) runs a fixed set
of seeded scheduler sequences in lockstep with the spec, comparing every result,
event, statistic and the abstract state after each call. No vLLM needed.

``allocate_slots`` serves running requests without new hits by inlined fast
paths; the second test turns them off, so that the general path (the
coordinator's and the per-group managers' ``get_num_blocks_to_allocate`` /
``allocate_new_blocks``, which vLLM's API exposes) is checked on running
requests too.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache
from kvcache.kit.driver import FAMILIES, run_sequence

SEEDS = range(8)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_agrees_with_spec(family: str) -> None:
    for seed in SEEDS:
        result = run_sequence(seed, family, "kvcache", reference="spec", num_steps=(20, 80))
        assert result.mismatch is None, f"{family} seed {seed}: {result.mismatch}"


class GeneralPathManager(kvcache.KVCacheManager):
    """kvcache without the inlined ``allocate_slots`` fast paths."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fast_any = False


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_agrees_with_spec_on_the_general_path(family: str) -> None:
    subject = f"{__name__}:GeneralPathManager"
    for seed in SEEDS:
        result = run_sequence(seed, family, subject, reference="spec", num_steps=(20, 80))
        assert result.mismatch is None, f"{family} seed {seed}: {result.mismatch}"
