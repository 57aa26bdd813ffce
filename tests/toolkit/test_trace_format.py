"""The trace format (docs/trace-format.md): round trips, and clear errors for bad files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvcache.kit.cli import main
from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.record import record_random
from kvcache.kit.sides import Side
from kvcache.kit.trace import CALL_OPS, TRACE_VERSION, TraceError, read_trace, write_trace


@pytest.fixture(scope="module")
def recorded() -> tuple[dict, list[dict]]:
    """A short random hybrid sequence recorded on spec (no vLLM needed)."""
    return record_random("full+swa", 3, "spec", num_steps=(15, 15))


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path: Path, recorded: tuple[dict, list[dict]], name: str) -> None:
    header, records = recorded
    path = write_trace(tmp_path / name, header, records)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    trace = read_trace(path)
    assert trace.records == records
    assert trace.config == ManagerConfig.from_record(header["config"])
    assert trace.recorded_with.startswith("spec")
    lines = [json.loads(line) for line in _text(path).splitlines()]
    assert lines[0]["record"] == "header" and lines[0]["version"] == TRACE_VERSION
    assert lines[-1] == {"record": "end", "num_records": len(records)}
    kinds = {line["record"] for line in lines[1:-1]}
    assert kinds == {"request", "call"}


def test_config_round_trip() -> None:
    config = ManagerConfig(
        num_blocks=9,
        groups=(
            GroupConfig("full", 2, is_eagle_group=True),
            GroupConfig("mamba", 4, mamba_cache_mode="align", num_speculative_blocks=2),
            GroupConfig("sliding_window", 2, sliding_window=5, num_kv_heads=3),
        ),
        max_model_len=40,
        use_eagle=True,
    )
    assert ManagerConfig.from_record(json.loads(json.dumps(config.to_record()))) == config
    assert config.layout == "full+mamba-align+swa"
    assert (config.scheduler_block_size, config.hash_block_size) == (4, 2)
    # The retention interval travels in the header only when it is set.
    assert "prefix_cache_retention_interval" not in config.to_record()
    sparse = ManagerConfig(9, config.groups, 40, prefix_cache_retention_interval=0)
    assert sparse.to_record()["prefix_cache_retention_interval"] == 0
    assert ManagerConfig.from_record(json.loads(json.dumps(sparse.to_record()))) == sparse
    with pytest.raises(ValueError, match="prefix_cache_retention_interval='8'"):
        ManagerConfig(9, config.groups, 40, prefix_cache_retention_interval="8")  # type: ignore[arg-type]


def _text(path: Path) -> str:
    data = path.read_bytes()
    return (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _bad_traces(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    lines = _text(good).splitlines()
    header = json.loads(lines[0])
    future = _write_lines(tmp_path / "future.jsonl", [json.dumps({**header, "version": 3})])
    v1 = _write_lines(
        tmp_path / "v1.jsonl", [json.dumps({"kind": "config", "format": "kvcache-trace/1"})]
    )
    unknown_op = json.dumps({"record": "call", "op": "alocate_slots", "args": {}, "ok": None})
    gz = good.read_bytes() if good.suffix == ".gz" else gzip.compress(good.read_bytes())
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    return {
        "wrong version": (future, "unsupported trace version 3"),
        "version 1": (v1, "version 1"),
        "cut gzip": (tmp_path / "cut.jsonl.gz", "cut or corrupt"),
        "no end record": (_write_lines(tmp_path / "noend.jsonl", lines[:-1]), "cut short"),
        "cut line": (
            _write_lines(tmp_path / "cutline.jsonl", [*lines[:3], lines[3][:25]]),
            "not valid JSON",
        ),
        "unknown op": (
            _write_lines(tmp_path / "op.jsonl", [lines[0], unknown_op, lines[-1]]),
            "unknown op 'alocate_slots'",
        ),
        "wrong count": (
            _write_lines(tmp_path / "count.jsonl", [lines[0], *lines[2:]]),
            "end record counts",
        ),
        "not a trace": (_write_lines(tmp_path / "other.jsonl", ['{"a": 1}']), "not a kvcache"),
        "empty": (_write_lines(tmp_path / "empty.jsonl", []), "empty file"),
        "missing": (tmp_path / "nowhere.jsonl", "no such trace file"),
    }


def test_bad_traces_give_clear_errors(
    tmp_path: Path, recorded: tuple[dict, list[dict]], capsys: pytest.CaptureFixture[str]
) -> None:
    good = write_trace(tmp_path / "good.jsonl", *recorded)
    for what, (path, message) in _bad_traces(tmp_path, good).items():
        with pytest.raises(TraceError, match=message):
            read_trace(path)
        assert main(["replay", str(path)]) == 2, what
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (what, err)
        assert "Traceback" not in err


def test_every_op_a_side_answers_can_be_stored() -> None:
    """A counterexample holds only calls a trace may hold: every ``Side.op_*`` (the
    request records aside) is in ``CALL_OPS``, and nothing else is."""
    answered = {name[3:] for name in dir(Side) if name.startswith("op_")}
    assert answered - {"add_request"} == set(CALL_OPS)


def test_a_0_33_sequence_with_the_schedulers_duties_round_trips(tmp_path: Path) -> None:
    """Sequences of the 0.33 line (copies, offloads, the connector lookup, zeroing)
    are written and read back whole, and replay identically on kvcache's 0.33 profile."""
    seen: set[str] = set()
    for seed in (0, 10):  # between them they reach the four calls below
        header, records = record_random("full+mamba-checkpoint", seed, "spec-0.33",
                                        num_steps=(80, 80))
        seen |= {record["op"] for record in records}
        path = write_trace(tmp_path / f"t{seed}.jsonl", header, records)
        assert read_trace(path).records == records
        assert main(["replay", str(path), "--impl", "kvcache-0.33"]) == 0
    assert {"take_kv_cache_block_copies", "take_boundary_state_offloads",
            "finalize_partial_tail_offloads", "get_computed_blocks_for_connector"} <= seen
