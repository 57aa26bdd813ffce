"""Conformance levels: how much of a subject's behaviour must match the reference.

``--compare LEVEL`` (``fuzz``, ``replay``) picks one; each promises what the level
below promises and more (docs/protocol.md):

* ``admission`` — the same calls succeed and fail: every call raises exactly when the
  reference's does, ``allocate_slots`` returns no blocks (None) exactly when the
  reference's does, and the number of free blocks agrees after every call;
* ``hits`` — and every prefix lookup hits as many tokens (``num_computed_tokens``);
* ``sharing`` — and the same blocks are shared by the same requests: block ids are
  compared up to one renaming, a bijection between the subject's ids and the
  reference's, built as ids first meet and kept for the whole sequence (so a block
  reused after a free, or a hit on a cached one, must be the same block on both);
* ``exact`` — everything, as before levels existed: results (block ids, hashes,
  events, stats, usage), exception types, the abstract state and free counts after
  every call, through the known-differences ledger across release lines.

A ``Trial`` is a level and the subject's declared features (``kvcache.kit.features``);
``Trial.lockstep`` builds the lockstep the driver's functions take as ``make_run``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.kit import features as feat
from kvcache.kit.config import ManagerConfig
from kvcache.kit.driver import (
    Lockstep,
    Mismatch,
    ReplayResult,
    Stats,
    outcome,
    replay_trace,
)
from kvcache.kit.sides import CannotBuild, HarnessError, Side, make_side
from kvcache.kit.trace import Trace, canon_state, short

LEVELS = feat.LEVELS

#: Results that are block ids per group (a list per group), by op.
BLOCK_TABLE_OPS = ("allocate_slots", "get_block_ids", "get_blocks",
                   "get_block_ids_for_computed_tokens")
LOOKUPS = ("get_computed_blocks", "get_computed_blocks_for_connector")


def check_level(level: str, what: str = "--compare") -> str:
    """``level`` if it is one of ``LEVELS``.

    Raises:
        ValueError: another value, named with ``what``.
    """
    if level not in LEVELS:
        raise ValueError(f"{what}={level!r}: choose from {', '.join(LEVELS)}")
    return level


def _groups(value: Any) -> list[Any] | None:
    """Block ids per group out of a canonical result (``{"tuple": [...]}`` or a list)."""
    if isinstance(value, dict) and set(value) == {"tuple"}:
        value = value["tuple"]
    return value if isinstance(value, list) else None


class Renaming:
    """One bijection between the reference's block ids and the subject's, kept for
    a whole sequence: a pair of ids is bound where it first meets."""

    def __init__(self) -> None:
        self.forward: dict[Any, Any] = {}
        self.backward: dict[Any, Any] = {}

    def observe(self, expected: Any, actual: Any) -> None:
        """Bind ids as they meet, the latest pair winning (levels below ``sharing``
        keep a renaming only to translate the ids a call names)."""
        if isinstance(expected, list) and isinstance(actual, list):
            for e, a in zip(expected, actual, strict=False):
                self.observe(e, a)
        elif isinstance(expected, int) and isinstance(actual, int):
            self.backward.pop(self.forward.get(expected), None)
            self.forward.pop(self.backward.get(actual), None)
            self.forward[expected], self.backward[actual] = actual, expected

    def translate(self, block_ids: Any, num_blocks: int) -> Any:
        """The subject's names for reference ids a call names (``evict_blocks``): the
        bound one; for an unbound id in ``range(num_blocks)`` the same id when the
        subject's is unbound too, else the lowest unbound one; others as they are."""
        if not isinstance(block_ids, list):
            return block_ids
        out: list[Any] = []
        for block in block_ids:
            if block in self.forward:
                out.append(self.forward[block])
            elif isinstance(block, int) and 0 <= block < num_blocks:
                spares = (b for b in [block, *range(num_blocks)]
                          if b not in self.backward and b not in out)
                out.append(next(spares, block))
            else:
                out.append(block)
        return out

    def match(self, expected: Any, actual: Any, path: str) -> tuple[str, str]:
        """Bind or check ids (or nested lists of them): ``("", "")`` when consistent,
        else (why, how: ``longer`` / ``shorter`` / ``renamed`` / ``value``)."""
        if isinstance(expected, list) and isinstance(actual, list):
            if len(expected) != len(actual):
                how = "longer" if len(actual) > len(expected) else "shorter"
                return f"{path}: {len(expected)} blocks expected, got {len(actual)}", how
            for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
                why = self.match(e, a, f"{path}[{i}]")
                if why[0]:
                    return why
            return "", ""
        if not isinstance(expected, int) or not isinstance(actual, int):
            if expected == actual:
                return "", ""
            return f"{path}: expected {expected!r}, got {actual!r}", "value"
        bound = self.forward.get(expected)
        if bound is None and actual not in self.backward:
            self.forward[expected], self.backward[actual] = actual, expected
            return "", ""
        if bound == actual:
            return "", ""
        if bound is None:
            return (f"{path}: the subject's block {actual} stands for reference block "
                    f"{self.backward[actual]}, here for {expected}"), "renamed"
        return f"{path}: reference block {expected} is the subject's {bound}, here {actual}", \
            "renamed"


class LevelComparer:
    """Compares outcomes at one level below ``exact``; one per lockstep or replay
    (its ``Renaming`` spans the sequence)."""

    def __init__(self, level: str, num_blocks: int) -> None:
        self.level = check_level(level)
        self.num_blocks = num_blocks
        self.rank = LEVELS.index(level)
        self.renaming = Renaming()

    def compare(self, op: str, expected: Mapping[str, Any], actual: Mapping[str, Any]
                ) -> tuple[str, str]:
        """``("", "")`` when the outcomes agree at this level, else (detail, way)."""
        if ("raises" in expected) != ("raises" in actual):
            e = f"raises {expected['raises']}" if "raises" in expected else "result"
            a = f"raises {actual['raises']}: {actual.get('message')}" if "raises" in actual \
                else f"result {short(actual.get('ok'), 200)}"
            return f"expected {e}, got {a}", "raises " + ("missing" if "raises" in expected
                                                          else "extra")
        if "raises" in expected:
            return "", ""
        e_ok, a_ok = expected.get("ok"), actual.get("ok")
        if op == "allocate_slots" and (e_ok is None) != (a_ok is None):
            got = "no blocks (None)" if a_ok is None else f"blocks {short(a_ok, 200)}"
            want = "no blocks (None)" if e_ok is None else f"blocks {short(e_ok, 200)}"
            return f"expected {want}, got {got}", "result: " + (
                "none" if a_ok is None else "allocated")
        if op == "get_num_free_blocks" and e_ok != a_ok:
            return f"expected {e_ok} free blocks, got {a_ok}", "result: free blocks"
        if op in LOOKUPS and self.rank >= LEVELS.index("hits"):
            e_hit, a_hit = _hit(e_ok), _hit(a_ok)
            if e_hit != a_hit:
                how = "greater" if (a_hit or 0) > (e_hit or 0) else "less"
                return (f"expected a hit of {e_hit} tokens, got {a_hit}",
                        f"result.num_computed_tokens: {how}")
        ids: tuple[Any, Any] | None = None
        if op in LOOKUPS and isinstance(e_ok, dict) and isinstance(a_ok, dict):
            ids = _groups(e_ok.get("block_ids")), _groups(a_ok.get("block_ids"))
        elif op in BLOCK_TABLE_OPS and e_ok is not None:
            ids = _groups(e_ok), _groups(a_ok)
        elif op == "pop_blocks_for_free":
            ids = e_ok, a_ok
        if ids is not None and self.rank < LEVELS.index("sharing"):
            self.renaming.observe(*ids)
        elif ids is not None:
            why, how = self.renaming.match(ids[0], ids[1], "block ids")
            if why:
                return (f"{why} (ids compared up to one renaming kept for the sequence): "
                        f"expected {short(e_ok, 200)}, got {short(a_ok, 200)}",
                        "sharing: " + how)
        return "", ""

    def subject_args(self, op: str, args: Mapping[str, Any]) -> Mapping[str, Any]:
        """The arguments as the subject names things: ``evict_blocks``'s ids renamed."""
        if op == "evict_blocks" and "block_ids" in args:
            ids = self.renaming.translate(list(args["block_ids"]), self.num_blocks)
            return {**args, "block_ids": ids}
        return args


def _hit(result: Any) -> int | None:
    return result.get("num_computed_tokens") if isinstance(result, dict) else None


@dataclass(frozen=True)
class Trial:
    """What a run compares (``level``) and draws (``features``)."""

    level: str = "exact"
    features: frozenset[str] = feat.ALL_FEATURES

    def __post_init__(self) -> None:
        check_level(self.level)
        feat.check_features(self.features, "features")

    @property
    def plain(self) -> bool:
        """Today's comparison and draws: the driver's own ``Lockstep`` does it."""
        return self.level == "exact" and self.features >= feat.ALL_FEATURES

    def lockstep(
        self,
        config: ManagerConfig,
        subject: str | None,
        reference: str = "vllm",
        hash_seed: str = "0",
        stats: Stats | None = None,
        record_state: bool = True,
    ) -> Lockstep:
        """A lockstep for this trial (``make_run`` of the driver's functions)."""
        if self.plain:
            return Lockstep(config, subject, reference, hash_seed, stats, record_state)
        return TrialLockstep(self, config, subject, reference, hash_seed, stats, record_state)

    def header(self) -> dict[str, Any]:
        """Trace header keys saying how a counterexample was judged (``replay`` reads
        ``compare`` as its default level); none for today's comparison and draws."""
        if self.plain:
            return {}
        extra: dict[str, Any] = {"compare": self.level}
        if not self.features >= feat.ALL_FEATURES:
            extra["features"] = sorted(self.features)
        return extra


class TrialLockstep(Lockstep):
    """A lockstep that draws only the trial's features and compares at its level."""

    def __init__(
        self,
        trial: Trial,
        config: ManagerConfig,
        subject: str | None,
        reference: str = "vllm",
        hash_seed: str = "0",
        stats: Stats | None = None,
        record_state: bool = True,
    ) -> None:
        self.trial = trial
        restricted = feat.restrict_config(config, trial.features)
        self.comparer = (
            LevelComparer(trial.level, config.num_blocks) if trial.level != "exact" else None
        )
        self.subject_states = trial.level == "exact"  # below it, no state is compared
        if stats is not None and config.has_eagle and not restricted.has_eagle:
            stats.with_eagle -= 1  # counted before the lockstep (run_sequence)
        super().__init__(restricted, subject, reference, hash_seed, stats, record_state)
        if self.comparer is not None:
            self.judge = None  # the ledger judges exact results only
        for name in feat.config_features(restricted):
            self.stats.events["feature:" + name] += 1

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """One call as the trial's features allow (``features.restrict_call``): made,
        rewritten, or not made at all (the driver then reads a null result)."""
        change = feat.restrict_call(op, args, self.trial.features)
        if change is None:
            self.stats.events["feature-dropped:" + op] += 1
            return {"ok": None}
        op, args = change
        for name in feat.used_features(op, args):
            self.stats.events["feature:" + name] += 1
        if self.comparer is None:
            return super().call(op, **args)
        index = len(self.records)
        expected = outcome(self.reference, op, args)
        record: dict[str, Any] = {"op": op, "args": args, **expected}
        record.pop("message", None)
        self.records.append(record)
        self.stats.calls += 1
        self.observe(op, expected)
        if self.subject is not None:
            actual = outcome(self.subject, op, self.comparer.subject_args(op, args))
            detail, way = self.comparer.compare(op, expected, actual)
            if detail:
                part = "raises" if way.startswith("raises") else "result"
                raise Mismatch(index, op, args, detail, part=part, way=way)
        self.check_state(index, op, args)
        raw = self.reference.raw_state() if self.record_state and op != "add_request" else None
        if raw is not None:
            record["state"] = canon_state(raw)
        return expected

    def raises(self, op: str, **args: Any) -> str:
        """A call the reference must reject: not made without ``rejections``."""
        if "rejections" not in self.trial.features:
            self.stats.events["feature-dropped:rejected " + op] += 1
            return "not made"
        self.stats.events["feature:rejections"] += 1
        return super().raises(op, **args)

    def check_state(
        self, index: int = -1, op: str = "<init>", args: Mapping[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """Below ``exact``: the free block counts alone (every level promises them)."""
        if self.comparer is None:
            return super().check_state(index, op, args)
        if self.subject is not None:
            free_ref, free_sub = self.reference.num_free_blocks(), self.subject.num_free_blocks()
            if free_ref != free_sub:
                how = "greater" if free_sub > free_ref else "less"
                raise Mismatch(
                    index, op, args or {},
                    f"free blocks after the call: expected {free_ref}, got {free_sub}",
                    part="state:free_blocks", way=f"free_blocks: {how}",
                )
        return None


# ---------------------------------------------------------------- replaying traces


def replay_at(trace: Trace, impl: str, trial: Trial) -> tuple[ReplayResult, set[str]]:
    """Replay ``trace`` on ``impl`` as ``trial`` judges; returns the result and the
    features the trace uses that the trial leaves out (then nothing is replayed:
    the trace is out of the subject's scope, not a divergence)."""
    undeclared = feat.trace_features(trace.config, trace.records) - trial.features
    if undeclared:
        return ReplayResult(None, 0, False), undeclared
    if trial.level == "exact":
        return replay_trace(trace, impl), set()
    try:
        side = make_side(impl, trace.config, trace.hash_seed, states=False)
    except CannotBuild as exc:
        return ReplayResult(None, 0, False, cannot_build=str(exc)), set()
    comparer = LevelComparer(trial.level, trace.config.num_blocks)
    return replay_side(trace.records, side, comparer), set()


def replay_side(records: Sequence[Mapping[str, Any]], side: Side, comparer: LevelComparer
                ) -> ReplayResult:
    """Replay recorded calls on ``side``, comparing at ``comparer``'s level: outcomes,
    and free counts where a record holds the reference's state."""
    result = ReplayResult(None, 0, False)
    counts: Counter[str] = Counter()
    for index, record in enumerate(records):
        op, args = record["op"], record["args"]
        expected = {k: record[k] for k in ("ok", "raises") if k in record}
        counts[op] += 1
        try:
            actual = outcome(side, op, comparer.subject_args(op, args))
        except HarnessError as exc:
            result.mismatch = Mismatch(index, op, args, f"the trace cannot be replayed: {exc}")
            result.num_replayed = index
            return result
        detail, way = comparer.compare(op, expected, actual)
        state = record.get("state")
        if not detail and isinstance(state, dict) and isinstance(state.get("free_queue"), list):
            free_ref, free_sub = len(state["free_queue"]), side.num_free_blocks()
            if free_ref != free_sub:
                detail = f"free blocks after the call: expected {free_ref}, got {free_sub}"
                way = "free_blocks: " + ("greater" if free_sub > free_ref else "less")
        if detail:
            part = "state:free_blocks" if way.startswith("free") else "result"
            result.mismatch = Mismatch(index, op, args, detail, state, side.state(),
                                       part=part, way=way)
            result.num_replayed = index
            return result
    result.num_replayed = len(records)
    return result


# ---------------------------------------------------------------- the CLI's view


def trial_for(
    impl: str,
    compare: str | None,
    features: frozenset[str] | None,
    header: Mapping[str, Any] | None = None,
) -> Trial:
    """The trial of a command: ``--compare`` (else a trace header's ``compare``, else
    ``exact``) and ``--features`` (else what ``impl`` declares, else every feature).

    Raises:
        ValueError: an unknown level in the header, or a declaration naming an
            unknown feature.
    """
    from kvcache.kit.sides import resolve_adapter

    level = compare or (header or {}).get("compare") or "exact"
    check_level(str(level), "the trace header's compare" if compare is None else "--compare")
    if features is None:
        features = feat.declared_features(resolve_adapter(impl), f"--impl {impl} declares")
    return Trial(str(level), features)


def trial_lines(outcome: Any) -> list[str]:
    """A fuzz run's level, features and families, for its report (``FuzzOutcome``)."""
    trial: Trial = outcome.trial
    lines = [f"compared at level {trial.level}"]
    if not trial.features >= feat.ALL_FEATURES:
        lines.append(f"declared features: {', '.join(sorted(trial.features))}")
    exercised = outcome.features_exercised
    lines.append("features exercised: " + (
        ", ".join(f"{k} x{n}" for k, n in sorted(exercised.items())) or "core calls only"))
    left = sorted(trial.features - set(exercised) - set(feat.KIND_FEATURES))
    if left:
        lines.append(f"declared but not exercised: {', '.join(left)}")
    if outcome.undeclared:
        lines.append(
            f"families not run (they need an undeclared feature): {', '.join(outcome.undeclared)}"
        )
    return lines
