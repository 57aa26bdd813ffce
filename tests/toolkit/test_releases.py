"""The kit across vLLM releases: exception allowances, adapters, the ledger, census."""

from __future__ import annotations

from kvcache.kit.driver import compare_outcomes, run_sequence


def test_assert_allowance_works_both_ways() -> None:
    assertion = {"raises": "AssertionError", "message": "bad block id"}
    value_error = {"raises": "ValueError", "message": "block_ids: 17 out of range"}
    assert compare_outcomes(assertion, value_error) == (True, "assert->ValueError")
    assert compare_outcomes(value_error, assertion) == (True, "ValueError->assert")
    not_impl = {"raises": "NotImplementedError", "message": "x"}
    assert compare_outcomes(not_impl, assertion) == (True, "NotImplementedError->assert")
    # Other pairs still diverge, either way round.
    key_error = {"raises": "KeyError", "message": "r0"}
    assert not compare_outcomes(key_error, assertion)[0]
    assert not compare_outcomes(assertion, key_error)[0]
    assert not compare_outcomes(value_error, {"ok": None})[0]


def test_vllm_against_the_oracle_passes_the_sequence_that_failed() -> None:
    # Sequence 4 of seed 0 (mamba) evicts a block id past the pool: the oracle
    # raises ValueError, vLLM 0.25.1 asserts. Both directions must be allowed.
    result = run_sequence(4, "mamba", "vllm", "spec")
    assert result.mismatch is None, result.mismatch


# ---------------------------------------------------------------- release lines


def test_release_lines_pick_the_adapter_per_version() -> None:
    from kvcache.kit.vllm_side import RELEASE_LINES, release_line

    line, note = release_line("0.25.1")
    assert (line.name, note) == ("0.25.x", "")
    assert line.manager_kwargs({"max_num_batched_tokens": 32}) == {"max_num_batched_tokens": 32}
    line, note = release_line("0.33.0")
    assert line.name == "0.33.x" and note == ""
    assert line.lookup_values == 3 and line.stats_at_admission
    assert line.manager_kwargs({"max_num_batched_tokens": 32, "watermark": 0.1}) == {
        "max_in_flight_tokens": 32,
        "watermark": 0.1,
    }
    line, note = release_line("0.34.2")  # unknown newer: the newest line, with a note
    assert line is RELEASE_LINES[-1] and "0.34.2" in note
    line, note = release_line("0.20.0")
    assert line is RELEASE_LINES[0] and note


class _Spy:
    """A manager stand-in that records how the adapter drives it."""

    def __init__(self, values: int) -> None:
        self.values = values
        self.recorded: list[tuple[object, int]] = []

    def get_computed_blocks(self, request: object) -> tuple[object, ...]:
        return ("blocks", 8, 0)[: self.values]

    def record_prefix_cache_stats(self, request: object, num_hits: int) -> None:
        self.recorded.append((request, num_hits))


def test_the_033_adapter_unpacks_three_values_and_records_stats_at_admission() -> None:
    import pytest

    from kvcache.kit.vllm_side import VllmAdapter

    adapter = VllmAdapter("0.33.0")
    spy = _Spy(3)
    assert adapter.get_computed_blocks(spy, "req") == ("blocks", 8)
    adapter.admitted(spy, "req", 8)
    assert spy.recorded == [("req", 8)]
    with pytest.raises(TypeError, match="returned 2 values, expected 3"):
        adapter.get_computed_blocks(_Spy(2), "req")
    old = VllmAdapter("0.25.1")
    spy = _Spy(2)
    assert old.get_computed_blocks(spy, "req") == ("blocks", 8)
    old.admitted(spy, "req", 8)
    assert spy.recorded == []  # 0.25.1's lookup records the stats itself


def test_a_config_a_side_cannot_build_is_not_a_divergence() -> None:
    from kvcache.kit.config import GroupConfig, ManagerConfig
    from kvcache.kit.driver import Lockstep
    from kvcache.kit.sides import ADAPTERS, Adapter, CannotBuild

    def refuses(*args: object, **kwargs: object) -> None:
        raise TypeError("unexpected keyword argument 'max_num_batched_tokens'")

    ADAPTERS["refuses"] = lambda: Adapter("refuses", refuses)
    try:
        config = ManagerConfig(num_blocks=8, groups=(GroupConfig("full", 2),), max_model_len=32)
        try:
            Lockstep(config, "refuses", "kvcache")
        except CannotBuild as exc:
            assert str(exc).startswith("cannot build: ")
            assert "max_num_batched_tokens" in exc.reason
        else:
            raise AssertionError("expected CannotBuild")
    finally:
        del ADAPTERS["refuses"]


def test_fuzz_writes_no_counterexample_when_nothing_builds(tmp_path: object) -> None:
    from pathlib import Path

    from kvcache.kit.fuzz import fuzz
    from kvcache.kit.sides import ADAPTERS, Adapter

    def refuses(*args: object, **kwargs: object) -> None:
        raise TypeError("no")

    ADAPTERS["refuses"] = lambda: Adapter("refuses", refuses)
    try:
        out = Path(str(tmp_path)) / "ce.jsonl"
        result = fuzz("refuses", "kvcache", max_sequences=3, seconds=None, out=out)
    finally:
        del ADAPTERS["refuses"]
    assert result.counterexample is None and not out.exists()
    assert result.harness_error and "cannot build" in result.harness_error
    assert result.stats.mismatching_sequences == 0
