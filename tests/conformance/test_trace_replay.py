"""Replay the vLLM-recorded traces of tests/data/*.jsonl, call by call.

Against the implementation under test (no vLLM needed: the trace holds vLLM's
results and states), and against the installed vLLM itself, which proves the
stored traces are still what vLLM 0.25.1 does. Re-record them with
``scripts/record_vllm_traces.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from conformance.driver import describe_calls, replay_trace
from conformance.trace import read_trace

pytestmark = pytest.mark.conformance

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = sorted(DATA.glob("*.jsonl"))


def check_replay(path: Path, impl: str) -> None:
    config, records = read_trace(path)
    mismatch = replay_trace(config, records, impl)
    if mismatch is not None:
        shown = records[max(0, mismatch.index - 15) : mismatch.index + 1]
        pytest.fail(
            f"{path.name} diverges on {impl}: {mismatch}\n"
            f"last calls (vLLM's results):\n{describe_calls(shown)}",
            pytrace=False,
        )


def test_traces_are_there() -> None:
    assert len(TRACES) >= 3, f"expected recorded traces in {DATA}"


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_trace_replays_on_implementation(path: Path, subject_impl: str) -> None:
    check_replay(path, subject_impl)


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_trace_still_matches_vllm(path: Path, vllm_reference: ModuleType) -> None:
    check_replay(path, "vllm")
