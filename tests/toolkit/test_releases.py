"""The kit across vLLM releases: exception allowances, adapters, the ledger, census."""

from __future__ import annotations

import types
from typing import Any, ClassVar

from kvcache.kit.driver import compare_outcomes, run_sequence
from kvcache.kit.ledger import Judge


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
        return ("blocks", 8, 12)[: self.values]

    def record_prefix_cache_stats(self, request: object, num_hits: int) -> None:
        self.recorded.append((request, num_hits))


def test_the_033_adapter_unpacks_three_values_and_records_stats_at_admission() -> None:
    import pytest

    from kvcache.kit.vllm_side import VllmAdapter

    adapter = VllmAdapter("0.33.0")
    spy = _Spy(3)
    request = types.SimpleNamespace()
    assert adapter.get_computed_blocks(spy, request) == ("blocks", 8)
    assert not hasattr(request, "shared_prefix_boundary")  # off unless asked (census)
    adapter.stores_shared_prefix_boundary = True
    assert adapter.get_computed_blocks(spy, request) == ("blocks", 8)
    # The shared-prefix boundary goes on the request, as 0.33.0's scheduler puts it.
    assert request.shared_prefix_boundary == 12
    adapter.admitted(spy, request, 8)
    assert spy.recorded == [(request, 8)]
    with pytest.raises(TypeError, match="returned 2 values, expected 3"):
        adapter.get_computed_blocks(_Spy(2), request)
    old = VllmAdapter("0.25.1")
    spy = _Spy(2)
    old_request = types.SimpleNamespace()
    assert old.get_computed_blocks(spy, old_request) == ("blocks", 8)
    assert not hasattr(old_request, "shared_prefix_boundary")
    old.admitted(spy, old_request, 8)
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


# ---------------------------------------------------------------- the ledger


def test_the_ledger_loads_and_names_every_rule() -> None:
    from collections import Counter

    from kvcache.kit.ledger import RULES, VERDICTS, load_ledger

    entries = load_ledger()
    verdicts = Counter(e.verdict for e in entries)
    assert set(verdicts) <= set(VERDICTS)
    assert verdicts["bug-fixed-in"] >= 3  # the three 0.25.1 bugs of issue 15
    assert all(e.rule in RULES for e in entries)
    assert len({e.id for e in entries}) == len(entries)
    assert all(e.fixed_in for e in entries if e.is_bug)


def test_a_bad_ledger_entry_is_refused_by_name(tmp_path: object) -> None:
    from pathlib import Path

    import pytest

    from kvcache.kit.ledger import load_ledger

    path = Path(str(tmp_path)) / "ledger.toml"
    path.write_text(
        '[[difference]]\nid = "x"\nreleases = ">=0.33.0"\nwhat = "w"\n'
        'verdict = "maybe"\nrule = "adapter"\n'
    )
    with pytest.raises(ValueError, match="'x' verdict='maybe'"):
        load_ledger(path)
    path.write_text(
        '[[difference]]\nid = "y"\nreleases = ">=0.33.0"\nwhat = "w"\n'
        'verdict = "intended"\nrule = "no_such_rule"\n'
    )
    with pytest.raises(ValueError, match="'y' rule='no_such_rule'"):
        load_ledger(path)
    # The list form of earlier ledgers (exact releases) is refused: ranges only.
    path.write_text(
        '[[difference]]\nid = "z"\nreleases = ["0.33.0"]\nwhat = "w"\n'
        'verdict = "intended"\nrule = "adapter"\n'
    )
    with pytest.raises(ValueError, match=r"'z' releases=.*use a range"):
        load_ledger(path)
    path.write_text(
        '[[difference]]\nid = "w"\nreleases = "~0.33"\nwhat = "w"\n'
        'verdict = "intended"\nrule = "adapter"\n'
    )
    with pytest.raises(ValueError, match=r"'w'.*clause '~0\.33'"):
        load_ledger(path)


def test_ledger_ranges_cover_releases_and_lines() -> None:
    from kvcache.kit.ledger import in_range

    assert in_range("0.29.0", ">=0.26.0,<0.30.0")
    assert not in_range("0.30.0", ">=0.26.0,<0.30.0")
    assert not in_range("0.25.1", ">=0.26.0")
    assert in_range("0.27", ">=0.27.0,<0.28.0")  # a line is its first release
    assert in_range("0.27.1", "==0.27.1") and not in_range("0.27.0", "==0.27.1")


def _judge(**config: Any) -> Judge:
    from kvcache.kit.config import GroupConfig, ManagerConfig

    groups = config.pop("groups", (GroupConfig("full", 2),))
    cfg = ManagerConfig(num_blocks=8, groups=groups, max_model_len=32, **config)
    return Judge(cfg, "0.33", old_is_expected=True)


def _equal(a: dict[str, object], b: dict[str, object]) -> bool:
    from kvcache.kit.driver import compare_outcomes

    return compare_outcomes(a, b)[0]


def test_hash_renaming_needs_tagged_extra_keys_and_a_one_to_one_map() -> None:

    judge = _judge()
    old = {"ok": [{"bytes": "aa"}, {"bytes": "bb"}]}
    new = {"ok": [{"bytes": "11"}, {"bytes": "22"}]}
    # A plain request: hashes must not change between releases.
    plain = {"request_id": "p", "prompt_token_ids": [1, 2, 3, 4]}
    judge.observe("add_request", plain, old, new)
    assert not judge.outcome("add_request", plain, old, new, _equal).ok
    # A LoRA request: renamed, and the renaming applies to pool keys (group suffix).
    lora = {"request_id": "l", "prompt_token_ids": [1, 2, 3, 4], "lora": ["a", 1]}
    judge.observe("add_request", lora, old, new)
    verdict = judge.outcome("add_request", lora, old, new, _equal)
    assert verdict.ok and verdict.known == ("tagged-extra-keys",)
    state_old = {"block_hash": {"dict": [[1, {"bytes": "aa00000000"}]]}}
    state_new = {"block_hash": {"dict": [[1, {"bytes": "1100000000"}]]}}
    verdict, diff = judge.state("allocate_slots", state_old, state_new)
    assert verdict.ok and diff == []
    # Two new hashes for one old hash is not a renaming: a collision in 0.25.1.
    other = {"ok": [{"bytes": "aa"}]}
    judge.observe("add_request", dict(lora, request_id="m"), other, {"ok": [{"bytes": "33"}]})
    assert judge.ctx.collision


def test_expected_result_rules_recognise_the_fixed_bugs() -> None:
    from kvcache.kit.config import GroupConfig

    groups = (GroupConfig("full", 2), GroupConfig("mamba", 2, mamba_cache_mode="align"))
    judge = _judge(groups=groups, use_eagle=True)
    args = {"request_id": "r"}
    old = {"ok": {"block_ids": {"tuple": [[1, 2], [3]]}, "num_computed_tokens": 4}}
    new = {"ok": {"block_ids": {"tuple": [[1], [3]]}, "num_computed_tokens": 2}}
    verdict = judge.outcome("get_computed_blocks", args, old, new, _equal)
    assert not verdict.ok and verdict.known == ("bug-mamba-eagle-long-hit",)
    # A longer hit on the new release is not that bug.
    verdict = judge.outcome("get_computed_blocks", args, new, old, _equal)
    assert "bug-mamba-eagle-long-hit" not in verdict.known
    # Without EAGLE neither.
    plain = _judge(groups=groups)
    verdict = plain.outcome("get_computed_blocks", args, old, new, _equal)
    assert "bug-mamba-eagle-long-hit" not in verdict.known


def test_normalisers_explain_api_changes_and_nothing_else() -> None:
    judge = _judge()
    stats_old = {"ok": {"type": "PrefixCacheStats", "fields": {"reset": False, "hits": 0}}}
    stats_new = {
        "ok": {
            "type": "PrefixCacheStats",
            "fields": {"reset": False, "hits": 0, "hits_by_source": {}},
        }
    }
    verdict = judge.outcome("make_prefix_cache_stats", {}, stats_old, stats_new, _equal)
    assert verdict.ok and verdict.known == ("stats-hits-by-source",)
    verdict = judge.outcome(
        "get_num_common_prefix_blocks", {"request_id": "r"}, {"ok": [3]}, {"ok": [0]}, _equal
    )
    assert verdict.ok and verdict.known == ("cascade-always-zero",)
    verdict = judge.outcome("pop_blocks_for_free", {}, {"ok": [4, 0, 0]}, {"ok": [4]}, _equal)
    assert verdict.ok and verdict.known == ("pop-drops-null-head",)
    # A different block id is not an API change.
    verdict = judge.outcome("pop_blocks_for_free", {}, {"ok": [4, 0]}, {"ok": [5]}, _equal)
    assert not verdict.ok and verdict.known == ()


# ---------------------------------------------------------------- shrinking and census


def test_random_sequences_are_ones_a_scheduler_could_make() -> None:
    from kvcache.kit.driver import FAMILIES, run_sequence, scheduler_could_make

    for i, family in enumerate(FAMILIES):
        impl = "kvcache" if FAMILIES[family].since == "0.25.1" else "kvcache-0.33"
        result = run_sequence(100 + i, family, None, impl)
        assert result.run is not None
        calls = [(r["op"], r["args"]) for r in result.run.records]
        admitted = [
            r["op"] == "allocate_slots" and r.get("ok") is not None for r in result.run.records
        ]
        assert scheduler_could_make(calls, admitted), family


def test_scheduler_rules_refuse_impossible_call_lists() -> None:
    from kvcache.kit.driver import scheduler_could_make

    add = ("add_request", {"request_id": "r", "prompt_token_ids": [1, 2]})
    look = ("get_computed_blocks", {"request_id": "r"})
    alloc = (
        "allocate_slots",
        {"request_id": "r", "num_new_tokens": 2, "new_computed_blocks": "last"},
    )
    run = ("update_request", {"request_id": "r", "status": "RUNNING", "num_computed_tokens": 2})
    assert scheduler_could_make([add, look, alloc, run])
    assert not scheduler_could_make([look, add])  # before its add_request
    assert not scheduler_could_make([add, alloc])  # "last" without a lookup
    assert not scheduler_could_make([add, look, alloc, look])  # lookup of an admitted request
    assert not scheduler_could_make([add, look, alloc, run, look])  # of a running one
    # Computed tokens need slots: none before an allocation, none past what it made
    # room for, none after a failed one (the shrinker once handed such lists on).
    assert not scheduler_could_make([add, run])
    more = ("update_request", {"request_id": "r", "num_computed_tokens": 3})
    assert not scheduler_could_make([add, look, alloc, more])
    assert not scheduler_could_make([add, look, alloc, run], [False, False, False, False])
    # The connector lookup (0.33 line) counts as a lookup; the fallback may follow it.
    connector = ("get_computed_blocks_for_connector", {"request_id": "r"})
    assert scheduler_could_make([add, connector, alloc, run])
    assert scheduler_could_make([add, connector, look, alloc, run])
    assert not scheduler_could_make([add, look, alloc, run, connector])
    finish = ("update_request", {"request_id": "r", "status": "FINISHED_ABORTED"})
    free = ("free", {"request_id": "r"})
    assert scheduler_could_make([add, finish, free])
    assert not scheduler_could_make([add, finish, free, free])
    tails = ("finalize_partial_tail_offloads", {"request_id": "r"})
    assert scheduler_could_make([add, finish, tails, free])  # a KV producer's finish
    assert not scheduler_could_make([add, tails])  # of a request not finished
    assert not scheduler_could_make([add, finish, free, tails])  # after its free
    assert not scheduler_could_make([add, ("free_blocks", {"handle": 0})])


def test_census_tallies_first_differences_and_shrinks_one_per_kind(tmp_path: object) -> None:
    from pathlib import Path

    from kvcache.kit.fuzz import fuzz
    from kvcache.kit.trace import read_trace

    folder = Path(str(tmp_path))
    planted = "conformance.mutants:FreeInAllocationOrder"
    outcome = fuzz(
        planted,
        "kvcache",
        families=["full"],
        seconds=None,
        max_sequences=12,
        shrink_s=10.0,
        census=True,
        census_dir=folder,
    )
    assert outcome.stats.sequences == 12  # it did not stop at the first divergence
    assert sum(outcome.census.values()) >= 2 and outcome.unknown_kinds
    for kind in outcome.unknown_kinds:
        path, n = outcome.census_examples[kind]
        trace = read_trace(path)
        assert len(trace.records) == n and trace.header["kind"] == kind
        assert n < 40  # shrunk


# ---------------------------------------------------------------- any installed release


class _Config033:
    """A stand-in KVCacheConfig with 0.33.0's retention field."""

    __dataclass_fields__: ClassVar[dict[str, None]] = {"prefix_cache_retention_interval": None}


class _Manager033:
    """The API facts of vLLM 0.26.0 and later, on a stand-in class."""

    def __init__(self, kv_cache_config: object, max_model_len: int, max_in_flight_tokens: int):
        pass

    def get_computed_blocks(self, request: object) -> tuple[KVCacheBlocks, int, int]:  # noqa: F821
        raise NotImplementedError

    def record_prefix_cache_stats(self, request: object, num_hits: int) -> None:
        pass


class _Manager025:
    def __init__(self, kv_cache_config: object, max_num_batched_tokens: int | None = None):
        pass

    def get_computed_blocks(self, request: object) -> tuple[KVCacheBlocks, int]:  # noqa: F821
        raise NotImplementedError


def test_an_unknown_release_is_driven_by_the_facts_read_off_its_classes() -> None:
    from kvcache.kit.vllm_side import release_line

    line, note = release_line("0.29.0", _Manager033, _Config033)
    assert line.manager_kwargs({"max_num_batched_tokens": 8}) == {"max_in_flight_tokens": 8}
    assert line.lookup_values == 3 and line.stats_at_admission
    assert line.retention_in_kv_cache_config
    assert "0.29.0" in note and "max_in_flight_tokens" in note and "3 values" in note
    line, note = release_line("0.24.0", _Manager025, object)
    assert line.lookup_values == 2 and not line.stats_at_admission and not line.renamed_kwargs
    assert not line.retention_in_kv_cache_config and "environment" in note


def test_a_release_whose_api_the_adapter_cannot_read_is_refused_at_once() -> None:
    import pytest

    from kvcache.kit.sides import AdapterDoesNotFit
    from kvcache.kit.vllm_side import release_line

    class NoBudget(_Manager025):
        def __init__(self, kv_cache_config: object, token_budget: int) -> None:
            pass

    with pytest.raises(AdapterDoesNotFit, match=r"vLLM 0\.40\.0 does not fit.*token_budget"):
        release_line("0.40.0", NoBudget, object)

    class Untyped(_Manager025):
        def get_computed_blocks(self, request: object):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    with pytest.raises(AdapterDoesNotFit, match="how many values get_computed_blocks"):
        release_line("0.40.0", Untyped, object)


def test_a_census_refusal_of_a_family_neither_release_has_is_not_unknown() -> None:
    from kvcache.kit.fuzz import NEWER_FAMILY, FuzzOutcome

    outcome = FuzzOutcome()
    outcome.census.update({NEWER_FAMILY: 3, "known:x": 2, "cannot-build": 1})
    assert outcome.unknown_kinds == ["cannot-build"]


def _record(version: str, traces: list[tuple[str, str, list[str], str]], **census: object) -> dict:
    return {
        "version": version,
        "api": {"__init__": ["max_in_flight_tokens"] if version >= "0.26.0" else []},
        "traces": [
            {"path": p, "verdict": v, "entries": e, "detail": d} for p, v, e, d in traces
        ],
        "census": {"sequences": 1, "calls": 1, "known": {}, "kinds": {}, **census},
        "unknown": [],
    }


def test_bisect_tells_shows_from_absent_from_not_exercised() -> None:
    from kvcache.kit.bisect import (
        LIKE_REFERENCE,
        NOT_EXERCISED,
        SHOWS,
        bisect,
        measured_range,
    )
    from kvcache.kit.ledger import Entry

    entry = Entry("bug-x", ">=0.27.0", "w", "bug-fixed-in", "observed", fixed_in="0.29.0")
    stop = "stops at record #3 allocate_slots/result"
    records = [
        _record("0.25.1", [("t", "identical", [], "all records")]),
        _record("0.26.0", [("t", "known", ["other"], stop)]),  # stopped before: can't tell
        _record("0.27.0", [("t", "known", ["bug-x"], stop)]),
        _record("0.28.0", [("u", "known", [], "all records")], kinds={"known:bug-x": 1}),
        _record("0.29.0", [("t", "known", ["other"], "all records")]),  # ran through: absent
    ]
    (result,) = bisect(records, [entry])
    assert result.status == {
        "0.25.1": LIKE_REFERENCE,
        "0.26.0": NOT_EXERCISED,
        "0.27.0": SHOWS,
        "0.28.0": SHOWS,  # by the census
        "0.29.0": LIKE_REFERENCE,
    }
    assert result.measured == ">=0.27.0,<0.29.0"
    assert not result.agrees  # the ledger says >=0.27.0, but 0.29.0 behaves like 0.25.1
    assert measured_range({"0.25.1": LIKE_REFERENCE}) is None
    api = Entry("ctor-max-in-flight-tokens", ">=0.26.0", "w", "intended", "adapter")
    (result,) = bisect(records, [api])  # an API fact: read off the classes
    assert result.measured == ">=0.26.0" and result.agrees


def test_the_bisect_table_in_the_docs_matches_the_ledgers_ranges() -> None:
    # docs/bisect.md is generated by `make releases`; a ledger range edited without
    # bisecting again (or an entry added) shows here.
    import re
    from pathlib import Path

    from kvcache.kit.ledger import load_ledger

    text = (Path(__file__).resolve().parents[2] / "docs" / "bisect.md").read_text()
    rows = dict(re.findall(r"^\| ([a-z0-9-]+) \| `([^`]*)` \| `[^`]*` \|", text, re.MULTILINE))
    assert rows == {e.id: e.releases for e in load_ledger()}
    assert "(differs)" not in text
