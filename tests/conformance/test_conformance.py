"""kvcache (or ``$KVCACHE_CONFORMANCE_IMPL``) against the real vLLM 0.25.1, call by call.

Each family runs ``CONFORMANCE_SEQUENCES`` (default 100) seeded random scheduler
sequences (``kvcache.kit.driver``) in lockstep and requires zero mismatches:
equal results, equal exceptions (vLLM's ``AssertionError`` may be our
``ValueError``), equal events, stats and block hashes, and an equal abstract
state after every call. Families: one full-attention group (caching on and
off, three watermarks: the core scope) and every hybrid layout — full +
sliding window, full + chunked local, full + Mamba (align / all / none),
full + cross attention (caching off), three-group hybrids, EAGLE, reference
sliding window (R-SWA alone, with full attention, with a sliding window; each
must release a gap somewhere) — with mixed block sizes where vLLM allows them.
Sink full attention has no family: vLLM 0.25.1 cannot build a manager with a sink
group, and every side must refuse it alike. The summary line counts sequences per
family. The first mismatch of a family is shrunk to a minimal trace under
``build/conformance-failures/``; ``python -m kvcache replay`` replays it.

``CONFORMANCE_SEED`` shifts every seed, for longer fuzzing runs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.driver import (
    FAMILIES,
    Family,
    SequenceResult,
    Stats,
    run_sequence,
    write_counterexample,
)
from kvcache.kit.sides import CannotBuild, make_side

pytestmark = pytest.mark.conformance

SEQUENCES_PER_FAMILY = int(os.environ.get("CONFORMANCE_SEQUENCES", "100"))
BASE_SEED = int(os.environ.get("CONFORMANCE_SEED", "0"))
FAILURE_DIR = Path(__file__).resolve().parents[2] / "build" / "conformance-failures"

# The core scope: one full-attention group, caching on and off, three watermarks.
CORE = [
    pytest.param(
        dataclasses.replace(FAMILIES["full"], enable_caching=caching, watermark=watermark),
        id=f"full-{'caching' if caching else 'nocache'}-wm{watermark}",
    )
    for caching in (True, False)
    for watermark in (0.0, 0.1, 0.25)
]
# Every other layout family of the kit, caching drawn per sequence (85% on).
# (Families of a later release's kinds, ``since`` > 0.25.1, cannot be built by vLLM
# 0.25.1: test_later_release_layouts_refused_as_vllm_refuses_them.)
LAYOUTS = [
    pytest.param(family, id=name)
    for name, family in FAMILIES.items()
    if name != "full" and family.since == "0.25.1"
]
FAMILY_PARAMS = CORE + LAYOUTS
FAMILY_IDS = [p.id for p in FAMILY_PARAMS]

# Paths the driver must reach in every family, so that a driver bug cannot
# turn the comparison into a trivial one.
REQUIRED_PATHS = ["allocate_none", "raises:ValueError", "raises:AssertionError", "reset_True"]
REQUIRED_WITH_CACHING = ["prefix_hit", "event:BlockStored", "event:BlockRemoved"]

STATS = Stats()


def family_seed(family_index: int, index: int) -> int:
    return BASE_SEED * 10_000_000 + family_index * 100_000 + index


def report(results: list[SequenceResult], subject: str) -> str:
    """Shrink the first mismatch and describe all of them."""
    first = results[0]
    assert first.mismatch is not None
    path = FAILURE_DIR / f"{subject.replace(':', '_')}-{first.family}-seed-{first.seed}.jsonl"
    write_counterexample(first, subject, "vllm", path)
    seeds = ", ".join(str(r.seed) for r in results[:20])
    return (
        f"{len(results)} sequence(s) diverge from vLLM (seeds {seeds}).\n"
        f"First, seed {first.seed}, config {first.config}:\n{first.mismatch}\n"
        f"Minimal trace: {path}\n"
        f"Replay it: .venv/bin/python -m kvcache replay {path} --impl {subject}"
    )


@pytest.mark.parametrize("family", FAMILY_PARAMS, ids=FAMILY_IDS)
def test_random_sequences_match_vllm(
    vllm_reference: ModuleType,
    subject_impl: str,
    request: pytest.FixtureRequest,
    family: Family,
) -> None:
    stats = Stats()
    started = time.monotonic()
    failures = []
    family_index = FAMILY_IDS.index(request.node.callspec.id)
    for index in range(SEQUENCES_PER_FAMILY):
        seed = family_seed(family_index, index)
        result = run_sequence(seed, family, subject_impl, "vllm", stats)
        if result.mismatch is not None:
            failures.append(result)
    stats.seconds = time.monotonic() - started
    STATS.add(stats)
    print(f"\n{stats.summary()} in {stats.seconds:.1f}s")
    assert not failures, report(failures, subject_impl)
    caching = family.enable_caching is not False and "cross" not in family.kinds
    required = REQUIRED_PATHS + (REQUIRED_WITH_CACHING if caching else [])
    if "rswa" in family.kinds:
        required.append("rswa_gap")  # some decode passed the window: a gap was freed
    missing = [path for path in required if stats.events[path] == 0]
    assert not missing, f"the driver never reached {missing}: {dict(stats.events)}"


BAD_CONFIGS: list[Any] = [
    pytest.param({"watermark": -0.1}, id="negative-watermark"),
    pytest.param({"num_blocks": 0}, id="zero-blocks"),
    pytest.param({"hash_block_size_override": 2}, id="hash-size"),
    pytest.param({"prefix_cache_retention_interval": 4}, id="retention-without-window"),
]


@pytest.mark.parametrize("change", BAD_CONFIGS)
def test_constructor_rejects_what_vllm_rejects(
    vllm_reference: ModuleType, subject_impl: str, change: dict[str, Any]
) -> None:
    fields: dict[str, Any] = {"num_blocks": 8, "block_size": 4, "max_model_len": 32}
    fields.update(change)
    config = ManagerConfig.full_attention(**fields)
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


@pytest.mark.parametrize("interval", [-4, 6, 0, 8])
def test_retention_interval_is_checked_as_vllm_checks_it(
    vllm_reference: ModuleType, subject_impl: str, interval: int
) -> None:
    """VLLM_PREFIX_CACHE_RETENTION_INTERVAL on full + sliding window (scheduler
    block size 4): negative or not a multiple of 4 is refused, 0 and 8 are not."""
    groups = (GroupConfig("full", 4), GroupConfig("sliding_window", 2, sliding_window=3))
    config = ManagerConfig(16, groups, 32, prefix_cache_retention_interval=interval)
    errors = []
    for impl in ("vllm", subject_impl):
        try:
            make_side(impl, config)
        except CannotBuild as exc:
            assert isinstance(exc.__cause__, ValueError), f"{impl}: {exc.__cause__!r}"
            errors.append(str(exc.__cause__))
        else:
            errors.append(None)
    vllm_error, subject_error = errors
    assert (vllm_error is None) == (interval in (0, 8)), vllm_error
    assert (subject_error is None) == (vllm_error is None), (vllm_error, subject_error)
    if subject_error is not None and subject_impl == "kvcache":
        assert f"VLLM_PREFIX_CACHE_RETENTION_INTERVAL={interval} must be" in subject_error


@pytest.mark.parametrize("kinds", [("sink",), ("full", "sink")], ids=["sink", "full+sink"])
def test_sink_layouts_refused_as_vllm_refuses_them(
    vllm_reference: ModuleType, subject_impl: str, kinds: tuple[str, ...]
) -> None:
    """vLLM 0.25.1's coordinator cannot build a sink group (its manager's constructor
    lacks ``scheduler_block_size``): every implementation refuses with a TypeError,
    so no sink family can run (docs/divergences.md)."""
    groups = tuple(
        GroupConfig(kind, 4, sink_len=8 if kind == "sink" else None, num_kv_heads=i + 1)
        for i, kind in enumerate(kinds)
    )
    config = ManagerConfig(num_blocks=16, groups=groups, max_model_len=32)
    for impl in ("vllm", subject_impl):
        # (the compiled build's TypeError words it otherwise)
        with pytest.raises(CannotBuild, match=r"\(TypeError: "):
            make_side(impl, config)


# (The lookahead families have 0.25.1's kinds; only the arguments they draw are 0.33.0's.)
LATER_FAMILIES = [f for f in FAMILIES.values() if f.since != "0.25.1" and not f.lookahead]


@pytest.mark.parametrize("family", LATER_FAMILIES, ids=[f.name for f in LATER_FAMILIES])
def test_later_release_layouts_refused_as_vllm_refuses_them(
    vllm_reference: ModuleType, subject_impl: str, family: Family
) -> None:
    """A family of vLLM 0.33.0's kinds (a ring buffer: ``CircularBufferSpec``; Mamba
    prefill checkpoints: ``MambaSpec.num_prefill_checkpoint_blocks``) cannot be built by
    vLLM 0.25.1, which has no such spec class or field; the subject under its 0.25.1
    profile refuses it too, naming the class or field (``circular_buffer_groups``,
    ``mamba_prefill_checkpoints`` off). Nor can 0.25.1 cache several groups under
    decode context parallelism (the ``-dcp`` families of 0.33.0's per-group geometry)."""
    import random

    from kvcache.kit.driver import random_config

    named = "num_prefill_checkpoint_blocks" if "mamba-checkpoint" in family.kinds else (
        # several cached groups under dcp: 0.25.1 asserts (kvcache's ContextParallelError)
        "DCP not support hybrid|do not support context parallelism" if family.context_parallel
        else "CircularBufferSpec")
    for index in range(5):
        config = random_config(random.Random(index), family)
        for impl in ("vllm", subject_impl):
            with pytest.raises(CannotBuild, match=named) as info:
                make_side(impl, config)
            assert f"{impl} rejects the config" in info.value.reason
