"""Replay the vLLM-recorded traces of tests/data/*.jsonl[.gz], call by call.

Against the implementation under test (no vLLM needed: the trace holds vLLM's
results and states), and against the installed vLLM itself, which proves the
stored traces are still what vLLM 0.25.1 does. Re-record them with
``make traces`` (``scripts/record_vllm_traces.py``).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from kvcache.kit.driver import describe_calls, replay_trace
from kvcache.kit.trace import read_trace

pytestmark = pytest.mark.conformance

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = sorted([*DATA.glob("*.jsonl"), *DATA.glob("*.jsonl.gz")])
HYBRID = [p for p in TRACES if "hybrid" in p.name]


def check_replay(path: Path, impl: str) -> None:
    trace = read_trace(path)
    mismatch = replay_trace(trace, impl).mismatch
    if mismatch is not None:
        first = max(0, mismatch.index - 15)
        shown = trace.records[first : mismatch.index + 1]
        pytest.fail(
            f"{path.name} diverges on {impl}: {mismatch}\n"
            f"last calls (vLLM's results):\n{describe_calls(shown, first)}",
            pytrace=False,
        )


def test_traces_are_there() -> None:
    assert len(TRACES) >= 3, f"expected recorded traces in {DATA}"
    assert len(HYBRID) >= 4, f"expected recorded hybrid traces in {DATA}"
    for path in TRACES:
        assert read_trace(path).recorded_with == "vllm 0.25.1", path


@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_trace_replays_on_implementation(path: Path, subject_impl: str) -> None:
    check_replay(path, subject_impl)


@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_trace_still_matches_vllm(path: Path, vllm_reference: ModuleType) -> None:
    check_replay(path, "vllm")
