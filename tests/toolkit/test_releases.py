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
