"""Conformance levels (``--compare``), declared features (``--features``) and the small
protocol, in process (``PROTOCOL`` factories) and over JSON lines (``--impl exec:CMD``).

The planted subjects are in ``planted_levels.py`` (block ids renamed consistently;
two requests reported sharing a block) and ``faulty_exec_server.py`` (a server that
breaks the protocol); ``examples/exec_kvcache.py`` is the reference server, with
``--bug free-head-first`` planting examples/mymanager.py's bug.
"""

from __future__ import annotations

import io
import shlex
import sys
from pathlib import Path

import pytest

from kvcache.kit import features as feat
from kvcache.kit.cli import main
from kvcache.kit.fuzz import fuzz
from kvcache.kit.levels import LevelComparer, Renaming, Trial, replay_at, trial_for
from kvcache.kit.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
RENAMED = "toolkit.planted_levels:Renamed"
WRONG_SHARING = "toolkit.planted_levels:WrongSharing"
CORE_ONLY = "toolkit.planted_levels:CoreOnly"
SERVER = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'examples/exec_kvcache.py'))}"
EXEC = f"exec:{SERVER}"
EXEC_BUG = f"exec:{SERVER} --bug free-head-first"


def quiet_fuzz(subject: str, level: str, sequences: int, tmp_path: Path, **kwargs: object):  # type: ignore[no-untyped-def]
    return fuzz(subject, reference=str(kwargs.pop("reference", "kvcache")),
                max_sequences=sequences, seconds=None, stream=io.StringIO(),
                out=tmp_path / f"{level}.jsonl", shrink_s=10,
                trial=trial_for(subject, level, None), **kwargs)  # type: ignore[arg-type]


def test_renaming_is_one_bijection_for_the_sequence() -> None:
    renaming = Renaming()
    assert renaming.match([[1, 2], [3]], [[7, 8], [9]], "ids") == ("", "")
    assert renaming.match([2, 1], [8, 7], "ids") == ("", "")  # the same pairs again
    why, how = renaming.match([1], [8], "ids")  # reference 1 was the subject's 7
    assert how == "renamed" and "reference block 1 is the subject's 7" in why
    why, how = renaming.match([4], [9], "ids")  # the subject's 9 already stands for 3
    assert how == "renamed" and "stands for reference block 3" in why
    assert renaming.match([4, 5], [10], "ids")[1] == "shorter"
    assert renaming.translate([1, 4, 99], num_blocks=12) == [7, 4, 99]


def test_levels_compare_what_they_promise() -> None:
    hit = {"ok": {"block_ids": {"tuple": [[1]]}, "num_computed_tokens": 4}}
    other_hit = {"ok": {"block_ids": {"tuple": [[5]]}, "num_computed_tokens": 4}}
    short_hit = {"ok": {"block_ids": {"tuple": [[]]}, "num_computed_tokens": 0}}
    lookup = "get_computed_blocks"
    assert LevelComparer("admission", 8).compare(lookup, hit, short_hit) == ("", "")
    assert LevelComparer("hits", 8).compare(lookup, hit, short_hit)[1] == (
        "result.num_computed_tokens: less")
    assert LevelComparer("hits", 8).compare(lookup, hit, other_hit) == ("", "")
    sharing = LevelComparer("sharing", 8)
    assert sharing.compare(lookup, hit, other_hit) == ("", "")  # 1 <-> 5 from now on
    assert sharing.compare("allocate_slots", {"ok": {"tuple": [[1, 2]]}},
                           {"ok": {"tuple": [[5, 6]]}}) == ("", "")
    assert sharing.compare("allocate_slots", {"ok": {"tuple": [[3]]}},
                           {"ok": {"tuple": [[6]]}})[1] == "sharing: renamed"
    admission = LevelComparer("admission", 8)
    assert admission.compare("allocate_slots", {"ok": None}, {"ok": {"tuple": [[1]]}})[1] == (
        "result: allocated")
    assert admission.compare("free", {"raises": "ValueError"}, {"ok": None})[1] == (
        "raises missing")
    with pytest.raises(ValueError, match="--compare='nearly'"):
        LevelComparer("nearly", 8)


def test_sharing_finds_renamed_ids_equal_and_wrong_sharing_different(tmp_path: Path) -> None:
    renamed = quiet_fuzz(RENAMED, "sharing", 40, tmp_path)
    assert renamed.failure is None and renamed.stats.sequences == 40
    assert renamed.stats.events["evict_blocks"] > 0  # evictions named through the renaming
    exact = quiet_fuzz(RENAMED, "exact", 40, tmp_path)
    assert exact.failure is not None and exact.failure.mismatch is not None
    assert exact.failure.mismatch.op == "allocate_slots"

    wrong = quiet_fuzz(WRONG_SHARING, "sharing", 40, tmp_path)
    assert wrong.failure is not None and wrong.failure.mismatch is not None
    assert wrong.failure.mismatch.way == "sharing: renamed"
    assert wrong.counterexample is not None and wrong.counterexample_calls <= 10
    trace = read_trace(wrong.counterexample)
    assert trace.header["compare"] == "sharing"
    # the same subject is equal where block ids are not compared
    assert quiet_fuzz(WRONG_SHARING, "hits", 40, tmp_path).failure is None
    # and the counterexample replays at its own level (the header's), on both sides
    result, _ = replay_at(trace, WRONG_SHARING, Trial("sharing"))
    assert result.mismatch is not None and result.mismatch.way == "sharing: renamed"
    assert replay_at(trace, RENAMED, Trial("sharing"))[0].mismatch is None


def test_declared_features_limit_what_is_drawn(tmp_path: Path) -> None:
    core = quiet_fuzz(CORE_ONLY, "sharing", 20, tmp_path)
    assert core.failure is None and core.harness_error is None  # only core calls were made
    assert set(core.stats.layouts) == {"full"} and "full+swa" in core.undeclared
    assert set(core.features_exercised) == {"full"}
    args = {"request_id": "r", "prompt_token_ids": None, "prompt_embeds": [[2.0, 0.5], [1.0, 0.0]],
            "lora": ["a", 1], "cache_salt": "s"}
    assert feat.restrict_call("add_request", args, frozenset({"full"})) == (
        "add_request", {"request_id": "r", "prompt_token_ids": [2, 1]})
    allocate = {"request_id": "r", "num_new_tokens": 3, "num_external_computed_tokens": 4,
                "delay_cache_blocks": True, "num_lookahead_tokens": 2}
    assert feat.restrict_call("allocate_slots", allocate, frozenset({"lookahead"})) == (
        "allocate_slots", {"request_id": "r", "num_new_tokens": 7, "num_lookahead_tokens": 2})
    assert feat.restrict_call("pop_blocks_for_free", {"request_id": "r", "handle": 0},
                              frozenset()) == ("free", {"request_id": "r"})
    assert feat.restrict_call("take_events", {}, frozenset({"full"})) is None
    with pytest.raises(ValueError, match="unknown feature"):
        feat.parse_features("full,telepathy")


def test_exec_subject_wrapping_kvcache_passes_at_exact(tmp_path: Path) -> None:
    outcome = fuzz(EXEC, reference="spec", families=["full", "full+swa", "full+mamba-align"],
                   max_sequences=9, seconds=None, stream=io.StringIO())
    assert outcome.failure is None and outcome.harness_error is None
    assert outcome.stats.sequences == 9 and outcome.stats.calls > 300
    # states travel too: a stored trace replays on it with states compared
    trace = read_trace(ROOT / "tests/data/prefix_hits_and_eviction.jsonl")
    result, undeclared = replay_at(trace, EXEC, Trial("exact"))
    assert not undeclared and result.mismatch is None and result.states_compared


@pytest.mark.parametrize(("level", "sent"), [("hits", False), ("exact", True)])
def test_an_exec_subject_is_asked_for_states_at_exact_only(level: str, sent: bool) -> None:
    from kvcache.kit.config import GroupConfig, ManagerConfig
    from kvcache.kit.levels import TrialLockstep

    config = ManagerConfig(num_blocks=16, groups=[GroupConfig("full", 4)], max_model_len=32)
    run = TrialLockstep(Trial(level), config, EXEC, reference="spec")
    run.call("add_request", request_id="r", prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=2)
    run.call("get_computed_blocks", request_id="r")
    assert run.subject is not None
    assert (run.subject.raw_state() is not None) is sent


def test_exec_planted_bug_is_found_and_shrunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cex.jsonl"
    code = main(["fuzz", "--impl", EXEC_BUG, "--sequences", "60", "--layouts", "full,full+swa",
                 "--out", str(out), "--shrink-seconds", "20"])
    printed = capsys.readouterr().out
    assert code == 1 and "DIVERGENCE: a counterexample of" in printed
    calls = len(read_trace(out).records)
    assert calls <= 8, printed
    assert main(["replay", str(out), "--impl", EXEC_BUG]) == 1
    assert main(["replay", str(out), "--impl", EXEC]) == 0
    assert "replay identically" in capsys.readouterr().out


@pytest.mark.parametrize(("fault", "says"), [
    ("bad-json", "not JSON: '{oops'"),
    ("crash", "exited (status 3)"),
    ("hang", "(allocate_slots) within 5 s"),
])
def test_a_broken_exec_subject_is_one_line_and_exit_2(
    fault: str, says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCACHE_EXEC_TIMEOUT", "5" if fault == "hang" else "30")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    server = ROOT / "tests/toolkit/faulty_exec_server.py"
    impl = f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(server))} {fault}"
    code = main(["fuzz", "--impl", impl, "--sequences", "1", "--layouts", "full"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: --impl {impl}: ") and says in err[0], err
    if fault == "crash":
        assert "planted crash" in err[0]  # the subject's stderr is quoted


def test_cli_levels_features_and_scope(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad, says in ((["--compare", "nearly"], "invalid choice: 'nearly'"),
                      (["--features", "full,telepathy"], "unknown feature(s) 'telepathy'")):
        with pytest.raises(SystemExit) as exit_info:
            main(["fuzz", "--impl", "kvcache", *bad])
        assert exit_info.value.code == 2 and says in capsys.readouterr().err
    code = main(["fuzz", "--impl", CORE_ONLY, "--reference", "kvcache", "--compare", "hits",
                 "--sequences", "3"])
    printed = capsys.readouterr().out
    assert code == 0 and "compared at level hits" in printed
    assert "declared features: full" in printed and "families not run" in printed
    lora_trace = str(ROOT / "tests/data/random_caching.jsonl")
    assert main(["replay", lora_trace, "--impl", "kvcache", "--features", "full"]) == 0
    printed = capsys.readouterr().out
    assert "not judged: it uses features kvcache does not declare" in printed
    assert main(["replay", lora_trace, "--impl", RENAMED, "--compare", "sharing"]) == 0
    assert main(["replay", lora_trace, "--impl", RENAMED]) == 1  # exact: ids differ


def test_docs_name_every_level_and_feature() -> None:
    from kvcache.kit.levels import LEVELS

    text = (ROOT / "docs/protocol.md").read_text()
    missing = [n for n in (*LEVELS, *feat.FEATURES) if f"`{n}`" not in text]
    assert not missing, f"docs/protocol.md does not describe {missing}"


def test_nano_style_manager_judged_at_hits_with_its_features(tmp_path: Path) -> None:
    """The worked example: examples/nano_blocks.py (nano-vllm's design) through an
    adapter of at most 60 lines; every finding is of a declared feature."""
    adapter = ROOT / "examples/nano_adapter.py"
    assert len(adapter.read_text().splitlines()) <= 60
    subject = "examples.nano_adapter:NanoSubject"
    found = quiet_fuzz(subject, "hits", 40, tmp_path, reference="spec")
    assert found.failure is not None and found.failure.mismatch is not None
    assert set(found.stats.layouts) == {"full"}
    assert found.counterexample is not None
    # shrunk, to a sequence a scheduler could make (no step without its allocation)
    assert found.counterexample_calls <= min(30, found.stats.calls * 2 // 3)
    trace = read_trace(found.counterexample)
    assert feat.trace_features(trace.config, trace.records) <= {"full"}
    # the differences the design has (docs/protocol.md): the whole prompt reserved at
    # once (fewer free blocks, or no room), a hit over the whole prompt, cached blocks
    # reused inside the allocation
    assert found.failure.mismatch.way in (
        "free_blocks: less", "result: none", "result.num_computed_tokens: greater")
