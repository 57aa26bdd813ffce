"""The harness itself: it must catch a broken implementation and shrink the failure.

Each mutant (``conformance/mutants.py``) is kvcache with one realistic bug,
plugged in the way a third party plugs in its manager (``module:factory``).
The random driver must find a divergence within a few sequences, ``shrink``
must cut it to a short trace, and that trace must replay cleanly on vLLM and
fail on the mutant. Without this, "0 mismatches" could mean a blind harness.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from kvcache.kit.driver import Family, Stats, replay_trace, run_sequence, write_counterexample
from kvcache.kit.trace import read_trace

pytestmark = pytest.mark.conformance

MUTANTS = {
    "FreeInAllocationOrder": Family("full", ("full",), enable_caching=True, watermark=0.0),
    "IgnoresWatermark": Family("full", ("full",), enable_caching=False, watermark=0.25),
    "StatsCountPreemptedAsNew": Family("full", ("full",), enable_caching=True, watermark=0.0),
    # the same bug in a hybrid layout: the free order matters per group
    "FreeInAllocationOrder-hybrid": Family("full+swa+mamba", ("full", "swa", "mamba-align")),
    # the retention interval must reach the sliding-window and Mamba caches
    "IgnoresRetentionInterval": Family("swa+mamba", ("swa", "mamba"), retention=True),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_harness_finds_and_shrinks_a_bug(
    name: str, vllm_reference: ModuleType, subject_impl: str, tmp_path: Path
) -> None:
    if subject_impl != "kvcache":
        pytest.skip("the mutants are built on kvcache")
    impl = "conformance.mutants:" + name.partition("-")[0]
    family = MUTANTS[name]
    for seed in range(40):
        result = run_sequence(seed, family, impl, "vllm", stats=Stats())
        # A mutant that cannot be built (e.g. a subclass the compiled build refused)
        # must fail here, not pass as "never diverged".
        assert result.cannot_build is None, f"{name}: {result.cannot_build}"
        if result.mismatch is not None:
            break
    else:
        pytest.fail(f"{name}: 40 random sequences never diverged from vLLM")
    path, num_calls = write_counterexample(result, impl, "vllm", tmp_path / "c.jsonl", 30.0)
    trace = read_trace(path)
    assert num_calls == len(trace.records) <= 25, f"{name}: shrunk trace has {num_calls} calls"
    assert replay_trace(trace, "vllm").mismatch is None
    assert replay_trace(trace, impl).mismatch is not None
