"""Lockstep comparison: every call sent to a reference and a subject, compared.

``outcome`` runs one call on a side; ``compare_outcomes``, ``outcome_way`` and
``state_way`` say whether and how two outcomes or states differ; ``Mismatch`` is a
difference (call, part, way, ledger entry); ``Stats`` counts a run; ``Lockstep``
sends every call to the reference (vLLM 0.25.1, or the ``spec`` oracle) and to the
subject, compares results, exceptions and the abstract state after each call, and
records the reference's view as a trace. Part of ``kvcache.kit.driver``, which
re-exports every name.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache.kit.config import ManagerConfig
from kvcache.kit.explain import Explainer, explain_outcome, explain_state, profile_release
from kvcache.kit.ledger import REFERENCE_LINE, Judge, Judgement, release_line_of
from kvcache.kit.sides import HarnessError, Side, make_side
from kvcache.kit.trace import canon_state, make_header, results_equal, short, state_diff

Outcome = dict[str, Any]

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
#: The prefix lookups a scheduler makes for a waiting request: the plain one, and
#: (0.33 line) the one for a KV connector that takes divergent hybrid hits.
LOOKUP_OPS = ("get_computed_blocks", "get_computed_blocks_for_connector")


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


def side_release(side: Side) -> str | None:
    """The release whose profile a side behaves like: the installed vLLM's version, a
    profile adapter's line's newest release, None for the 0.25.1 line's sides."""
    if side.adapter.name == "vllm":
        return profile_release(side.adapter.version)
    line: str | None = getattr(side.adapter, "release_line", None)
    return profile_release(line) if line else None


def explainable_release(side: Side) -> str | None:
    """``side_release`` for a side whose differences kvcache may explain
    (``kvcache.kit.explain``); None for kvcache's and the spec's own sides, which
    kvcache replaying itself would explain whatever they do, bugs included."""
    if side.adapter.name.startswith(("kvcache", "spec")):
        return None
    return side_release(side)


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

    #: Whether the subject's abstract states are read (a level below ``exact`` sets it
    #: False before building the sides, so a process subject is not asked for them).
    subject_states: bool = True

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
        self.explainer: Explainer | None = None
        if subject is not None:  # CannotBuild propagates: not a divergence
            self.subject = make_side(subject, config, hash_seed, self.subject_states)
            self.judge = make_judge(config, side_line(self.reference), side_line(self.subject))
            newer = self.subject if self.judge and self.judge.old_is_expected else self.reference
            release = explainable_release(newer) if self.judge is not None else None
            if release is not None:
                self.explainer = Explainer(config, hash_seed, release)

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
                if not judgement.ok and not judgement.known:
                    explained = explain_outcome(
                        self.explainer, self.judge, self._calls(), expected, actual
                    )
                    judgement = Judgement(False, explained)
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

    def _calls(self) -> list[tuple[str, Mapping[str, Any]]]:
        return [(r["op"], r["args"]) for r in self.records]

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
                    if diff and not known:
                        known = explain_state(
                            self.explainer, self.judge, self._calls(), expected, observed
                        )
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
