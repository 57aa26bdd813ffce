"""``python -m kvcache``: record, replay, fuzz (and bench/simulate still work).

The planted bug is ``conformance.mutants:FreeInAllocationOrder`` — kvcache
whose ``free`` releases a request's blocks head first — plugged in the way a
third party plugs in its own manager (``module:factory``).
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.kit.adapters import make_impl
from kvcache.kit.cli import build_parser, main
from kvcache.kit.sides import resolve_adapter
from kvcache.kit.trace import read_trace
from kvcache.kit.workloads import make_workload

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "conformance.mutants:FreeInAllocationOrder"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_texts_read_well(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    top = parser.format_help()
    for command in ("record", "replay", "fuzz", "bench", "simulate"):
        assert command in top
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "first divergence" in sub["replay"].format_help()
    assert "counterexample" in sub["fuzz"].format_help()
    assert "docs/trace-format.md" in sub["record"].format_help()
    for command in sub:
        assert "module:factory" in sub[command].format_help() or command == "bench"


def test_python_dash_m_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache", "replay", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "TRACE" in proc.stdout


def test_record_then_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat-swa.jsonl.gz"
    code, stdout, _ = run(
        capsys,
        "record",
        "--impl",
        "kvcache",
        "--workload",
        "chat-swa",
        "--requests",
        "3",
        "--out",
        str(out),
    )
    assert code == 0 and "recorded" in stdout
    assert gzip.decompress(out.read_bytes()).startswith(b'{"record": "header"')
    trace = read_trace(out)
    ops = {r["op"] for r in trace.records}
    assert {"add_request", "get_computed_blocks", "allocate_slots", "free", "usage"} <= ops
    assert trace.config.layout == "full+swa"
    code, stdout, _ = run(capsys, "replay", str(out), "--impl", "spec")
    assert code == 0 and "replay identically on spec" in stdout


def test_replay_reports_a_planted_divergence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "random.jsonl"
    code, _, _ = run(
        capsys,
        "record",
        "--impl",
        "kvcache",
        "--workload",
        "random",
        "--layout",
        "full+swa",
        "--seed",
        "1",
        "--out",
        str(out),
    )
    assert code == 0
    code, stdout, _ = run(capsys, "replay", str(out), "--impl", PLANTED, "--context", "3")
    assert code == 1
    assert f"DIVERGES on {PLANTED}" in stdout
    assert "free(request_id=" in stdout  # the divergent call
    assert "preceding calls" in stdout
    assert "state after the call, expected (from the trace)" in stdout
    assert "state after the call, observed" in stdout
    assert "free_queue: lengths" in stdout  # the difference, in short
    code, stdout, _ = run(capsys, "replay", str(out), "--impl", "kvcache")
    assert code == 0


def test_fuzz_clean_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = run(capsys, "fuzz", "--impl", "kvcache", "--sequences", "32")
    assert code == 0, stdout + stderr
    assert "no divergence" in stdout and "32 sequences" in stdout
    assert "sequences" in stderr  # the progress line
    for layout in ("full+swa", "full+mamba-align", "full+cross", "eagle-hybrid"):
        assert layout in stdout


def test_fuzz_writes_a_reproducible_counterexample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "counterexample.jsonl"
    code, stdout, stderr = run(
        capsys,
        "fuzz",
        "--impl",
        PLANTED,
        "--sequences",
        "50",
        "--seed",
        "3",
        "--out",
        str(out),
        "--shrink-seconds",
        "20",
    )
    assert code == 1, stdout + stderr
    assert "DIVERGENCE" in stdout and f"replay {out} --impl {PLANTED}" in stdout
    trace = read_trace(out)
    assert len(trace.records) <= 25
    assert trace.records[-1]["op"] in ("free", "free_blocks")
    code, stdout, _ = run(capsys, "replay", str(out), "--impl", PLANTED)
    assert code == 1 and "DIVERGES" in stdout
    for impl in ("kvcache", "spec"):
        code, _, _ = run(capsys, "replay", str(out), "--impl", impl)
        assert code == 0


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "fuzz", "--layouts", "full+nope", "--sequences", "1")
    assert code == 2 and "unknown layout family" in err
    code, _, err = run(capsys, "simulate", "--impl", "no_such_module:make", "--requests", "2")
    assert code == 2 and "cannot import 'no_such_module'" in err
    code, _, err = run(capsys, "fuzz", "--impl", "kvcache:NoSuchFactory", "--sequences", "1")
    assert code == 2 and "has no attribute 'NoSuchFactory'" in err
    code, _, err = run(capsys, "replay", "tests/data/random_caching.jsonl", "--impl", "vllm:x")
    assert code == 2 and "Traceback" not in err


def test_one_impl_name_for_every_command() -> None:
    workload = make_workload("chat", 3)
    for name in ("kvcache", "spec", PLANTED, "kvcache:KVCacheManager"):
        assert resolve_adapter(name).name == name
        assert make_impl(name, workload).name == name
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        resolve_adapter("kvcache:Nope")


def test_bench_and_simulate_still_work(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcache.kit import bench

    code, stdout, _ = run(
        capsys, "simulate", "--workload", "chat-swa", "--requests", "20", "--rows", "2"
    )
    assert code == 0 and "infinite-cache ideal hit rate" in stdout
    assert "hit rate  preempted" in stdout
    result = bench.bench_workload("chat", ["kvcache", "spec"], 1, 10)
    assert result.identical
    # Issue 28: the requests' hashing is timed beside the manager, and the sum.
    for timing in result.timings.values():
        assert len(timing.hashing_seconds) == 1 and timing.hashing_seconds[0] > 0
        assert timing.total_seconds[0] > timing.manager_seconds[0]
    text = bench.format_workload(result)
    assert "hashing s" in text and "; hashing " in text and "; sum " in text


def test_bench_times_a_vllm_trace_side_by_side(
    capsys: pytest.CaptureFixture[str], vllm_reference: object
) -> None:
    """``bench --traces``: vLLM and kvcache replay a trace recorded from vLLM with the
    recorded results (a ValueError where vLLM asserts included), each manager call
    timed once per replay on every implementation."""
    from kvcache.kit import bench

    trace = read_trace(ROOT / "tests/data/random_caching_watermark.jsonl")
    assert any("raises" in r for r in trace.records)
    result = bench.bench_trace(
        trace, ["kvcache", "vllm"], repetitions=2, min_records=200, min_replays=1
    )
    assert result.identical and result.replays_per_repetition == 2
    manager_ops = [r for r in trace.records if r["op"] not in ("add_request", "update_request")]
    ops = {r["op"] for r in manager_ops}
    assert ops >= {"allocate_slots", "free", "take_events"}
    no_manager = sum(r["op"] == "append_output_token_ids" for r in manager_ops)
    admissions = sum(  # the adapter's admission hook, timed too
        r["op"] == "allocate_slots"
        and r["args"].get("new_computed_blocks") == "last"
        and r.get("ok") is not None
        for r in manager_ops
    )
    assert result.timed_calls == len(manager_ops) - no_manager + admissions
    assert all(len(s) == 2 and min(s) > 0 for s in result.manager_seconds.values())
    assert "ratio vllm/kvcache" in bench.format_trace(result)
    code, stdout, _ = run(
        capsys,
        "bench",
        "--workloads",
        "",
        "--impls",
        "kvcache,vllm",
        "--traces",
        "tests/data/random_no_caching.jsonl",
        "--trace-repetitions",
        "1",
        "--trace-min-records",
        "1",
        "--trace-min-replays",
        "1",
    )
    assert code == 0 and "random_no_caching.jsonl (full)" in stdout, stdout


def test_bench_rejects_a_trace_an_implementation_does_not_replay() -> None:
    from kvcache.kit import bench

    trace = read_trace(ROOT / "tests/data/prefix_hits_and_eviction.jsonl")
    index = next(
        i
        for i, r in enumerate(trace.records)
        if r["op"] == "get_computed_blocks" and r["ok"]["num_computed_tokens"] > 0
    )
    miss = {"block_ids": [[]], "num_computed_tokens": 0}
    trace.records[index] = {**trace.records[index], "ok": miss}
    with pytest.raises(bench.TraceReplayError, match="kvcache does not replay identically"):
        bench.bench_trace(trace, ["kvcache"], repetitions=1)
    with pytest.raises(bench.TraceReplayError, match=f"kvcache: record {index}"):
        bench.timed_replay(trace, "kvcache")


@pytest.mark.skipif(os.environ.get("CI") is None, reason="needs vLLM; CI has it")
def test_record_on_vllm_replays_on_kvcache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], vllm_reference: object
) -> None:
    out = tmp_path / "vllm-chat-mamba.jsonl.gz"
    code, stdout, _ = run(
        capsys,
        "record",
        "--impl",
        "vllm",
        "--workload",
        "chat-mamba",
        "--requests",
        "3",
        "--out",
        str(out),
    )
    assert code == 0 and "on vllm 0.25.1" in stdout
    code, stdout, _ = run(capsys, "replay", str(out), "--impl", "kvcache")
    assert code == 0, stdout
