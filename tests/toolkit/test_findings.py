"""Census findings (``kvcache.kit.findings``): unknown differences grouped by root cause,
each with its shortest trace. The planted subjects are in ``planted_findings.py``."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kvcache.kit.cli import main
from kvcache.kit.findings import FindingsCollector, _group_by_kinds, reproduces, shape_of
from kvcache.kit.fuzz import fuzz
from kvcache.kit.levels import trial_for
from kvcache.kit.trace import read_trace

ONE_BUG = "toolkit.planted_findings:ShortHits"
TWO_BUGS = "toolkit.planted_findings:ShortHitsAndRefusals"


def census(subject: str, sequences: int, folder: Path, shrinks: int = 3):  # type: ignore[no-untyped-def]
    trial = trial_for(subject, "hits", None)
    outcome = fuzz(subject, "kvcache", max_sequences=sequences, seconds=None,
                   stream=io.StringIO(), shrink_s=10, census=True, census_dir=folder,
                   trial=trial, shrinks_per_finding=shrinks)  # fmt: skip
    return outcome, trial


def test_two_bugs_are_two_findings_each_with_a_short_replaying_trace(tmp_path: Path) -> None:
    outcome, trial = census(TWO_BUGS, 16, tmp_path)
    signatures = sorted(f.signature for f in outcome.findings)
    assert signatures == [
        "allocate_slots/result result: none",
        "get_computed_blocks/result result.num_computed_tokens: less",
    ]
    assert sum(f.sequences for f in outcome.findings) == sum(outcome.census.values())
    for finding in outcome.findings:
        assert finding.path is not None and finding.path.parent == tmp_path
        trace = read_trace(finding.path)
        assert len(trace.records) == finding.calls <= 6  # shrunk to a few calls
        assert trace.header["finding"] == finding.key
        assert finding.shape == shape_of([(r["op"], r["args"]) for r in trace.records])
        assert reproduces(finding, TWO_BUGS, "kvcache", trial.lockstep)
        assert not reproduces(finding, "kvcache", "kvcache", trial.lockstep)


def test_one_bug_is_one_finding_however_many_are_shrunk(tmp_path: Path) -> None:
    outcome, _ = census(ONE_BUG, 8, tmp_path, shrinks=4)
    assert len(outcome.findings) == 1
    (finding,) = outcome.findings
    assert finding.sequences == sum(outcome.census.values()) >= 4
    assert len(finding.seeds) == 4  # four shrunk, one shape


def test_kinds_containing_anothers_join_it_and_others_stay_apart() -> None:
    a = [("add_request", {}), ("get_computed_blocks", {})]
    b = [("add_request", {}), ("allocate_slots", {}), ("get_computed_blocks", {})]
    c = [("add_request", {}), ("free", {})]
    assert _group_by_kinds([b, a, c, b]) == [[0, 1, 3], [2]]
    assert shape_of(b + a) == ("add_request", "allocate_slots", "get_computed_blocks")


def test_bad_budgets_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="per_signature=0"):
        FindingsCollector().find("kvcache", "kvcache", tmp_path, 1.0, per_signature=0)
    with pytest.raises(ValueError, match="shrinks_per_finding=0"):
        fuzz("kvcache", "kvcache", max_sequences=1, seconds=None, census=True,
             shrinks_per_finding=0)  # fmt: skip


def test_cli_census_prints_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fuzz", "--impl", TWO_BUGS, "--reference", "kvcache", "--compare", "hits",
                 "--census", "--census-dir", str(tmp_path), "--sequences", "16",
                 "--shrink-seconds", "10"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "findings (unknown differences by root cause): 2" in out
    assert "result.num_computed_tokens: less [" in out and "result: none [" in out
