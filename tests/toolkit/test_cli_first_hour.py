"""A new user's first hour with ``python -m kvcache`` (issue 23, "The first hour").

Each test is one thing a first run met: a missing dependency answered with a
traceback, runs that did nothing and passed, counts of sequences that never ran,
a shrinker that handed back another failure, bad arguments found after minutes of
work, a replay that printed two equal states, a silent benchmark, and a
simulation chart without the curves its help promises. Tiny workloads throughout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvcache
from kvcache.kit import driver, shrinking
from kvcache.kit.cli import main
from kvcache.kit.sides import ADAPTERS, Adapter

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "conformance.mutants:FreeInAllocationOrder"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``python -m kvcache ARGV`` in this process: exit status, stdout, stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own exit (usage errors, --help)
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a command that must be refused up front: exit 2, one line on stderr,
    nothing on stdout (no work done); returns that line."""
    code, out, err = run(capsys, *argv)
    assert code == 2, (argv, out, err)
    assert out == "", (argv, out)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    return err.strip()


@pytest.fixture
def adapters() -> Iterator[dict[str, Any]]:
    """Register test-only implementation names for the duration of one test."""
    added: dict[str, Any] = {}
    yield added
    for name in added:
        ADAPTERS.pop(name, None)


def register(adapters: dict[str, Any], name: str, factory: Any) -> None:
    ADAPTERS[name] = adapters[name] = lambda: Adapter(name, factory)


# ---------------------------------------------------------------- a missing dependency

BLOCK_CBOR2 = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "cbor2":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
"""


def without_cbor2(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run this Python with ``cbor2`` made unimportable (a ``sitecustomize`` that
    blocks it, as a Python without it would fail)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_CBOR2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )


def test_a_missing_dependency_is_one_line_saying_what_to_install(tmp_path: Path) -> None:
    proc = without_cbor2(tmp_path, "-m", "kvcache", "--help")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("kvcache: missing dependency 'cbor2': ")
    assert "pip install" in lines[0] or ".venv" in lines[0]
    # Imported as a library, it stays an exception, with the same advice.
    proc = without_cbor2(tmp_path, "-c", "import kvcache")
    assert proc.returncode == 1
    assert "ModuleNotFoundError: No module named 'cbor2' (kvcache needs it: " in proc.stderr


def test_a_command_missing_a_module_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcache.kit import cli

    def needs_plotly(args: object) -> int:
        raise ModuleNotFoundError("No module named 'plotly'", name="plotly")

    monkeypatch.setattr(cli, "_cmd_simulate", needs_plotly)
    line = usage_error(capsys, "simulate")
    assert line == "kvcache: missing dependency 'plotly': pip install plotly"


# ---------------------------------------------------------------- fuzz: count what ran


def test_fuzz_defaults_count_only_what_ran_and_name_the_skipped_families_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "fuzz", "--sequences", "24", "--shrink-seconds", "0")
    assert code == 0, out
    first, *rest = out.splitlines()
    assert first.startswith("fuzz kvcache vs spec, seed 0: 24 sequences [")
    later = {name for name, family in driver.FAMILIES.items() if family.since != "0.25.1"}
    assert later and not any(f"{name} " in first for name in later)  # none counted
    skipped = [line for line in rest if line.startswith("skipped ")]
    assert len(skipped) == 1, out
    assert f"skipped {len(later)} families (added in vLLM 0.33.0;" in skipped[0]
    assert all(name in skipped[0] for name in later)
    assert not any(line.startswith("not built") for line in rest), out
    assert rest[-1] == "no divergence: kvcache matches spec on every call"


REFUSAL = (
    "this manager knows one KV-cache group only; hybrid layouts of several groups "
    "of attention and state layers are left for a later version of it, much later"
)


def refuses_hybrids(kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
    """A manager that builds single-group layouts only."""
    if len(kv_cache_config.kv_cache_groups) > 1:
        raise NotImplementedError(REFUSAL)
    return kvcache.KVCacheManager(kv_cache_config, *args, **kwargs)


def test_fuzz_sequences_a_side_refused_are_not_counted_and_said_once(
    capsys: pytest.CaptureFixture[str], adapters: dict[str, Any]
) -> None:
    register(adapters, "one-group", refuses_hybrids)
    code, out, _ = run(
        capsys, "fuzz", "--impl", "one-group", "--layouts", "full,full+swa", "--sequences", "6"
    )
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("fuzz one-group vs spec, seed 0: 3 sequences [full 3;"), out
    assert "full+swa" not in lines[0]
    assert "not run, a side refused the config (3 sequences, not counted above):" in lines
    (refusal,) = [line for line in lines if line.startswith("  full+swa x3: ")]
    assert "one-group rejects the config (NotImplementedError:" in refusal
    assert refusal.endswith(" ...") and len(refusal) < 140  # cut at a word, marked
    assert refusal.removesuffix(" ...").split()[-1] in REFUSAL.split()


def test_release_lines_of_the_implementations(vllm_reference: object) -> None:
    from kvcache.kit.fuzz import release_line, skipped_families

    assert release_line("kvcache") == release_line("spec") == "0.25"
    assert release_line("kvcache-0.33") == release_line("spec-0.33") == "0.33"
    from importlib.metadata import version

    assert release_line("vllm") == ".".join(version("vllm").split(".")[:2])
    assert release_line(PLANTED) is None  # a third party's: not known
    assert skipped_families(["full", "full+circular"], "kvcache-0.33", "spec-0.33") == {}
    assert list(skipped_families(["full", "full+circular"], PLANTED, "spec")) == ["full+circular"]


def test_zero_work_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (("--sequences", "0"), ("--minutes", "-1"), ("--minutes", "0")):
        line = usage_error(capsys, "fuzz", *argv)
        assert argv[0] in line and "no divergence" not in line
    from kvcache.kit.fuzz import fuzz

    with pytest.raises(ValueError, match="runs nothing"):
        fuzz("kvcache", seconds=-60.0)
    with pytest.raises(ValueError, match="no run"):
        fuzz("kvcache", seconds=None, max_sequences=0)
    with pytest.raises(ValueError, match="no layout family to run: full\\+circular: added in"):
        fuzz("kvcache", families=["full+circular"], seconds=None, max_sequences=3)


# ---------------------------------------------------------------- the shrinker


class UsageSkew(kvcache.KVCacheManager):
    """Bug with two faces, both at ``usage``: over-reported while three requests or
    more hold blocks, under-reported while exactly two do. A sequence that first
    fails over-reporting has shorter sub-sequences that fail under-reporting."""

    @property
    def usage(self) -> float:
        """The pool usage, skewed by the number of requests holding blocks."""
        usage = float(super().usage)
        manager = self.coordinator.single_type_managers[0]
        holding = sum(1 for blocks in manager.req_to_blocks.values() if blocks)
        if holding >= 3:
            return usage + 0.5
        if holding == 2:
            return usage - 0.5
        return usage


def test_the_shrunk_trace_fails_the_same_way(
    adapters: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    register(adapters, "usage-skew", UsageSkew)
    sequence = next(
        s
        for s in (driver.run_sequence(seed, "full", "usage-skew", "spec") for seed in range(40))
        if s.mismatch is not None and s.mismatch.way == "result: greater"
    )
    assert sequence.run is not None
    calls = [(r["op"], r["args"]) for r in sequence.run.records]

    def failure_of(shrunk: list[driver.Call]) -> driver.Mismatch:
        allowed = [True] * len(shrunk)
        _, exc, _ = driver.replay_lockstep(
            sequence.config, shrunk, "usage-skew", "spec", allowed, sequence.run.hash_seed
        )
        assert exc is not None
        return exc

    def shrunk() -> driver.Mismatch:
        small = driver.shrink(sequence.config, calls, "usage-skew", "spec", budget_s=30.0)
        return failure_of(small)

    kept = shrunk()
    assert (kept.op, kept.part, kept.way) == ("usage", "result", "result: greater")
    assert driver.same_failure(kept, sequence.mismatch)
    # The check the shrinker used to make (op and part alone) takes the other face.
    monkeypatch.setattr(  # where the shrinker looks it up
        shrinking, "same_failure", lambda a, b: (a.op, a.part, a.known) == (b.op, b.part, b.known)
    )
    assert shrunk().way == "result: less"


def test_failure_ways_name_the_field_and_how() -> None:
    way = driver.outcome_way
    assert way({"raises": "ValueError"}, {"ok": 1}) == "raises ValueError->result"
    assert way({"ok": 1}, {"raises": "AssertionError"}) == "result->raises AssertionError"
    hit = {"num_computed_tokens": 16, "blocks": {"tuple": [[1, 2], [3]]}}
    assert way({"ok": hit}, {"ok": {**hit, "num_computed_tokens": 8}}) == (
        "result.num_computed_tokens: less"
    )
    longer = {**hit, "blocks": {"tuple": [[1, 2], [3, 4]]}}
    assert way({"ok": hit}, {"ok": longer}) == "result.blocks[1]: longer"
    assert way({"ok": [1, 2]}, {"ok": None}) == "result: list->null"


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "argv",
    [
        ("simulate", "--rows", "0"),
        ("simulate", "--requests", "0"),
        ("simulate", "--requests", "-3"),
        ("simulate", "--plot", "missing_dir/x.png"),
        ("bench", "--requests", "0"),
        ("bench", "--repetitions", "0"),
        ("bench", "--workloads", "chat,nope"),
        ("bench", "--json", "missing_dir/x.json"),
        ("record", "--requests", "-3", "--out", "x.jsonl"),
        ("record", "--out", "missing_dir/x.jsonl"),
        ("record", "--state-every", "-2", "--out", "x.jsonl"),
        ("replay", "x.jsonl", "--context", "-1"),
        ("fuzz", "--shrink-seconds", "-1"),
        ("fuzz", "--sequences", "x"),
        ("fuzz", "--out", "missing_dir/ce.jsonl"),
        ("release-check", "--census-sequences", "-1"),
        ("changelog", "--census-seconds", "-5"),
    ],
)
def test_bad_arguments_are_refused_up_front(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    line = usage_error(capsys, *argv)
    flag = next((a for a in argv if a.startswith("--")), "")
    assert f"argument {flag}" in line, line


def test_bench_refuses_an_unknown_implementation_before_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = usage_error(capsys, "bench", "--impls", "kvcache,nope", "--requests", "2")
    assert line.startswith("error: ") and "nope" in line
    assert "nothing to bench" in usage_error(capsys, "bench", "--workloads", ",")


def test_simulate_refuses_a_bad_implementation_count(capsys: pytest.CaptureFixture[str]) -> None:
    line = usage_error(capsys, "simulate", "--impl", "kvcache,spec,kvcache", "--requests", "2")
    assert line.startswith("error: --impl 'kvcache,spec,kvcache': give distinct")


def record_trace(capsys: pytest.CaptureFixture[str], path: Path) -> list[dict[str, Any]]:
    code, _, err = run(
        capsys, "record", "--impl", "kvcache", "--workload", "chat", "--requests", "2",
        "--state-every", "1", "--out", str(path),
    )  # fmt: skip
    assert code == 0, err
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_trace_with_a_bad_field_is_bad_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lines = record_trace(capsys, tmp_path / "good.jsonl")
    for field, value in (("num_blocks", -5), ("max_model_len", 0), ("num_blocks", "8")):
        bad = tmp_path / "bad.jsonl"
        write_lines(bad, [{**lines[0], "config": {**lines[0]["config"], field: value}}, *lines[1:]])
        line = usage_error(capsys, "replay", str(bad))
        assert f"bad config: config.{field} is {value!r}; expected a positive int" in line
    group = {**lines[0]["config"]["groups"][0], "block_size": 0}
    write_lines(
        bad, [{**lines[0], "config": {**lines[0]["config"], "groups": [group]}}, *lines[1:]]
    )
    assert "config.groups[0].block_size is 0" in usage_error(capsys, "replay", str(bad))


# ---------------------------------------------------------------- replay, bench, simulate


def test_replay_of_a_result_only_divergence_says_the_states_are_equal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lines = record_trace(capsys, tmp_path / "chat.jsonl")
    index = next(i for i, line in enumerate(lines) if line.get("op") == "get_computed_blocks")
    assert "state" in lines[index]
    hit = lines[index]["ok"]
    lines[index] = {**lines[index], "ok": {**hit, "num_computed_tokens": 16}}
    path = tmp_path / "edited.jsonl"
    write_lines(path, lines)
    code, out, _ = run(capsys, "replay", str(path), "--impl", "kvcache")
    assert code == 1
    assert f"at record #{index - 1} of" in out and "get_computed_blocks(" in out
    assert "state after the call: kvcache's equals the trace's (only the result differs)" in out
    assert "differences: none" not in out and "expected (from the trace)" not in out
    assert len(out) < 2500


def caches_nothing(kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
    """kvcache with prefix caching off whatever it is asked: outputs differ at the
    first lookup that would hit."""
    kwargs["enable_caching"] = False
    return kvcache.KVCacheManager(kv_cache_config, *args, **kwargs)


def test_bench_shows_progress_and_names_the_first_differing_call(
    capsys: pytest.CaptureFixture[str], adapters: dict[str, Any]
) -> None:
    register(adapters, "caches-nothing", caches_nothing)
    code, out, err = run(
        capsys, "bench", "--workloads", "chat", "--impls", "kvcache,caches-nothing",
        "--repetitions", "1", "--requests", "4",
    )  # fmt: skip
    assert code == 1
    assert "bench: chat: kvcache, repetition 1 of 1 (" in err
    assert "bench: chat: caches-nothing, repetition 1 of 1 (" in err
    assert "bench:" not in out  # stdout keeps the tables alone
    (head,) = [line for line in out.splitlines() if line.startswith("== chat")]
    assert "outputs DIFFER: first at call #" in head
    assert "get_computed_blocks(request '" in head
    assert "kvcache -> [" in head and "caches-nothing -> [[[]],0]" in head


def test_simulate_plots_hit_rate_and_preemptions_of_two_implementations(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    savefig = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot = tmp_path / "sim.png"
    code, out, _ = run(
        capsys, "simulate", "--workload", "chat-swa", "--requests", "5", "--rows", "3",
        "--impl", "kvcache,spec", "--plot", str(plot),
    )  # fmt: skip
    assert code == 0, out
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "chat-swa on kvcache, spec (1024 blocks, full 16 + sliding_window 16 (window " in out
    assert "outputs identical on kvcache, spec at every pool size" in out
    assert out.count("hit rate  preempted") == 2  # each implementation step by step
    (figure,) = saved
    title = figure.get_suptitle()
    assert "1024 blocks" in title and "full 16 + sliding_window 16" in title
    assert "kvcache vs spec" in title
    labels = [axis.get_ylabel() for axis in figure.axes]
    assert labels[0].startswith("prefix hit rate") and labels[1].startswith("preemptions")
    assert "free" not in " ".join(labels)  # no mirror of usage
    for axis in figure.axes[:3]:
        assert [line.get_label() for line in axis.get_lines()] == ["kvcache", "spec"]
