"""Random scheduler-like call sequences run in lockstep on a reference and a subject.

``Lockstep`` sends every call to the reference (vLLM 0.25.1, or the ``spec``
oracle) and to the subject, compares results, exceptions and the abstract state
after each call, and records the reference's view as a trace.
``RandomScheduler`` decides the calls the way vLLM's ``Scheduler`` would make
them (``vllm/v1/core/sched/scheduler.py``): prefix lookups only for waiting
requests with no computed tokens, chunked prefill (split at block multiples
when a Mamba group caches in "align" mode), decode with draft tokens and
lookahead slots, encoder tokens for cross attention, preemption when an
allocation fails, async KV loads (``delay_cache_blocks``), deferred frees,
plus the admin calls (evict, reset, events, stats). ``shrink`` cuts a failing
sequence down to a minimal replayable trace; ``replay_trace`` replays one.
"""

from __future__ import annotations

import importlib.util
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcache.kit.config import GroupConfig, ManagerConfig, fine_grained_hits
from kvcache.kit.ledger import REFERENCE_LINE, Judge, release_line_of
from kvcache.kit.oracle import spec_module
from kvcache.kit.sides import CannotBuild, HarnessError, Side, make_side
from kvcache.kit.trace import (
    Trace,
    canon_state,
    make_header,
    results_equal,
    short,
    state_diff,
    write_trace,
)

# ---------------------------------------------------------------- outcomes


def outcome(side: Side, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """``{"ok": result}`` or ``{"raises": type name, "message": text}``.

    A ``HarnessError`` (a call the harness cannot express) is not an outcome;
    it propagates.
    """
    try:
        return {"ok": side.call(op, args)}
    except HarnessError:
        raise
    except Exception as exc:
        return {"raises": type(exc).__name__, "message": str(exc)[:300]}


# Where vLLM only asserts, an implementation may validate (docs/divergences.md).
SUBJECT_FOR_ASSERT = ("ValueError", "NotImplementedError", "ContextParallelError")
#: kvcache's exception classes compared as the ``ValueError`` they subclass, which the
#: spec raises there (``PartialBlockError``: a bad partial or state entry, also an
#: ``AssertionError``).
EXCEPTION_ALIASES = {"PartialBlockError": "ValueError"}

def _torch_importable() -> bool:
    """Whether ``import torch`` can succeed here (without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # blocked (sys.modules["torch"] = None) or broken
        return False


PROMPT_EMBEDS_DRAWN = _torch_importable()
"""Whether requests with prompt embeddings are drawn: they need torch (a tensor per
request), which the kit's light set-up (``make setup``, ``pip install kvcache``)
does not install. Without it the rest of every sequence is drawn as with it."""


def assert_allowance(expected_raises: str, actual_raises: str) -> str:
    """The note for an allowed assert-vs-validation pair of exceptions, else ``""``.

    vLLM asserts where kvcache and the oracle raise ``ValueError`` (or
    ``NotImplementedError``); the pair is accepted in both directions, so that
    vLLM can be the reference (``"assert->ValueError"``) or the subject
    checked against the oracle (``"ValueError->assert"``).
    """
    if expected_raises == "AssertionError" and actual_raises in SUBJECT_FOR_ASSERT:
        return "assert->" + actual_raises
    if actual_raises == "AssertionError" and expected_raises in SUBJECT_FOR_ASSERT:
        return expected_raises + "->assert"
    return ""


def compare_outcomes(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether ``actual`` conforms to the reference outcome ``expected``.

    Returns ``(ok, note)``: ``note`` is ``"assert->ValueError"`` (or the
    reverse, ``"ValueError->assert"``) when one side's ``AssertionError`` met
    the other's ``ValueError`` or ``NotImplementedError`` (allowed, counted),
    else a description of the difference, else ``""``.
    """
    if "raises" in expected:
        if "raises" not in actual:
            return False, f"expected {expected['raises']}, got result {short(actual['ok'])}"
        expected_raises = EXCEPTION_ALIASES.get(expected["raises"], str(expected["raises"]))
        actual_raises = EXCEPTION_ALIASES.get(actual["raises"], str(actual["raises"]))
        if expected_raises == actual_raises:
            return True, ""
        allowance = assert_allowance(expected_raises, actual_raises)
        if allowance:
            return True, allowance
        return False, (
            f"expected {expected['raises']}, got {actual['raises']}: {actual.get('message')}"
        )
    if "raises" in actual:
        return False, (
            f"expected {short(expected.get('ok'))}, got {actual['raises']}: {actual.get('message')}"
        )
    if not results_equal(expected.get("ok"), actual["ok"]):
        return False, f"expected {short(expected.get('ok'))}, got {short(actual['ok'])}"
    return True, ""


class Mismatch(Exception):
    """The subject diverged from the reference at call ``index`` (-1: construction).

    ``expected_state`` / ``observed_state`` are the canonical states after the
    call when the divergence is in the state (or both states are known).
    """

    def __init__(
        self,
        index: int,
        op: str,
        args: Mapping[str, Any],
        detail: str,
        expected_state: Mapping[str, Any] | None = None,
        observed_state: Mapping[str, Any] | None = None,
        known: tuple[str, ...] = (),
        part: str = "result",
        way: str = "",
    ) -> None:
        super().__init__(f"call #{index} {op}({short(dict(args), 300)}): {detail}")
        self.index = index
        self.op = op
        self.call_args = dict(args)
        self.detail = detail
        self.expected_state = expected_state
        self.observed_state = observed_state
        #: The ledger entry that recognised this difference (empty: unknown).
        self.known = known
        #: What differs: "result", "raises", or "state:<keys>".
        self.part = part
        #: Where and how, finer than ``part``: the differing field of a result and
        #: how it differs, the exceptions met, or how each state key differs
        #: (``outcome_way``, ``state_way``); shrinking keeps it.
        self.way = way

    @property
    def kind(self) -> str:
        """The kind of difference, for tallies and shrinking: ``op/part``."""
        return f"{self.op}/{self.part}"


def outcome_part(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """``"raises"`` when either outcome is an exception, else ``"result"``."""
    return "raises" if "raises" in expected or "raises" in actual else "result"


def _how(expected: Any, actual: Any, path: str = "") -> tuple[str, str]:
    """The path of the first place two unequal canonical values differ (keys of
    objects, positions of tuples; ``[*]`` for any element of a list or a mapping
    with non-string keys) and how: ``greater`` / ``less`` (numbers), ``longer`` /
    ``shorter``, ``missing`` / ``extra`` (keys), ``A->B`` (types), or ``value``."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) == {"tuple"} == set(actual):
            e_items, a_items = expected["tuple"], actual["tuple"]
            if isinstance(e_items, list) and isinstance(a_items, list):
                for i, (x, y) in enumerate(zip(e_items, a_items, strict=False)):
                    if not results_equal(x, y):
                        return _how(x, y, f"{path}[{i}]")
                return path, "longer" if len(a_items) > len(e_items) else "shorter"
        if set(expected) == {"dict"} == set(actual):
            return _how(expected["dict"], actual["dict"], path)
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                return f"{path}.{key}", "missing"
            if key not in expected:
                return f"{path}.{key}", "extra"
            if not results_equal(expected[key], actual[key]):
                return _how(expected[key], actual[key], f"{path}.{key}")
        return path, "value"
    if isinstance(expected, list) and isinstance(actual, list):
        for x, y in zip(expected, actual, strict=False):
            if not results_equal(x, y):
                return _how(x, y, f"{path}[*]")
        return path, "longer" if len(actual) > len(expected) else "shorter"
    numbers = (int, float)
    if (
        isinstance(expected, numbers)
        and isinstance(actual, numbers)
        and not isinstance(expected, bool)
        and not isinstance(actual, bool)
    ):
        return path, "greater" if actual > expected else "less"
    if type(expected) is not type(actual):
        names = {type(None): "null", dict: "object", list: "list"}
        before = names.get(type(expected), type(expected).__name__)
        return path, f"{before}->{names.get(type(actual), type(actual).__name__)}"
    return path, "value"


def outcome_way(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """How two unequal outcomes differ: the exceptions (``raises ValueError->result``)
    or the result's first differing field and how (``result.num_computed_tokens: less``)."""
    if "raises" in expected or "raises" in actual:
        before = f"raises {expected['raises']}" if "raises" in expected else "result"
        return f"{before}->" + (f"raises {actual['raises']}" if "raises" in actual else "result")
    path, how = _how(expected.get("ok"), actual.get("ok"))
    return f"result{path}: {how}"


def state_way(
    diff: Sequence[str], expected: Mapping[str, Any] | None, observed: Mapping[str, Any] | None
) -> str:
    """How each differing key of two states differs (``free_queue: shorter``), in
    the order of ``state_part``; keys outside the states (free counts,
    invariants) by name."""
    keys = state_part(diff).removeprefix("state:").split(",")
    ways = []
    for key in keys:
        if expected is not None and observed is not None and key in expected and key in observed:
            ways.append(f"{key}: {_how(expected[key], observed[key])[1]}")
        else:
            ways.append(key)
    return "; ".join(ways)


def state_part(diff: Sequence[str]) -> str:
    """``"state:key1,key2"`` for the top-level keys named in ``state_diff`` lines."""
    keys = sorted({line.strip().split(":", 1)[0].split("(", 1)[0] for line in diff})
    return "state:" + ",".join(keys)


def side_line(side: Side) -> str:
    """The release line a side behaves like: vLLM's own, else 0.25 (kvcache, spec)."""
    if side.adapter.name == "vllm":
        return release_line_of(side.adapter.version)
    line: str | None = getattr(side.adapter, "release_line", None)  # kvcache-0.33
    return line or REFERENCE_LINE


def make_judge(config: ManagerConfig, expected_line: str, actual_line: str) -> Judge | None:
    """A ledger judge when the two sides are of different release lines, else None."""
    if expected_line == actual_line:
        return None
    if expected_line == REFERENCE_LINE:
        return Judge(config, actual_line, old_is_expected=True)
    return Judge(config, expected_line, old_is_expected=False)


class DriverError(Exception):
    """The reference itself disagreed with what the driver expected (a harness bug)."""


@dataclass
class Stats:
    """What the runs did, for the summary lines."""

    sequences: int = 0
    calls: int = 0
    mismatching_sequences: int = 0
    assert_as_value_error: int = 0
    events: Counter[str] = field(default_factory=Counter)
    layouts: Counter[str] = field(default_factory=Counter)
    #: Calls where a ledger normaliser made the sides agree, by entry id.
    known: Counter[str] = field(default_factory=Counter)
    #: Configs a side cannot build, by family.
    cannot_build: Counter[str] = field(default_factory=Counter)
    hybrid: int = 0
    with_eagle: int = 0
    with_mixed_block_sizes: int = 0
    seconds: float = 0.0

    def add(self, other: Stats) -> None:
        self.sequences += other.sequences
        self.calls += other.calls
        self.mismatching_sequences += other.mismatching_sequences
        self.assert_as_value_error += other.assert_as_value_error
        self.events.update(other.events)
        self.layouts.update(other.layouts)
        self.known.update(other.known)
        self.cannot_build.update(other.cannot_build)
        self.hybrid += other.hybrid
        self.with_eagle += other.with_eagle
        self.with_mixed_block_sizes += other.with_mixed_block_sizes
        self.seconds += other.seconds

    def count_config(self, family: str, config: ManagerConfig) -> None:
        self.layouts[family] += 1
        self.hybrid += len(config.groups) > 1
        self.with_eagle += config.has_eagle
        self.with_mixed_block_sizes += config.has_mixed_block_sizes
        self.events["config:hash_lookahead"] += config.num_hash_lookahead_tokens > 0
        self.events["config:prefill_lookahead"] += config.num_prefill_lookahead > 1

    def layout_summary(self) -> str:
        parts = [f"{name} {n}" for name, n in sorted(self.layouts.items(), key=lambda kv: -kv[1])]
        return (
            ", ".join(parts) + f"; {self.hybrid} hybrid, {self.with_eagle} with EAGLE, "
            f"{self.with_mixed_block_sizes} with mixed block sizes"
        )

    def summary(self, label: str = "conformance") -> str:
        return (
            f"{label}: {self.sequences} sequences [{self.layout_summary()}], "
            f"{self.calls} calls, {self.mismatching_sequences} mismatches "
            f"({self.assert_as_value_error} vLLM asserts met by ValueError)"
        )


# ---------------------------------------------------------------- lockstep


class Lockstep:
    """Runs each call on the reference and (when given) the subject, and compares."""

    def __init__(
        self,
        config: ManagerConfig,
        subject: str | None,
        reference: str = "vllm",
        hash_seed: str = "0",
        stats: Stats | None = None,
        record_state: bool = True,
    ) -> None:
        self.config = config
        self.hash_seed = hash_seed
        self.reference_name = reference
        self.reference = make_side(reference, config, hash_seed)
        self.subject_name = subject
        self.subject: Side | None = None
        self.records: list[dict[str, Any]] = []
        self.stats = stats if stats is not None else Stats()
        self.record_state = record_state
        self.judge: Judge | None = None
        if subject is not None:  # CannotBuild propagates: not a divergence
            self.subject = make_side(subject, config, hash_seed)
            self.judge = make_judge(config, side_line(self.reference), side_line(self.subject))

    def header(self, **extra: Any) -> dict[str, Any]:
        """The trace header of the reference's records."""
        return make_header(
            self.config,
            self.reference_name,
            self.reference.adapter.version,
            self.hash_seed,
            **extra,
        )

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """One call on both sides; returns the reference's outcome.

        Raises:
            Mismatch: the subject's outcome or state differs from the reference's.
        """
        index = len(self.records)
        expected = outcome(self.reference, op, args)
        record: dict[str, Any] = {"op": op, "args": args, **expected}
        record.pop("message", None)
        self.records.append(record)
        self.stats.calls += 1
        self.observe(op, expected)
        if self.subject is not None:
            actual = outcome(self.subject, op, args)
            if self.judge is not None:
                self.judge.observe(op, args, expected, actual)
            ok, note = compare_outcomes(expected, actual)
            if not ok and self.judge is not None:
                judgement = self.judge.outcome(
                    op, args, expected, actual, lambda e, a: compare_outcomes(e, a)[0]
                )
                if not judgement.ok:
                    raise Mismatch(
                        index,
                        op,
                        args,
                        note,
                        known=judgement.known,
                        part=outcome_part(expected, actual),
                        way=outcome_way(expected, actual),
                    )
                self.stats.known.update(judgement.known)
                ok, note = True, ""
            if not ok:
                raise Mismatch(
                    index,
                    op,
                    args,
                    note,
                    part=outcome_part(expected, actual),
                    way=outcome_way(expected, actual),
                )
            if note:
                self.stats.assert_as_value_error += 1
        state = self.check_state(index, op, args)
        if self.record_state and state is not None and op != "add_request":
            record["state"] = state
        return expected

    def ok(self, op: str, **args: Any) -> Any:
        """A call the reference must accept; returns its result."""
        expected = self.call(op, **args)
        if "raises" in expected:
            raise DriverError(
                f"{self.reference_name} raised {expected['raises']} on {op}({args}): "
                f"{expected.get('message')}"
            )
        return expected["ok"]

    def raises(self, op: str, **args: Any) -> str:
        """A call the reference must reject; returns the exception type name."""
        expected = self.call(op, **args)
        if "raises" not in expected:
            raise DriverError(f"{self.reference_name} accepted {op}({args}) -> {expected}")
        return str(expected["raises"])

    def check_state(
        self, index: int = -1, op: str = "<init>", args: Mapping[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """Compare abstract states and free counts; returns the reference's
        canonical state when recording (else None)."""
        expected_raw = self.reference.raw_state()
        if expected_raw is not None:
            self.observe_state(expected_raw)
        if self.subject is not None:
            diff: list[str] = []
            actual_raw = self.subject.raw_state()
            expected = observed = None
            known: tuple[str, ...] = ()
            if expected_raw is not None and actual_raw is not None and expected_raw != actual_raw:
                expected, observed = canon_state(expected_raw), canon_state(actual_raw)
                diff = state_diff(expected, observed)
                if diff and self.judge is not None:
                    judgement, diff = self.judge.state(op, expected, observed)
                    if judgement.ok:
                        self.stats.known.update(judgement.known)
                    known = judgement.known if not judgement.ok else ()
            free_ref = self.reference.num_free_blocks()
            free_sub = self.subject.num_free_blocks()
            if free_ref != free_sub:
                diff.append(f"  get_num_free_blocks(): expected {free_ref}, got {free_sub}")
            if not diff:
                broken = self.subject.check_invariants()
                if broken:
                    diff.append("  " + broken)
            if diff:
                raise Mismatch(
                    index,
                    op,
                    args or {},
                    "state differs after the call:\n" + "\n".join(diff),
                    expected,
                    observed,
                    known=known,
                    part=state_part(diff),
                    way=state_way(diff, expected, observed),
                )
        if self.record_state and expected_raw is not None:
            return canon_state(expected_raw)
        return None

    def observe_state(self, state: Mapping[str, Any]) -> None:
        """Count states where an R-SWA table holds a null after a live block (a freed
        gap), so tests can check the driver makes decodes pass the window."""
        for index, group in enumerate(self.config.groups):
            if group.kind != "rswa":
                continue
            for table in state["req_to_blocks"][index].values():
                live = [i for i, block in enumerate(table) if block != 0]
                if live and 0 in table[live[0] :]:
                    self.stats.events["rswa_gap"] += 1
                    return

    def observe(self, op: str, expected: Mapping[str, Any]) -> None:
        """Count the paths the reference took, so tests can check the driver reaches them."""
        events = self.stats.events
        events[op] += 1
        if "raises" in expected:
            events["raises:" + str(expected["raises"])] += 1
            return
        result = expected["ok"]
        if op in LOOKUP_OPS:
            if result["num_computed_tokens"] > 0:
                events["prefix_hit"] += 1
            if result.get("hit_diverged"):
                events["connector_diverged"] += 1
        elif op == "allocate_slots" and result is None:
            events["allocate_none"] += 1
        elif op == "reset_prefix_cache":
            events[f"reset_{result}"] += 1
        elif op == "take_events":
            for event in result:
                events["event:" + event["type"]] += 1
                if event.get("fields", {}).get("lookahead_token_ids"):
                    events["event:lookahead"] += 1
                if event.get("fields", {}).get("session_id"):
                    events["event:session_id"] += 1


# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Family:
    """A family of random configs: the group layout and the knobs held fixed.

    ``kinds`` are layout tokens: full, swa, chunked, mamba-align, mamba-all,
    mamba-none, mamba (any mode), mamba-checkpoint ('align' with vLLM 0.33.0's prefill
    checkpoint blocks), cross, rswa (no sink: vLLM 0.25.1 cannot build
    a manager with a sink group). ``enable_caching`` / ``watermark``
    None: drawn at random. ``eagle``: probability of ``use_eagle``.
    ``mixed_block_sizes``: groups may have different block sizes.
    ``distinct_block_sizes``: every group has its own block size (the base times
    a shuffle of 1, 2, 4, ...), never all alike.
    ``retention``: draw a prefix-cache retention interval
    (``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``): 0 or k * scheduler_block_size.
    ``since``: the first vLLM release with the family's kinds (a family of a later
    release than 0.25.1, e.g. ring buffers, is not run against vLLM 0.25.1, which
    cannot build it: ``tests/conformance/test_conformance.py`` checks the refusal).
    ``lookahead``: draw vLLM 0.33.0's lookahead hashing (``num_hash_lookahead_tokens``
    0-3) and prefill lookahead (``num_prefill_lookahead`` 0-3, at most the scheduler
    block with an EAGLE group), last; only in families ``since`` 0.33.0.
    ``cp_geometry``: whose block geometry a one-group context-parallel config gets:
    "0.25.1" (a block spans ``block_size * dcp * pcp``, the config's own rule) or
    "0.33.0" (``block_size * dcp``: 0.33.0 refuses the 0.25.1 geometry under
    ``pcp > 1``), set as the scheduler and hash block; one config in
    ``1 / CP_GEOMETRY_KEPT`` keeps 0.25.1's, so refusals stay compared too.
    """

    name: str
    kinds: tuple[str, ...]
    enable_caching: bool | None = None
    watermark: float | None = None
    eagle: float = 0.15
    mixed_block_sizes: bool = True
    distinct_block_sizes: bool = False
    #: (dcp_world_size, pcp_world_size) choices; empty: no context parallelism.
    context_parallel: tuple[tuple[int, int], ...] = ()
    retention: bool = False
    since: str = "0.25.1"
    lookahead: bool = False
    cp_geometry: str = "0.25.1"


#: Every family the kit knows, by name (fuzz ``--layouts``; the conformance tests).
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("full", ("full",)),
        Family("full+full", ("full", "full")),
        Family("swa", ("swa",)),
        Family("chunked", ("chunked",)),
        Family("mamba", ("mamba",)),
        Family("full+swa", ("full", "swa")),
        Family("full+chunked", ("full", "chunked")),
        Family("full+mamba-align", ("full", "mamba-align")),
        Family("full+mamba-all", ("full", "mamba-all")),
        Family("full+mamba-none", ("full", "mamba-none")),
        Family("full+cross", ("full", "cross"), enable_caching=False),
        Family("full+swa+mamba", ("full", "swa", "mamba")),
        Family("full+swa+swa", ("full", "swa", "swa")),
        Family("swa+mamba", ("swa", "mamba")),
        Family("full+swa+cross", ("full", "swa", "cross"), enable_caching=False),
        Family("eagle-hybrid", ("full", "swa", "mamba-align"), eagle=1.0),
        # Three full-attention groups, each of its own block size: vLLM 0.25.1
        # trims only the first one's hits (docs/divergences.md #17).
        Family("full+full+full", ("full", "full", "full"), distinct_block_sizes=True),
        # Sparse retention: the interval thins out sliding-window and Mamba caching.
        Family("swa-retention", ("swa",), retention=True),
        Family("full+swa-retention", ("full", "swa"), retention=True),
        Family("full+mamba-align-retention", ("full", "mamba-align"), retention=True),
        Family("swa+mamba-retention", ("swa", "mamba"), retention=True),
        Family("full-dcp", ("full",), context_parallel=((2, 1), (4, 1), (1, 2), (2, 2))),
        # vLLM takes context parallelism with any layout when caching is off.
        Family(
            "hybrid-dcp",
            ("full", "swa", "chunked", "mamba"),
            enable_caching=False,
            context_parallel=((2, 1), (4, 1), (1, 2)),
        ),
        Family("mla", ("mla",)),
        Family("full+mla", ("full", "mla")),
        Family("full+swa-mla", ("full", "swa-mla")),
        Family("rswa", ("rswa",)),
        Family("full+rswa", ("full", "rswa")),
        Family("rswa+swa", ("rswa", "swa")),
        # Full attention under other spec classes: blocks reported for zeroing, events'
        # kinds (TurboQuant: full_attention; hidden states: mla_attention).
        Family("tq", ("tq",)),
        Family("full+hidden-state", ("full", "hidden-state")),
        # vLLM 0.33.0's ring buffer (CircularBufferSpec): one block per request, never
        # cached, left out of the hit search.
        Family("full+circular", ("full", "circular"), since="0.33.0"),
        Family("full+swa+circular", ("full", "swa", "circular"), since="0.33.0"),
        # vLLM 0.33.0's lookahead hashing and prefill lookahead (EAGLE / MTP drafters).
        # Not sliding window or Mamba alone: vLLM 0.33.0's hit search of those kinds
        # reads hashes up to the lookup length, past the fewer hashes lookahead leaves
        # (IndexError, in kvcache too); beside full attention its hit bounds theirs.
        # Mamba beside attention: the last families below.
        *(
            Family(name, kinds, eagle=0.3, since="0.33.0", lookahead=True)
            for name, kinds in (
                ("full-lookahead", ("full",)),
                ("full+swa-lookahead", ("full", "swa")),
                ("full+full-lookahead", ("full", "full")),
                ("full+chunked-lookahead", ("full", "chunked")),
            )
        ),
        # vLLM 0.33.0's Mamba prefill checkpoints: an 'align' group with checkpoint
        # blocks saves the state at a reusable position inside a long prefill chunk
        # (the scheduler then lets the chunk run past it), under dense, interval and
        # latest-only retention, with EAGLE often.
        Family("full+mamba-checkpoint", ("full", "mamba-checkpoint"), eagle=0.3, since="0.33.0"),
        Family(
            "full+mamba-checkpoint-retention",
            ("full", "mamba-checkpoint"),
            eagle=0.3,
            retention=True,
            since="0.33.0",
        ),
        Family("mamba-checkpoint", ("mamba-checkpoint",), eagle=0.3, since="0.33.0"),
        # A ring buffer beside Mamba 'align' with fine-grained hits: the partial-hit
        # rule reads only prefix-cacheable groups' managers, so the ring group is left
        # out of it (appended last: the other families keep their seeds).
        Family("full+circular+mamba", ("full", "circular", "mamba-align"), since="0.33.0"),
        # Lookahead beside Mamba 'align' (fine-grained hits, the prompt-tail state;
        # with prefill checkpoints too). The hash lookahead stays within the hash
        # block there: beyond it vLLM 0.33.0 keys an EAGLE request's prompt-tail
        # state past its hashes and asserts (docs/divergences.md, 0.33.0 doubt 7).
        *(
            Family(name, kinds, eagle=0.3, since="0.33.0", lookahead=True)
            for name, kinds in (
                ("full+mamba-align-lookahead", ("full", "mamba-align")),
                ("full+mamba-checkpoint-lookahead", ("full", "mamba-checkpoint")),
            )
        ),
        # Decode context parallelism beside Mamba 'align' with caching (0.33.0's
        # per-group geometry, ``dcp_sharded_geometry``: fine-grained hits at each group's
        # dcp-scaled block, the per-group connector lookup); 0.25.1 refuses these.
        *(
            Family(name, kinds, enable_caching=True, context_parallel=((2, 1), (4, 1)),
                   since="0.33.0")
            for name, kinds in (
                ("full+mamba-align-dcp", ("full", "mamba-align")),
                ("full+mamba-checkpoint-dcp", ("full", "mamba-checkpoint")),
            )
        ),
    ]
}


#: Under ``Family.cp_geometry`` "0.33.0", one context-parallel config in this many
#: keeps 0.25.1's block geometry (chosen from the config, not the draw's ``rng``).
CP_GEOMETRY_KEPT = 5


def release_cp_geometry(config: ManagerConfig, release: str) -> ManagerConfig:
    """``config`` (one group, context-parallel) with the scheduler and hash block of
    ``release``'s rule: 0.25.1's ``block_size * dcp * pcp`` (``config`` as it is) or
    0.33.0's ``block_size * dcp`` (pcp no longer scales a block).

    Raises:
        ValueError: an unknown ``release``.
    """
    if release not in ("0.25.1", "0.33.0"):
        raise ValueError(f"cp geometry release={release!r}; expected 0.25.1 or 0.33.0")
    if release == "0.25.1" or len(config.groups) != 1 or config.context_parallel == 1:
        return config
    if random.Random(f"cp geometry {config!r}").randrange(CP_GEOMETRY_KEPT) == 0:
        return config
    block = config.groups[0].block_size * config.dcp_world_size
    return replace(config, scheduler_block_size_override=block, hash_block_size_override=block)


def random_group(rng: random.Random, token: str, block_size: int, index: int) -> GroupConfig:
    heads = index + 1  # groups of one kind and block size still differ (vLLM needs that)
    if token == "swa":
        return GroupConfig(
            "sliding_window", block_size, sliding_window=rng.randint(1, 12), num_kv_heads=heads
        )
    if token == "chunked":
        return GroupConfig(
            "chunked_local", block_size, attention_chunk_size=rng.randint(1, 12), num_kv_heads=heads
        )
    if token == "mamba-checkpoint":
        return GroupConfig(
            "mamba",
            block_size,
            mamba_cache_mode="align",
            num_speculative_blocks=rng.choice([0, 0, 1, 2]),
            num_kv_heads=heads,
            num_prefill_checkpoint_blocks=rng.choice([1, 1, 2]),
            prefill_checkpoint_alignment=rng.choice([None, 1, 1, 2, 4]),
        )
    if token.startswith("mamba"):
        mode = token.partition("-")[2] or rng.choice(["none", "all", "align", "align"])
        return GroupConfig(
            "mamba",
            block_size,
            mamba_cache_mode=mode,
            num_speculative_blocks=rng.choice([0, 0, 1, 2]),
            num_kv_heads=heads,
        )
    if token == "cross":
        return GroupConfig("cross_attention", block_size, num_kv_heads=heads)
    if token == "swa-mla":
        return GroupConfig(
            "sliding_window_mla", block_size, sliding_window=rng.randint(1, 12), num_kv_heads=heads
        )
    if token == "mla":
        return GroupConfig("mla", block_size, num_kv_heads=heads)
    if token == "tq":
        return GroupConfig("tq_full", block_size, num_kv_heads=heads)
    if token == "hidden-state":
        return GroupConfig("hidden_state", block_size, num_kv_heads=heads)
    if token == "circular":
        return GroupConfig("circular", block_size, num_kv_heads=heads)
    if token == "rswa":  # short windows: decodes of a few tokens pass them
        return GroupConfig("rswa", block_size, rswa_window=rng.randint(1, 5), num_kv_heads=heads)
    return GroupConfig("full", block_size, num_kv_heads=heads)


def random_config(rng: random.Random, family: Family) -> ManagerConfig:
    """A small random config of ``family``: tiny pools and blocks, so that hits,
    evictions and preemptions happen.

    vLLM asserts on chunked local attention with EAGLE, or next to groups of
    other block sizes, when caching (docs/divergences.md); cross attention needs
    caching off: neither is generated.
    """
    kinds = family.kinds
    caching = family.enable_caching
    if caching is None:
        caching = rng.random() < 0.85
    if "cross" in kinds:
        caching = False
    watermark = family.watermark
    if watermark is None:
        watermark = rng.choice([0.0, 0.0, 0.1, 0.25])
    chunked_with_caching = caching and "chunked" in kinds
    if len(kinds) == 1:
        block_sizes = [rng.randint(1, 4)]
        num_blocks = rng.randint(2, 24)
    else:
        base = rng.choice([1, 2]) if family.mixed_block_sizes else rng.randint(1, 4)
        mixed = family.mixed_block_sizes and not chunked_with_caching and rng.random() < 0.6
        block_sizes = [base * (rng.choice([1, 2, 4]) if mixed else 1) for _ in kinds]
        if family.distinct_block_sizes:
            scales = [1 << i for i in range(len(kinds))]
            rng.shuffle(scales)
            block_sizes = [base * scale for scale in scales]
        num_blocks = rng.randint(3, 28) if rng.random() < 0.6 else rng.randint(30, 60)
    groups = [
        random_group(rng, t, b, i) for i, (t, b) in enumerate(zip(kinds, block_sizes, strict=True))
    ]
    eagle_ok = not chunked_with_caching
    if len(kinds) > 1 and eagle_ok and rng.random() < 0.2:
        groups = [
            GroupConfig(**{**g.__dict__, "is_eagle_group": rng.random() < 0.4}) for g in groups
        ]
    config = ManagerConfig(
        num_blocks=num_blocks,
        groups=tuple(groups),
        max_model_len=rng.choice([64, 64, rng.randint(6, 24)]),
        enable_caching=caching,
        watermark=watermark,
        log_stats=rng.random() < 0.9,
        enable_kv_cache_events=rng.random() < 0.9,
        use_eagle=eagle_ok and rng.random() < family.eagle,
        max_num_batched_tokens=rng.choice([None, 32]),
        hash_fn=rng.choice(["sha256", "sha256", "sha256", "sha256_cbor", "xxhash"]),
    )
    if family.context_parallel:  # drawn last: other families' draws stay as they were
        dcp, pcp = rng.choice(family.context_parallel)
        config = replace(config, dcp_world_size=dcp, pcp_world_size=pcp)
        config = release_cp_geometry(config, family.cp_geometry)
    if family.retention:  # drawn last: the other families' configs stay as they were
        interval = rng.choice([0, 0, 1, 2, 2, 3, 4]) * config.scheduler_block_size
        config = replace(config, prefix_cache_retention_interval=interval)
    if family.lookahead:  # drawn last too
        prefill = rng.choice([0, 0, 1, 2, 3])
        if config.enable_caching and config.has_eagle:
            prefill = min(prefill, config.scheduler_block_size)
        hash_lookahead = rng.choice([0, 1, 1, 2, 3])
        if any(kind.startswith("mamba") for kind in family.kinds):
            # vLLM 0.33.0 asserts beyond it (docs/divergences.md, 0.33.0 doubt 7)
            hash_lookahead = min(hash_lookahead, config.hash_block_size)
        config = replace(
            config,
            num_hash_lookahead_tokens=hash_lookahead,
            num_prefill_lookahead=prefill,
        )
    return config


# ---------------------------------------------------------------- random driver

#: How often a decode with drafts in a Mamba checkpoint layout keeps a hash block or
#: more of drafts, where vLLM 0.33.0 can reserve a checkpoint inside them and assert
#: (kvcache raises ``PartialBlockError`` at the same call); otherwise fewer drafts.
DRAFTS_PAST_HASHES_RATE = 0.5
#: What a reference raises there (vLLM's assert, the spec's or kvcache's refusal).
CHECKPOINT_IN_DRAFTS_RAISES = ("AssertionError", "ValueError", "PartialBlockError")

#: The prefix lookups a scheduler makes for a waiting request: the plain one, and
#: (0.33 line) the one for a KV connector that takes divergent hybrid hits.
LOOKUP_OPS = ("get_computed_blocks", "get_computed_blocks_for_connector")
#: The share of configs (0.33 line) whose scheduler has such a connector
#: (``RandomScheduler.connector_lookup``).
CONNECTOR_LOOKUP_RATE = 0.5

#: vLLM 0.33.0's request fields the kit draws for sides of that line (its
#: ``Request(session_id=...)`` and ``SamplingParams.extra_args["kv_cache_report_mode"]``).
REQUEST_FIELDS_0_33 = ("session_id", "kv_cache_report_mode")


def full_report_works(config: ManagerConfig) -> bool:
    """Whether vLLM 0.33.0 can report a lookup's hits in the "full" report mode for
    ``config``. It cannot (a vLLM bug, kvcache raises ValueError there instead) under
    ``dcp_world_size > 1``, where the coordinator hands the pool the spec's unscaled
    block size and the hash view asserts, nor with fine-grained hits, where a hit
    ending inside a block names one block more than the request has hashes of that
    size (IndexError)."""
    return config.dcp_world_size == 1 and not fine_grained_hits(config)


def draw_request_fields_0_33(rng: random.Random, full_report: bool = True) -> dict[str, Any]:
    """A request's vLLM 0.33.0 fields: a session id (two sessions) in about a third
    of requests, the "full" report mode in about a quarter where ``full_report``
    (``full_report_works``; the draw is the same either way) and "incremental", the
    default, spelled out in some."""
    fields: dict[str, Any] = {}
    if rng.random() < 0.35:
        fields["session_id"] = rng.choice(["session-a", "session-b"])
    mode = rng.random()
    if mode < 0.25:
        if full_report:
            fields["kv_cache_report_mode"] = "full"
    elif mode < 0.35:
        fields["kv_cache_report_mode"] = "incremental"
    return fields



@dataclass
class Req:
    """The driver's (scheduler's) view of one request."""

    request_id: str
    num_prompt_tokens: int
    num_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    status: str = "WAITING"
    num_computed_tokens: int = 0
    num_preemptions: int = 0


class RandomScheduler:
    """Makes the calls a vLLM scheduler would, with random choices at each step."""

    MAX_LIVE_REQUESTS = 6

    def __init__(self, rng: random.Random, run: Lockstep) -> None:
        self.rng = rng
        self.run = run
        self.config = config = run.config
        self.block_size = config.scheduler_block_size
        self.live: dict[str, Req] = {}
        self.running: list[str] = []
        self.all_ids: list[str] = []
        self.added: list[dict[str, Any]] = []
        self.deferred: list[int] = []
        self.next_handle = 0
        self.lookahead = 0 if rng.random() < 0.6 else rng.randint(1, 3)
        self.full_sequence_must_fit = rng.random() < 0.3
        mamba = [g for g in config.groups if g.kind == "mamba"]
        # vLLM 0.33.0's prefill checkpoints: longer prompts (a checkpoint sits inside a
        # chunk of at least two blocks), and its scheduler's split (``mamba_split``)
        # where every Mamba group has checkpoint blocks; the alignment is the first
        # Mamba group's, as vLLM's scheduler takes it.
        self.long_prompts = any(g.has_checkpoint_fields for g in mamba)
        self.checkpoints = bool(mamba) and all(g.num_prefill_checkpoint_blocks > 0 for g in mamba)
        self.checkpoint_alignment = mamba[0].prefill_checkpoint_alignment if mamba else None
        self.prompt_blocks = 5 if self.long_prompts else 2  # blocks of a prompt's tail
        stem_blocks = 6 if self.long_prompts else 3
        self.stems = [
            [rng.randrange(3) for _ in range(rng.randint(0, stem_blocks * self.block_size + 1))]
            for _ in range(3)
        ]
        # vLLM's scheduler splits prefill chunks at block multiples when a Mamba
        # group caches in "align" mode (Scheduler._mamba_block_aligned_split).
        self.mamba_align = any(g.mamba_cache_mode == "align" for g in mamba)
        # Layouts where vLLM 0.33.0 has fine-grained (sub-block) hits
        # (``fine_grained_hits``): its scheduler then also stops a prefill chunk at the
        # prompt's last reusable hash boundary (the Mamba prompt-tail state) and at the
        # end of a block a chunk starts inside.
        hbs = config.hash_block_size
        self.fine_grained = fine_grained_hits(config)
        # Draft tokens need a speculative state block each in every Mamba group.
        self.max_draft_tokens = min((g.num_speculative_blocks for g in mamba), default=3)
        self.encoder_decoder = any(g.kind == "cross_attention" for g in config.groups)
        self.rswa = any(g.kind == "rswa" for g in config.groups)
        # vLLM 0.33.0's scheduler drains the copy-on-write copies after each step's
        # allocations (take_kv_cache_block_copies) and frees the blocks they retain:
        # at once, or (deferred block freeing: a KV consumer with overlapping
        # batches) once the step running the copies is processed, which is after the
        # next step is scheduled. Only when every side is of a line that has copies,
        # and in layouts that can copy (a cached Mamba 'align' group with blocks
        # larger than the hash block: elsewhere the take is always empty, and an
        # unexpected copy shows in the ref counts). Its choices come from the
        # config, not ``rng``: the sequences' other calls stay as they were.
        sides = [run.reference] + ([run.subject] if run.subject is not None else [])
        self.takes_copies = (
            all(side_line(side) != REFERENCE_LINE for side in sides)
            and config.enable_caching is not False
            and any(g.mamba_cache_mode == "align" and g.block_size > hbs for g in mamba)
        )
        self.defer_copy_frees = random.Random(f"copies {config!r}").random() < 0.5
        # vLLM 0.33.0's scheduler also drains the boundary-state offloads every step
        # (take_boundary_state_offloads: the Mamba 'align' states a KV connector may
        # save, with exact block ids), and with a KV producer asks a finishing
        # request's own partial prompt-tail state (finalize_partial_tail_offloads)
        # before freeing it (unsafe, so refused, while tokens are in flight: a
        # finishing request then sometimes has some, ``num_in_flight_tokens``). Only
        # when every side is of the 0.33 line and has both (the spec models them;
        # kvcache's and vLLM's 0.25.1 managers have neither), in cached layouts with a
        # Mamba 'align' group; the producer's choices come from the config, not
        # ``rng``: the sequences' other calls stay as they were.
        self.takes_offloads = (
            self.mamba_align
            and config.enable_caching is not False
            and all(
                side_line(side) != REFERENCE_LINE
                and hasattr(side.manager, "take_boundary_state_offloads")
                and hasattr(side.manager, "finalize_partial_tail_offloads")
                for side in sides
            )
        )
        self.producer_rng = random.Random(f"producer {config!r}")
        self.kv_producer = self.producer_rng.random() < 0.5
        # A step schedules several requests (a preemption among them, a free dropping
        # a request's offers) before its one drain: the driver's one-request steps
        # sometimes leave the drain to a later one.
        self.offload_rng = random.Random(f"offloads {config!r}")
        self.copy_frees: list[int] = []  # deferred: freed at the next step's end
        # vLLM 0.33.0's request fields the manager reads (``REQUEST_FIELDS_0_33``): a
        # ``session_id`` its BlockStored events carry, and ``kv_cache_report_mode``
        # "full", under which a lookup's hit blocks are reported as stored again. Only
        # when every side is of a line that has them; drawn from a generator of their
        # own, so that the sequences' other calls stay as they were.
        self.request_fields_rng = (
            random.Random(f"request fields {config!r}")
            if all(side_line(side) != REFERENCE_LINE for side in sides)
            else None
        )
        self.full_report = full_report_works(config)
        # vLLM 0.33.0's scheduler with a KV connector that takes divergent hybrid hits
        # (``supports_divergent_local_hybrid_hits``) looks every request up with
        # ``get_computed_blocks_for_connector``, and again with ``get_computed_blocks``
        # when that hit diverged and the connector has no tokens for it. A choice of
        # the config's (its own generator: the sequences' other calls stay as they
        # were), only when every side is of a line that has the method. Not with
        # lookahead hashing: vLLM 0.33.0's config turns it off under a KV connector
        # (``VllmConfig.num_hash_lookahead_tokens``), and its per-group lookup of a
        # Mamba group would read past the fewer hashes (IndexError).
        self.connector_lookup = (
            config.num_hash_lookahead_tokens == 0
            and all(
                side_line(side) != REFERENCE_LINE
                and hasattr(side.manager, "get_computed_blocks_for_connector")
                for side in sides
            )
            and random.Random(f"connector lookup {config!r}").random() < CONNECTOR_LOOKUP_RATE
        )
        # vLLM 0.33.0's zeroing duties with a KV connector: an async load names the
        # groups it writes (``skip_zeroing_group_ids``: their blocks for the external
        # tokens are not reported for zeroing), and a failed load reports the
        # request's blocks past the valid prefix for zeroing again
        # (``record_blocks_for_zeroing``). Only when every side is of the 0.33 line;
        # drawn from a generator of their own (the other calls stay as they were).
        self.zeroing_rng = (
            random.Random(f"zeroing {config!r}")
            if all(side_line(side) != REFERENCE_LINE for side in sides)
            else None
        )

    # ------------------------------------------------------------ helpers

    def report_mode(self, request_id: str) -> str:
        """The request's ``kv_cache_report_mode`` (vLLM 0.33.0's default: incremental)."""
        for args in reversed(self.added):
            if args["request_id"] == request_id:
                return str(args.get("kv_cache_report_mode", "incremental"))
        return "incremental"

    def waiting(self) -> list[str]:
        return [r for r, q in self.live.items() if q.status in ("WAITING", "PREEMPTED")]

    def remote(self) -> list[str]:
        return [r for r, q in self.live.items() if q.status == "WAITING_FOR_REMOTE_KVS"]

    def chunk(self, remaining: int) -> int:
        """Tokens scheduled out of ``remaining``: often all, else a random chunk."""
        if remaining <= 1 or self.rng.random() < 0.6:
            return remaining
        return self.rng.randint(1, remaining)

    def lookahead_tokens(self) -> int:
        return self.lookahead if self.rng.random() < 0.9 else self.rng.randint(0, 3)

    def mamba_split(self, req: Req, num_new_tokens: int, num_new_computed_tokens: int = 0) -> int:
        """vLLM's block-aligned prefill split for Mamba "align" caching (without the
        Marconi common-prefix hint, which needs coordinator internals)."""
        if not self.mamba_align:
            return num_new_tokens
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        if num_computed >= max(req.num_prompt_tokens, req.num_tokens - 1):
            return num_new_tokens  # decoding
        bs = self.block_size
        last_cache_position = req.num_tokens - req.num_tokens % bs
        if self.config.use_eagle:
            last_cache_position = max(last_cache_position - bs, 0)
        # A chunk whose layer saves the prompt's checkpoint inside it is not cut there.
        internal = self.internal_checkpoint(req, num_computed, num_computed + num_new_tokens)
        if internal:
            last_cache_position = 0
            self.run.stats.events["checkpoint_chunk"] += 1
        after = num_computed + num_new_tokens
        if after < last_cache_position:
            num_new_tokens = num_new_tokens // bs * bs
        elif num_computed < last_cache_position < after:
            num_new_tokens = last_cache_position - num_computed
        if self.fine_grained:
            hbs = self.config.hash_block_size
            tail = req.num_prompt_tokens if self.config.use_eagle else req.num_prompt_tokens - 1
            tail = max(tail, 0) // hbs * hbs - (hbs if self.config.use_eagle else 0)
            stops = [
                (num_computed // bs + 1) * bs if num_computed % bs and not internal else 0,
                tail if last_cache_position < tail < req.num_prompt_tokens and not internal else 0,
            ]
            end = num_computed + num_new_tokens
            inside = [p for p in stops if num_computed < p < end]
            if inside:
                num_new_tokens = min(inside) - num_computed
        return num_new_tokens

    def internal_checkpoint(self, req: Req, start: int, end: int) -> bool:
        """vLLM 0.33.0's scheduler: whether the prefill chunk ``[start, end)`` reaching
        the prefill's end lets the Mamba layers save the prompt's checkpoint inside it
        (every Mamba group has checkpoint blocks; the position exportable there)."""
        if not self.checkpoints:
            return False
        pure = spec_module("pure")  # the oracle's arithmetic: the kit imports spec lazily

        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if end < prefill_end:
            return False
        hbs = self.config.hash_block_size
        position = pure.mamba_prompt_tail_boundary(
            prefill_end,
            hbs if self.fine_grained else self.block_size,
            self.config.use_eagle,
            self.config.num_hash_lookahead_tokens,
        )
        return bool(pure.mamba_checkpoint_exportable(
            start, end, position, hbs, self.block_size, self.checkpoint_alignment
        ))

    # ------------------------------------------------------------ actions

    def step(self) -> None:
        rng = self.rng
        actions: list[tuple[float, Callable[[], None]]] = [
            (0.5, self.evict_blocks),
            (0.25, self.reset_prefix_cache),
            (1.5, lambda: self.run.ok("take_events")),
            (0.8, lambda: self.run.ok("take_new_block_ids")),
            (0.4, lambda: self.run.ok("new_step_starts")),
            (0.5, lambda: self.run.ok("make_prefix_cache_stats")),
            (0.4, lambda: self.run.ok("usage")),
            (0.2, self.invalid_call),
        ]
        if len(self.live) < self.MAX_LIVE_REQUESTS:
            actions.append((3.0, self.add_request))
        if self.waiting():
            actions.append((4.0, self.schedule_waiting))
        if self.running:
            actions.append((6.0, self.schedule_running))
            actions.append((0.8, self.preempt_random))
            actions.append((1.0, self.common_prefix))
            actions.append((0.3, self.remove_skipped_blocks))
        if self.remote():
            actions.append((2.0, self.finish_remote_load))
        if self.live:
            actions.append((1.0, self.finish_random))
            actions.append((0.8, self.query_blocks))
        if self.deferred:
            actions.append((1.0, self.drain_deferred))
        weights = [w for w, _ in actions]
        rng.choices([a for _, a in actions], weights)[0]()

    def add_request(self) -> None:
        rng = self.rng
        request_id = f"r{len(self.all_ids)}"
        if self.added and rng.random() < 0.15:
            args = dict(rng.choice(self.added), request_id=request_id)
        else:
            stem = rng.choice(self.stems)
            tail_len = rng.randint(0, self.prompt_blocks * self.block_size + 1)
            tail = [rng.randrange(3) for _ in range(tail_len)]
            prompt = (stem + tail)[: self.config.max_model_len - 1] or [rng.randrange(3)]
            args = {"request_id": request_id, "prompt_token_ids": prompt}
            # R-SWA frees its gap only once a decode passes its window: longer decodes.
            args["max_tokens"] = rng.randint(1, 24 if self.rswa else 12)
            if rng.random() < 0.15:
                args["lora"] = rng.choice([["lora-a", 1], ["lora-b", 2]])
            if rng.random() < 0.1:
                args["cache_salt"] = rng.choice(["salt-x", "salt-y"])
            if rng.random() < 0.15:
                args["mm_features"] = self.random_mm_features(len(prompt))
            if rng.random() < 0.05:
                args["skip_reading_prefix_cache"] = True
            if rng.random() < 0.1:
                embeds = self.random_prompt_embeds(prompt)
                embeds_alone = rng.random() < 0.3
                if PROMPT_EMBEDS_DRAWN:  # the same draws either way: the same sequences
                    args["prompt_embeds"] = embeds
                    if embeds_alone:
                        args["prompt_token_ids"] = None  # the embeddings alone are the prompt
            if self.request_fields_rng is not None:
                args.update(
                    draw_request_fields_0_33(self.request_fields_rng, self.full_report)
                )
        self.added.append(args)
        self.all_ids.append(request_id)
        self.run.ok("add_request", **args)
        prompt_len = len(args["prompt_token_ids"] or args.get("prompt_embeds") or [])
        self.live[request_id] = Req(request_id, prompt_len, prompt_len, args["max_tokens"])

    def random_prompt_embeds(self, prompt: list[int]) -> list[list[float]]:
        """Two-wide embedding rows, one per prompt token: the token and one of two
        "styles", so that equal prompts in one style share their prefix and the
        same tokens in the other style must not (exact binary fractions, so the
        float32 tensors and their digests are the same on every side)."""
        style = self.rng.choice([0.0, 0.5])
        return [[float(token), style] for token in prompt]

    def random_mm_features(self, prompt_len: int) -> list[list[Any]]:
        """1-2 sorted, non-overlapping placeholder ranges inside the prompt."""
        features: list[list[Any]] = []
        start = 0
        for _ in range(self.rng.randint(1, 2)):
            if start >= prompt_len:
                break
            offset = self.rng.randint(start, prompt_len - 1)
            length = self.rng.randint(1, min(2 * self.block_size, prompt_len - offset))
            features.append([self.rng.choice(["img-0", "img-1"]), offset, length])
            start = offset + length
        return features

    def schedule_waiting(self) -> None:
        """Admit a waiting or preempted request (the scheduler's WAITING loop)."""
        rng = self.rng
        req = self.live[rng.choice(self.waiting())]
        rid = req.request_id
        hit: dict[str, Any] = {}
        if req.num_computed_tokens == 0:
            lookup = LOOKUP_OPS[1] if self.connector_lookup else LOOKUP_OPS[0]
            hit = self.run.ok(lookup, request_id=rid)
            num_hit_tokens = hit["num_computed_tokens"]
            which = "last"
            if num_hit_tokens and self.report_mode(rid) == "full":
                self.run.stats.events["full_report_hit"] += 1
        else:  # after an async KV load: no new lookup
            num_hit_tokens = 0
            which = "empty"
        num_external = 0
        load_async = False
        room = req.num_tokens - req.num_computed_tokens - num_hit_tokens
        if req.num_computed_tokens == 0 and rng.random() < 0.15:
            if rng.random() < 0.4 and room >= 1:
                load_async = True
                num_external = rng.randint(1, room)
            elif room >= 2:
                num_external = rng.randint(1, room - 1)
            if self.mamba_align:  # connectors hand over whole blocks of Mamba state
                bs = self.block_size
                num_external = (num_hit_tokens + num_external) // bs * bs - num_hit_tokens
                num_external = max(num_external, 0)
                load_async = load_async and num_external > 0
        if num_external and self.untrimmed_hit(hit, num_hit_tokens + num_external):
            num_external = 0  # vLLM 0.25.1 would miscount its pool (docs/divergences.md #17)
            load_async = False
        if hit.get("hit_diverged"):
            if num_external:
                self.run.stats.events["connector_diverged_external"] += 1
            else:
                # As vLLM 0.33.0's scheduler: no external tokens back the deeper local
                # hit (a group has no state there), so look up the length all agree on.
                self.run.stats.events["connector_fallback"] += 1
                hit = self.run.ok("get_computed_blocks", request_id=rid)
                num_hit_tokens = hit["num_computed_tokens"]
        total = req.num_computed_tokens + num_hit_tokens + num_external
        num_new_tokens = 0
        if not load_async:
            num_new_tokens = self.mamba_split(
                req, self.chunk(req.num_tokens - total), num_hit_tokens + num_external
            )
            if num_new_tokens == 0:
                return  # no block-aligned chunk fits: vLLM leaves it waiting
        has_scheduled = bool(self.running) if rng.random() < 0.85 else rng.random() < 0.5
        zeroing: dict[str, Any] = {}
        if load_async and self.zeroing_rng is not None:
            # the groups the connector's load writes, as vLLM 0.33.0's scheduler asks it
            skipped = [g for g in range(len(self.config.groups)) if self.zeroing_rng.random() < 0.5]
            if skipped:
                zeroing["skip_zeroing_group_ids"] = skipped
                self.run.stats.events["skip_zeroing"] += 1
        ok, blocks = self.allocate(
            rid,
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=which,
            num_lookahead_tokens=0 if load_async else self.lookahead_tokens(),
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async or rng.random() < 0.05,
            num_encoder_tokens=rng.randint(1, 12) if self.encoder_decoder else 0,
            full_sequence_must_fit=self.full_sequence_must_fit != (rng.random() < 0.1),
            reserved_blocks=0 if rng.random() < 0.85 else rng.randint(1, 3),
            has_scheduled_reqs=has_scheduled,
            **zeroing,
        )
        if not ok or blocks is None:
            return
        if load_async:
            req.status = "WAITING_FOR_REMOTE_KVS"
            req.num_computed_tokens = total
            self.run.ok(
                "update_request", request_id=rid, status=req.status, num_computed_tokens=total
            )
            return
        req.status = "RUNNING"
        self.running.append(rid)
        self.computed(req, num_new_tokens, total, num_draft_tokens=0)

    def schedule_running(self) -> None:
        """Schedule a running request: a prefill chunk, or a decode with drafts."""
        rng = self.rng
        rid = rng.choice(self.running)
        req = self.live[rid]
        remaining = req.num_tokens - req.num_computed_tokens
        cap = self.config.max_model_len - req.num_computed_tokens - 1
        num_new_tokens = self.mamba_split(req, min(self.chunk(remaining), cap))
        num_draft_tokens = 0
        drafts_past_hashes = False
        if remaining == 1 and rng.random() < (0.4 if self.lookahead else 0.1):
            num_draft_tokens = min(rng.randint(1, 3), cap - num_new_tokens, self.max_draft_tokens)
            if self.checkpoints:
                # vLLM 0.33.0 can reserve a checkpoint inside draft tokens that span a
                # hash block, and then asserts keying it past the hashed tokens
                # (docs/divergences.md, "vLLM 0.33.0: matched although doubtful"):
                # half of such decodes keep their drafts (a few cases per hundred
                # sequences), the others get fewer than a hash block.
                drafts_past_hashes = rng.random() < DRAFTS_PAST_HASHES_RATE
                if not drafts_past_hashes:
                    num_draft_tokens = min(num_draft_tokens, self.config.hash_block_size - 1)
            num_draft_tokens = max(num_draft_tokens, 0)
        drafts_past_hashes = drafts_past_hashes and num_draft_tokens >= self.config.hash_block_size
        if num_new_tokens <= 0:
            return
        while True:
            ok, blocks = self.allocate(
                rid,
                num_new_tokens=num_new_tokens + num_draft_tokens,
                num_lookahead_tokens=self.lookahead_tokens(),
                may_assert=drafts_past_hashes,
            )
            if not ok:
                return
            if blocks is not None:
                break
            if rng.random() < 0.3:
                return  # the scheduler gives up on this request for this step
            victim = self.running[-1] if rng.random() < 0.7 else rng.choice(self.running)
            self.preempt(victim)
            if victim == rid:
                return
        self.computed(
            req, num_new_tokens + num_draft_tokens, req.num_computed_tokens, num_draft_tokens
        )

    def untrimmed_hit(self, hit: Mapping[str, Any], num_tokens: int) -> bool:
        """Whether a lookup left a group more hit blocks than ``num_tokens`` need.

        vLLM 0.25.1 trims only the first full-attention group's hits (three or
        more full groups); external tokens then make it ask its pool for a
        negative number of blocks, which inflates its free count and can later
        hand out its sentinel block (id -1). A scheduler meets this only with a
        KV connector; the driver does not generate it (docs/divergences.md #17).
        """
        block_ids = hit.get("block_ids", {})
        groups = block_ids.get("tuple") if isinstance(block_ids, dict) else None
        if not isinstance(groups, list):
            return False
        return any(
            len(blocks) > -(-num_tokens // group.block_size)
            for blocks, group in zip(groups, self.config.groups, strict=False)
        )

    def allocate(self, rid: str, may_assert: bool = False, **args: Any) -> tuple[bool, Any]:
        """``allocate_slots``; returns (ok, block ids or None).

        vLLM's admission check undercounts a few hybrid cases (external tokens
        beside Mamba and sliding-window groups), so the pool can run dry
        inside ``allocate_slots``: ValueError "Cannot get N free blocks".
        kvcache must do the same; the driver then aborts the request, as an
        engine would after the error. With ``may_assert`` (a decode whose drafts
        span a hash block in a checkpoint layout) the reference may also refuse a
        checkpoint inside the drafts (``CHECKPOINT_IN_DRAFTS_RAISES``): counted as
        ``checkpoint_in_drafts``, and the request is aborted the same way.
        """
        expected = self.run.call("allocate_slots", request_id=rid, **args)
        if "raises" not in expected:
            if expected["ok"] is not None:
                self.take_offloads(maybe=True)
                self.take_copies()
            return True, expected["ok"]
        refused = str(expected.get("message", "")).startswith("Cannot get")
        if may_assert and not refused and expected["raises"] in CHECKPOINT_IN_DRAFTS_RAISES:
            # A checkpoint inside draft tokens: vLLM 0.33.0 asserts, kvcache and the
            # spec raise ValueError (both sides compared at the call). The engine
            # would stop; the request is aborted.
            self.run.stats.events["checkpoint_in_drafts"] += 1
            self.finish(rid, "FINISHED_ABORTED")
            return False, None
        if expected["raises"] != "ValueError":
            raise DriverError(
                f"{self.run.reference_name} raised {expected['raises']} on "
                f"allocate_slots({rid}, {args}): {expected.get('message')}"
            )
        self.run.stats.events["allocate_pool_ran_dry"] += 1
        self.finish(rid, "FINISHED_ABORTED")
        return False, None

    def computed(
        self, req: Req, num_scheduled: int, num_computed_before: int, num_draft_tokens: int
    ) -> None:
        """After a step: advance computed tokens, and sample if the prefill is done."""
        rng = self.rng
        num_computed = num_computed_before + num_scheduled
        if num_computed < req.num_tokens:
            req.num_computed_tokens = num_computed
            self.run.ok(
                "update_request",
                request_id=req.request_id,
                status=req.status,
                num_computed_tokens=num_computed,
            )
            return
        num_accepted = rng.randint(0, num_draft_tokens)
        num_computed -= num_draft_tokens - num_accepted
        req.num_computed_tokens = num_computed
        self.run.ok(
            "update_request",
            request_id=req.request_id,
            status=req.status,
            num_computed_tokens=num_computed,
        )
        new_tokens = [rng.randrange(2) for _ in range(num_accepted + 1)]
        self.run.ok(
            "append_output_token_ids",
            request_id=req.request_id,
            token_ids=new_tokens[0] if len(new_tokens) == 1 and rng.random() < 0.5 else new_tokens,
        )
        req.num_tokens += len(new_tokens)
        req.num_output_tokens += len(new_tokens)
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self.finish(req.request_id, "FINISHED_LENGTH_CAPPED")
        elif rng.random() < 0.05:
            self.finish(req.request_id, "FINISHED_STOPPED")

    def free_request_blocks(self, rid: str) -> None:
        """``free``, or ``pop_blocks_for_free`` now and ``free_blocks`` later."""
        if self.rng.random() < 0.75:
            self.run.ok("free", request_id=rid)
            return
        handle = self.next_handle
        self.next_handle += 1
        self.run.ok("pop_blocks_for_free", request_id=rid, handle=handle)
        self.deferred.append(handle)

    def preempt(self, rid: str) -> None:
        req = self.live[rid]
        self.running.remove(rid)
        self.free_request_blocks(rid)
        req.status = "PREEMPTED"
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.run.ok(
            "update_request",
            request_id=rid,
            status="PREEMPTED",
            num_computed_tokens=0,
            num_preemptions=req.num_preemptions,
        )

    def preempt_random(self) -> None:
        self.preempt(self.rng.choice(self.running))

    def finish(self, rid: str, status: str) -> None:
        self.live.pop(rid)
        if rid in self.running:
            self.running.remove(rid)
        in_flight = 0
        if self.takes_offloads and self.kv_producer:
            in_flight = self.producer_rng.choice([0, 0, 0, 1, 2])
        if in_flight:
            self.run.ok(
                "update_request", request_id=rid, status=status, num_in_flight_tokens=in_flight
            )
        else:
            self.run.ok("update_request", request_id=rid, status=status)
        if self.takes_offloads and self.kv_producer:
            tails = self.run.ok("finalize_partial_tail_offloads", request_id=rid)
            self.run.stats.events["partial_tail_offloads"] += len(tails)
        self.free_request_blocks(rid)

    def finish_random(self) -> None:
        self.finish(self.rng.choice(sorted(self.live)), "FINISHED_ABORTED")

    def finish_remote_load(self) -> None:
        """The connector reports an async KV load done (sometimes with failed blocks)."""
        rng = self.rng
        req = self.live[rng.choice(self.remote())]
        rid = req.request_id
        if rng.random() < 0.8:
            self.run.ok("cache_blocks", request_id=rid, num_computed_tokens=req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
        else:  # invalid blocks: keep the longest valid block-aligned prefix
            bs = self.block_size
            num_valid_blocks = min(req.num_computed_tokens, req.num_tokens - 1) // bs
            req.num_computed_tokens = rng.randint(0, num_valid_blocks) * bs
            self.run.ok(
                "update_request", request_id=rid, num_computed_tokens=req.num_computed_tokens
            )
            if req.num_computed_tokens:
                self.run.ok(
                    "cache_blocks", request_id=rid, num_computed_tokens=req.num_computed_tokens
                )
                cp = self.config.dcp_world_size * self.config.pcp_world_size
                if self.zeroing_rng is not None and all(
                    req.num_computed_tokens % (g.block_size * cp) == 0 for g in self.config.groups
                ):  # a multiple of every group's block (under context parallelism too)
                    # vLLM 0.33.0's scheduler: the blocks past the valid prefix were
                    # never written, and their zeroing was skipped; zero them now
                    self.run.ok(
                        "record_blocks_for_zeroing",
                        request_id=rid,
                        start_token=req.num_computed_tokens,
                    )
            else:
                self.run.ok("free", request_id=rid)
        req.status = "PREEMPTED" if req.num_preemptions else "WAITING"
        self.run.ok(
            "update_request",
            request_id=rid,
            status=req.status,
            num_computed_tokens=req.num_computed_tokens,
        )

    def take_copies(self, last: bool = False) -> None:
        """The end of a scheduler step (0.33 line; the driver's steps schedule one
        request): take the copy-on-write copies and free the blocks they retain, at
        once, or (``defer_copy_frees``) at the end of the next step, when the step
        that ran the copies has been processed; ``last``: the final one, all freed."""
        if not self.takes_copies:
            return
        processed, self.copy_frees = self.copy_frees, []
        handle = self.next_handle
        result = self.run.ok("take_kv_cache_block_copies", handle=handle)
        if result["copies"]:  # else the scheduler frees nothing
            self.next_handle += 1
            self.run.stats.events["cow_copies"] += len(result["copies"])
            if self.defer_copy_frees and not last:
                self.copy_frees.append(handle)
                self.run.stats.events["cow_frees_deferred"] += 1
            else:
                processed.append(handle)
        for done in processed:
            self.run.ok("free_blocks", handle=done)

    def take_offloads(self, maybe: bool = False) -> None:
        """The boundary-state offloads of the step (``takes_offloads``), counted;
        ``maybe``: one time in four left to a later step (``offload_rng``)."""
        if not self.takes_offloads or (maybe and self.offload_rng.random() < 0.25):
            return
        offloads = self.run.ok("take_boundary_state_offloads")
        self.run.stats.events["boundary_offloads"] += sum(len(v) for v in offloads.values())

    def drain_deferred(self) -> None:
        for _ in range(self.rng.randint(1, len(self.deferred))):
            self.run.ok("free_blocks", handle=self.deferred.pop(0))

    def evict_blocks(self) -> None:
        n = self.config.num_blocks
        block_ids = sorted(self.rng.sample(range(n), self.rng.randint(1, min(3, n))))
        self.run.ok("evict_blocks", block_ids=block_ids)

    def reset_prefix_cache(self) -> None:
        self.run.ok("reset_prefix_cache")

    def common_prefix(self) -> None:
        if self.rng.random() < 0.05:
            rid = self.rng.choice(self.all_ids)  # vLLM then records an empty entry
        else:
            rid = self.rng.choice(self.running)
        self.run.ok("get_num_common_prefix_blocks", request_id=rid)

    def remove_skipped_blocks(self) -> None:
        req = self.live[self.rng.choice(self.running)]
        self.run.ok(
            "remove_skipped_blocks",
            request_id=req.request_id,
            total_computed_tokens=req.num_computed_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
        )

    def query_blocks(self) -> None:
        req = self.live[self.rng.choice(sorted(self.live))]
        op = self.rng.choice(["get_block_ids", "get_blocks", "get_block_ids_for_computed_tokens"])
        if op == "get_block_ids_for_computed_tokens":
            self.run.ok(op, request_id=req.request_id, num_computed_tokens=req.num_computed_tokens)
        else:
            self.run.ok(op, request_id=req.request_id)

    def invalid_call(self) -> None:
        """Calls vLLM rejects before changing anything."""
        if self.live and self.rng.random() < 0.5:
            rid = self.rng.choice(sorted(self.live))
            self.run.raises("allocate_slots", request_id=rid, num_new_tokens=0)
        else:
            bad_id = self.config.num_blocks + self.rng.randint(0, 3)
            self.run.raises("evict_blocks", block_ids=[bad_id])

    def drain(self) -> None:
        """Finish everything, then check the pool comes back whole."""
        for rid in sorted(self.live):
            self.finish(rid, "FINISHED_ABORTED")
        self.take_offloads()
        self.take_copies(last=True)
        while self.deferred:
            self.run.ok("free_blocks", handle=self.deferred.pop(0))
        for op in ("take_events", "take_new_block_ids", "make_prefix_cache_stats", "usage"):
            self.run.ok(op)
        self.run.ok("reset_prefix_cache")
        self.run.ok("take_events")


@dataclass
class SequenceResult:
    """One random sequence: its seed, config, calls, and the first mismatch if any."""

    seed: int
    family: str
    config: ManagerConfig
    run: Lockstep | None
    mismatch: Mismatch | None
    #: Why a side could not build the manager ("cannot build: ..."), if it could not.
    cannot_build: str | None = None
    #: The ledger entry that explains ``cannot_build``, if one does.
    cannot_build_known: str | None = None

    @property
    def unknown(self) -> bool:
        """A divergence no ledger entry explains (a known one is reported, not failed)."""
        return self.mismatch is not None and not self.mismatch.known


def run_sequence(
    seed: int,
    family: Family | str,
    subject: str | None,
    reference: str = "vllm",
    stats: Stats | None = None,
    num_steps: tuple[int, int] = (20, 120),
    record_state: bool = False,
    rng: random.Random | None = None,
    make_run: Callable[..., Lockstep] = Lockstep,
) -> SequenceResult:
    """Generate and run one seeded random sequence of ``family`` in lockstep.

    ``rng`` replaces ``random.Random(seed)`` as the source of every choice
    (Hypothesis passes its own, so that it can shrink and mutate the choices);
    ``make_run`` builds the lockstep (``kvcache.kit.levels``: another level, features).
    """
    if isinstance(family, str):
        family = FAMILIES[family]
    stats = stats if stats is not None else Stats()
    rng = rng if rng is not None else random.Random(seed)
    config = random_config(rng, family)
    stats.sequences += 1
    stats.count_config(family.name, config)
    run: Lockstep | None = None
    mismatch = None
    try:
        run = make_run(config, subject, reference, stats=stats, record_state=record_state)
        run.check_state()
        scheduler = RandomScheduler(rng, run)
        for _ in range(rng.randint(*num_steps)):
            scheduler.step()
        scheduler.drain()
    except Mismatch as exc:
        mismatch = exc
    except CannotBuild as exc:
        stats.cannot_build[family.name] += 1
        known = cannot_build_entry(config, exc, subject, reference)
        return SequenceResult(seed, family.name, config, None, None, str(exc), known)
    if mismatch is not None and not mismatch.known:
        stats.mismatching_sequences += 1
    return SequenceResult(seed, family.name, config, run, mismatch)


def cannot_build_entry(config: ManagerConfig, exc: CannotBuild, *impls: str | None) -> str | None:
    """The ledger entry that explains why one side cannot build ``config``: the
    installed vLLM of a later release line (a layout it dropped), or, beside it, the
    side that behaves like 0.25.1 (``impls``: a layout the later release added)."""
    if exc.impl == "vllm":
        refused_by = "new"
    elif "vllm" in impls:
        refused_by = "old"
    else:
        return None
    from kvcache.kit.sides import resolve_adapter

    version = resolve_adapter("vllm").version
    line = release_line_of(version)
    if line == REFERENCE_LINE:
        return None
    return Judge(config, line, old_is_expected=True).cannot_build(exc.reason, refused_by)


# ---------------------------------------------------------------- replay and shrinking


Call = tuple[str, dict[str, Any]]


def replay_lockstep(
    config: ManagerConfig,
    calls: Sequence[Call],
    subject: str,
    reference: str,
    allowed_raises: Sequence[bool],
    hash_seed: str = "0",
    make_run: Callable[..., Lockstep] = Lockstep,
) -> tuple[bool, Mismatch | None, Lockstep | None]:
    """Replay ``calls`` in lockstep; returns (valid, mismatch, run).

    The sequence is invalid when the reference rejects a call it accepted in
    the original (``allowed_raises[i]`` is False) or the harness cannot make it.
    """
    try:
        run = make_run(config, subject, reference, hash_seed, record_state=False)
        run.check_state()
    except Mismatch as exc:
        return True, exc, None
    except CannotBuild:
        return False, None, None
    for i, (op, args) in enumerate(calls):
        try:
            expected = run.call(op, **args)
        except HarnessError:
            return False, None, run
        except Mismatch as exc:
            return True, exc, run
        if "raises" in expected and not allowed_raises[i]:
            return False, None, run
    return True, None, run


FINISHED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_IGNORED")


def scheduler_could_make(calls: Sequence[Call], admitted: Sequence[bool] | None = None) -> bool:
    """Whether a call list keeps the scheduler's rules, so a shrunk sequence stays one
    a real scheduler could make.

    Checked: calls on a request come after its ``add_request``; a prefix lookup
    (either of ``LOOKUP_OPS``, the connector's fallback after the connector lookup
    too) only for a waiting or preempted request with no computed tokens and no
    allocation since its status last changed; an
    allocation with ``new_computed_blocks="last"`` right after a lookup of that
    request; nothing but the free (a KV producer's ``finalize_partial_tail_offloads``
    before it) once a request finished, nothing after the free; ``free_blocks``
    only of a popped (or taken copies') handle, once. ``admitted[i]``: call
    ``i`` is an allocation that succeeded in the original sequence (default: all).
    """
    status: dict[str, str] = {}
    computed: dict[str, int] = {}
    looked_up: set[str] = set()
    allocated: set[str] = set()  # allocated since its status last changed
    freed: set[str] = set()
    popped: set[Any] = set()
    for i, (op, args) in enumerate(calls):
        rid = str(args.get("request_id"))
        if op == "add_request":
            if rid in status:
                return False
            status[rid], computed[rid] = "WAITING", 0
            continue
        if op == "take_kv_cache_block_copies":
            popped.add(args.get("handle"))
            continue
        if op == "finalize_partial_tail_offloads":  # a finished request, before its free
            if rid not in status or rid in freed or status[rid] not in FINISHED:
                return False
            continue
        if op == "free_blocks":
            if args.get("handle") not in popped:
                return False
            popped.discard(args.get("handle"))
            continue
        if "request_id" not in args or op == "get_num_common_prefix_blocks":
            continue
        if rid not in status or rid in freed:
            return False
        finished = status[rid] in FINISHED
        if op == "update_request":
            if finished:
                return False
            status[rid] = args.get("status", status[rid])
            computed[rid] = args.get("num_computed_tokens", computed[rid])
            looked_up.discard(rid)
            if "status" in args:
                allocated.discard(rid)
        elif op in ("free", "pop_blocks_for_free"):
            if op == "pop_blocks_for_free":
                popped.add(args.get("handle"))
            if finished:
                freed.add(rid)
            looked_up.discard(rid)
        elif finished:
            return False
        elif op in LOOKUP_OPS:
            if status[rid] not in ("WAITING", "PREEMPTED") or computed[rid] != 0:
                return False
            if rid in allocated:  # admitted: the scheduler's status update comes first
                return False
            looked_up.add(rid)
        elif op == "allocate_slots":
            if args.get("new_computed_blocks") == "last" and rid not in looked_up:
                return False
            looked_up.discard(rid)
            if admitted is None or admitted[i]:
                allocated.add(rid)
    return True


def same_failure(a: Mismatch, b: Mismatch) -> bool:
    """The same failure: the same call kind, the same kind of difference on the same
    field in the same way (``Mismatch.way``), the same ledger entry."""
    return (a.op, a.part, a.way, a.known) == (b.op, b.part, b.way, b.known)


def shrink(
    config: ManagerConfig,
    calls: Sequence[Call],
    subject: str,
    reference: str,
    hash_seed: str = "0",
    budget_s: float = 60.0,
    make_run: Callable[..., Lockstep] = Lockstep,
) -> list[Call]:
    """Greedy chunk-removal shrinking of a failing call list (delta debugging).

    Keeps a candidate when a scheduler could make it (``scheduler_could_make``),
    it is still a valid sequence for the reference, and it still fails the same
    way (``same_failure``: same op, same field differing the same way, same ledger
    entry).
    """
    records = list(calls)
    allowed = [True] * len(records)
    _, exc, run = replay_lockstep(config, records, subject, reference, allowed, hash_seed, make_run)
    if exc is None or run is None:
        return records if exc is None else []
    original = exc
    records = records[: exc.index + 1]
    raised = ["raises" in r for r in run.records[: exc.index + 1]]
    admitted = [
        r["op"] == "allocate_slots" and r.get("ok") is not None
        for r in run.records[: exc.index + 1]
    ]
    deadline = time.monotonic() + budget_s
    chunk = max(1, len(records) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        changed = False
        i = 0
        while i < len(records) and time.monotonic() < deadline:
            candidate = records[:i] + records[i + chunk :]
            candidate_raised = raised[:i] + raised[i + chunk :]
            candidate_admitted = admitted[:i] + admitted[i + chunk :]
            if not scheduler_could_make(candidate, candidate_admitted):
                i += chunk
                continue
            valid, exc, _ = replay_lockstep(
                config, candidate, subject, reference, candidate_raised, hash_seed, make_run
            )
            if valid and exc is not None and same_failure(exc, original):
                records = candidate[: exc.index + 1]
                raised = candidate_raised[: exc.index + 1]
                admitted = candidate_admitted[: exc.index + 1]
                changed = True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return records


def record_reference(
    config: ManagerConfig,
    calls: Sequence[Call],
    reference: str = "vllm",
    hash_seed: str = "0",
    make_run: Callable[..., Lockstep] = Lockstep,
    **extra: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``calls`` on the reference alone; returns (trace header, records with states)."""
    run = make_run(config, None, reference, hash_seed)
    for op, args in calls:
        run.call(op, **args)
    return run.header(**extra), run.records


def write_counterexample(
    result: SequenceResult,
    subject: str,
    reference: str,
    path: Path,
    shrink_budget_s: float = 60.0,
    make_run: Callable[..., Lockstep] = Lockstep,
    **extra: Any,
) -> tuple[Path, int]:
    """Shrink a mismatching sequence and write it as a replayable trace.

    Returns the path and the number of calls kept.
    """
    assert result.mismatch is not None
    calls: list[Call] = []
    if result.run is not None:
        calls = [(r["op"], r["args"]) for r in result.run.records]
    hash_seed = result.run.hash_seed if result.run is not None else "0"
    small = shrink(result.config, calls, subject, reference, hash_seed, shrink_budget_s, make_run)
    header, records = record_reference(
        result.config, small, reference, hash_seed, make_run,
        source=f"random sequence: family {result.family}, seed {result.seed}, shrunk",
        note=f"{subject} diverges from {reference} at the last call",
        **extra,
    )
    write_trace(path, header, records)
    return path, len(records)


def describe_call(index: int, record: Mapping[str, Any]) -> str:
    args = ", ".join(f"{k}={short(v, 120)}" for k, v in record["args"].items())
    result = f"raises {record['raises']}" if "raises" in record else short(record.get("ok"), 160)
    return f"  #{index:<4} {record['op']}({args}) -> {result}"


def describe_calls(calls: Sequence[Mapping[str, Any]], first_index: int = 0) -> str:
    """A trace's calls as a readable program, one line each."""
    return "\n".join(describe_call(first_index + i, r) for i, r in enumerate(calls))


@dataclass
class ReplayResult:
    """A replay: the first divergence (or None), how far it got, what it compared.

    ``known`` counts the calls where a ledger normaliser made the sides agree;
    ``mismatch.known`` names the entry that recognised the stopping difference
    (``fixed``: the trace marks that record as a known bug of its release, which
    the replayed one fixed); ``cannot_build`` says why the manager could not be
    built (``cannot_build_known``: the ledger entry that explains it).
    """

    mismatch: Mismatch | None
    num_replayed: int
    states_compared: bool
    known: Counter[str] = field(default_factory=Counter)
    cannot_build: str | None = None
    cannot_build_known: str | None = None
    fixed: bool = False

    @property
    def verdict(self) -> str:
        """identical | known | cannot-build | divergence."""
        if self.cannot_build is not None:
            return "known" if self.cannot_build_known else "cannot-build"
        if self.mismatch is not None:
            return "known" if self.mismatch.known else "divergence"
        return "known" if self.known else "identical"


def trace_line(trace: Trace) -> str:
    """The release line whose behaviour a trace records (kvcache and spec: 0.25)."""
    info = trace.header.get("recorded_with") or {}
    if info.get("impl") == "vllm":
        return release_line_of(info.get("version"))
    return (
        release_line_of(trace.header.get("behaves_like"))
        if trace.header.get("behaves_like")
        else REFERENCE_LINE
    )


def replay_trace(trace: Trace, impl: str, side: Side | None = None) -> ReplayResult:
    """Replay a trace on ``impl`` alone, comparing with the recorded outcomes and
    states; stops at the first divergence the ledger does not normalise away.

    ``side``: a side to replay on instead of building ``impl``'s (for instance
    another recorded trace played back, ``releases.RecordedSide``).
    """
    if side is None:
        try:
            side = make_side(impl, trace.config, trace.hash_seed)
        except CannotBuild as exc:
            entry = cannot_build_entry(trace.config, exc, impl)
            return ReplayResult(None, 0, False, cannot_build=str(exc), cannot_build_known=entry)
    judge = make_judge(trace.config, trace_line(trace), side_line(side))
    result = ReplayResult(None, 0, False)

    def stop(mismatch: Mismatch, index: int, record: Mapping[str, Any]) -> ReplayResult:
        marked = tuple(record.get("known") or ())
        if marked and judge is not None:  # the trace marks a known bug of its release
            applicable = {e.id for e in judge.entries}
            fixed = tuple(m for m in marked if m in applicable)
            if fixed:  # keep what the judge named beside the mark (two causes in one call)
                mismatch.known = tuple(dict.fromkeys((*fixed, *mismatch.known)))
                result.fixed = True
        result.mismatch, result.num_replayed = mismatch, index
        return result

    for index, record in enumerate(trace.records):
        op, args = record["op"], record["args"]
        expected: dict[str, Any] = {k: record[k] for k in ("ok", "raises") if k in record}
        try:
            actual = outcome(side, op, args)
        except HarnessError as exc:
            return stop(
                Mismatch(index, op, args, f"the trace cannot be replayed: {exc}"), index, record
            )
        if judge is not None:
            judge.observe(op, args, expected, actual)
        ok, note = compare_outcomes(expected, actual)
        if not ok and judge is not None:
            judgement = judge.outcome(
                op, args, expected, actual, lambda e, a: compare_outcomes(e, a)[0]
            )
            if judgement.ok:
                result.known.update(judgement.known)
                ok = True
            else:
                mismatch = Mismatch(
                    index,
                    op,
                    args,
                    note,
                    record.get("state"),
                    side.state(),
                    known=judgement.known,
                    part=outcome_part(expected, actual),
                )
                return stop(mismatch, index, record)
        if not ok:
            mismatch = Mismatch(
                index,
                op,
                args,
                note,
                record.get("state"),
                side.state(),
                part=outcome_part(expected, actual),
            )
            return stop(mismatch, index, record)
        if "state" not in record:
            continue
        # The checks Lockstep.check_state makes, against the recorded state.
        observed = side.state()
        diff: list[str] = []
        known: tuple[str, ...] = ()
        if observed is not None:
            result.states_compared = True
            diff = state_diff(record["state"], observed)
            if diff and judge is not None:
                judgement, diff = judge.state(op, record["state"], observed)
                if judgement.ok:
                    result.known.update(judgement.known)
                known = () if judgement.ok else judgement.known
        free_queue = record["state"].get("free_queue")
        if isinstance(free_queue, list) and len(free_queue) != side.num_free_blocks():
            diff.append(
                f"  get_num_free_blocks(): expected {len(free_queue)}, got {side.num_free_blocks()}"
            )
        if not diff:
            broken = side.check_invariants()
            if broken:
                diff.append("  " + broken)
        if diff:
            mismatch = Mismatch(
                index,
                op,
                args,
                "state differs after the call:\n" + "\n".join(diff),
                record["state"],
                observed,
                known=known,
                part=state_part(diff),
            )
            return stop(mismatch, index, record)
    result.num_replayed = len(trace.records)
    return result
