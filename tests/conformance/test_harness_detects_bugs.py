"""The harness itself: it must catch a broken implementation and shrink the failure.

Each mutant is kvcache with one realistic bug injected at the API boundary. The
random driver must find a divergence within a few sequences, ``shrink`` must
cut it to a short trace, and that trace must replay cleanly on vLLM and fail
on the mutant. Without this, "0 mismatches" could mean a blind harness.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conformance.driver import Stats, replay_trace, run_sequence, write_failure
from conformance.sides import SIDE_FACTORIES, ManagerConfig, PackageSide
from conformance.trace import read_trace

pytestmark = pytest.mark.conformance


class FreeInAllocationOrder(PackageSide):
    """Bug: ``free`` releases blocks head first, so a chain's head is evicted first."""

    def op_free(self, args: Mapping[str, Any]) -> Any:
        blocks = self.manager.pop_blocks_for_free(self.request(args))
        self.manager.block_pool.free_blocks(blocks)
        return None


class IgnoresWatermark(PackageSide):
    """Bug: admissions never keep the watermark free."""

    def op_allocate_slots(self, args: Mapping[str, Any]) -> Any:
        return super().op_allocate_slots({**args, "has_scheduled_reqs": False})


class StatsCountPreemptedAsNew(PackageSide):
    """Bug: a preempted request's lookup is counted as a new request's."""

    def op_update_request(self, args: Mapping[str, Any]) -> Any:
        return super().op_update_request({k: v for k, v in args.items() if k != "num_preemptions"})


MUTANTS = {
    "mutant-free-order": (FreeInAllocationOrder, True, 0.0),
    "mutant-watermark": (IgnoresWatermark, False, 0.25),
    "mutant-preempted-stats": (StatsCountPreemptedAsNew, True, 0.0),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_harness_finds_and_shrinks_a_bug(
    name: str, vllm_reference: ModuleType, subject_impl: str, tmp_path: Path
) -> None:
    if subject_impl != "kvcache":
        pytest.skip("the mutants are built on kvcache")
    cls, enable_caching, watermark = MUTANTS[name]

    def factory(config: ManagerConfig, hash_seed: str) -> PackageSide:
        return cls("kvcache", config, hash_seed)

    SIDE_FACTORIES[name] = factory
    try:
        for seed in range(40):
            result = run_sequence(seed, enable_caching, watermark, name, stats=Stats())
            if result.mismatch is not None:
                break
        else:
            pytest.fail(f"{name}: 40 random sequences never diverged from vLLM")
        path = write_failure(result, name, shrink_budget_s=30.0, directory=tmp_path)
        config, records = read_trace(path)
        assert len(records) <= 25, f"{name}: shrunk trace still has {len(records)} calls"
        assert replay_trace(config, records, "vllm") is None
        assert replay_trace(config, records, name) is not None
    finally:
        del SIDE_FACTORIES[name]
