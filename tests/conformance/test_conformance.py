"""kvcache (or ``$KVCACHE_CONFORMANCE_IMPL``) against the real vLLM 0.25.1, call by call.

Each family runs a share of ``CONFORMANCE_SEQUENCES`` (default 100) seeded
random scheduler sequences (875 per run in all) in lockstep and requires zero
mismatches: equal results, equal exceptions (vLLM's ``AssertionError`` may be
our ``ValueError``), equal events, stats and block hashes, and an equal
abstract state after every call. The first mismatch of a family is shrunk to
a minimal trace under ``build/conformance-failures/`` that
``scripts/replay_trace.py`` replays.

``CONFORMANCE_SEED`` shifts every seed, for longer fuzzing runs.
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import Any

import pytest

from conformance.driver import STATS, SequenceResult, Stats, run_sequence, write_failure
from conformance.sides import ManagerConfig, make_side

pytestmark = pytest.mark.conformance

SEQUENCES_PER_FAMILY = int(os.environ.get("CONFORMANCE_SEQUENCES", "100"))
BASE_SEED = int(os.environ.get("CONFORMANCE_SEED", "0"))

# (enable_caching, watermark, group kinds, share of CONFORMANCE_SEQUENCES). One
# full-attention group is the core scope; two full-attention groups of different
# block sizes exercise the hybrid coordinator; sliding-window and chunked-local
# groups, alone and beside a full-attention group, the windowed managers.
F, SWA, CLA = "full", "sliding_window", "chunked_local"
FAMILIES = [
    pytest.param(True, 0.0, (F,), 1.0, id="caching-wm0"),
    pytest.param(True, 0.1, (F,), 1.0, id="caching-wm0.1"),
    pytest.param(True, 0.25, (F,), 1.0, id="caching-wm0.25"),
    pytest.param(False, 0.0, (F,), 1.0, id="nocache-wm0"),
    pytest.param(False, 0.1, (F,), 1.0, id="nocache-wm0.1"),
    pytest.param(False, 0.25, (F,), 1.0, id="nocache-wm0.25"),
    pytest.param(True, 0.1, (F, F), 0.5, id="two-groups-caching"),
    pytest.param(False, 0.0, (F, F), 0.5, id="two-groups-nocache"),
    pytest.param(True, 0.1, (SWA,), 0.5, id="sliding-window-caching"),
    pytest.param(False, 0.0, (SWA,), 0.25, id="sliding-window-nocache"),
    pytest.param(True, 0.0, (F, SWA), 0.5, id="full+sliding-window-caching"),
    pytest.param(True, 0.1, (CLA,), 0.25, id="chunked-local-caching"),
    pytest.param(True, 0.0, (F, CLA), 0.25, id="full+chunked-local-caching"),
]

# Paths the driver must reach in every family, so that a driver bug cannot
# turn the comparison into a trivial one.
REQUIRED_PATHS = ["allocate_none", "raises:ValueError", "raises:AssertionError", "reset_True"]
REQUIRED_WITH_CACHING = ["prefix_hit", "event:BlockStored", "event:BlockRemoved"]


def family_seed(family_index: int, index: int) -> int:
    return BASE_SEED * 10_000_000 + family_index * 100_000 + index


def report(results: list[SequenceResult], subject: str) -> str:
    """Shrink the first mismatch and describe all of them."""
    first = results[0]
    assert first.mismatch is not None
    path = write_failure(first, subject)
    seeds = ", ".join(str(r.seed) for r in results[:20])
    return (
        f"{len(results)} sequence(s) diverge from vLLM (seeds {seeds}).\n"
        f"First, seed {first.seed}, config {first.config}:\n{first.mismatch}\n"
        f"Minimal trace: {path}\n"
        f"Replay it: .venv/bin/python scripts/replay_trace.py {path} --impl {subject}"
    )


@pytest.mark.parametrize(("enable_caching", "watermark", "group_kinds", "share"), FAMILIES)
def test_random_sequences_match_vllm(
    vllm_reference: ModuleType,
    subject_impl: str,
    request: pytest.FixtureRequest,
    enable_caching: bool,
    watermark: float,
    group_kinds: tuple[str, ...],
    share: float,
) -> None:
    family = Stats()
    started = time.monotonic()
    failures = []
    family_index = [p.id for p in FAMILIES].index(request.node.callspec.id)
    for index in range(max(1, int(SEQUENCES_PER_FAMILY * share))):
        seed = family_seed(family_index, index)
        result = run_sequence(
            seed, enable_caching, watermark, subject_impl, stats=family, group_kinds=group_kinds
        )
        if result.mismatch is not None:
            failures.append(result)
    STATS.sequences += family.sequences
    STATS.calls += family.calls
    STATS.mismatching_sequences += family.mismatching_sequences
    STATS.assert_as_value_error += family.assert_as_value_error
    STATS.events.update(family.events)
    STATS.seconds += time.monotonic() - started
    print(f"\n{family.summary()} in {time.monotonic() - started:.1f}s")
    assert not failures, report(failures, subject_impl)
    required = REQUIRED_PATHS + (REQUIRED_WITH_CACHING if enable_caching else [])
    missing = [path for path in required if family.events[path] == 0]
    assert not missing, f"the driver never reached {missing}: {dict(family.events)}"


BAD_CONFIGS: list[Any] = [
    pytest.param({"watermark": -0.1}, id="negative-watermark"),
    pytest.param({"num_blocks": 0}, id="zero-blocks"),
    pytest.param({"block_sizes": (4,), "hash_block_size_override": 2}, id="hash-size"),
]


@pytest.mark.parametrize("change", BAD_CONFIGS)
def test_constructor_rejects_what_vllm_rejects(
    vllm_reference: ModuleType, subject_impl: str, change: dict[str, Any]
) -> None:
    fields: dict[str, Any] = {"num_blocks": 8, "block_sizes": (2,), "max_model_len": 32}
    fields.update(change)
    config = ManagerConfig(**fields)
    errors = []
    for impl in ("vllm", subject_impl):
        try:
            make_side(impl, config)
        except Exception as exc:
            errors.append(type(exc).__name__)
        else:
            errors.append(None)
    vllm_error, subject_error = errors
    assert vllm_error is not None, f"vLLM accepted {change}"
    assert subject_error in (vllm_error, "ValueError"), (
        f"vLLM raised {vllm_error} for {change}; {subject_impl} gave {subject_error}"
    )
