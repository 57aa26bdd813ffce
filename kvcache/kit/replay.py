"""Replaying a stored trace on one implementation (``python -m kvcache replay``).

``replay_trace`` compares each call's outcome and state with the recorded ones and
stops at the first divergence the ledger does not normalise away. Part of
``kvcache.kit.driver``, which re-exports every name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcache.kit.explain import Explainer, explain_outcome, explain_state, profile_release
from kvcache.kit.ledger import REFERENCE_LINE, Judgement, release_line_of
from kvcache.kit.lockstep import (
    Mismatch,
    compare_outcomes,
    explainable_release,
    make_judge,
    outcome,
    outcome_part,
    side_line,
    state_part,
)
from kvcache.kit.shrinking import cannot_build_entry
from kvcache.kit.sides import CannotBuild, HarnessError, Side, make_side
from kvcache.kit.trace import Trace, state_diff


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
    explainer = None
    if judge is not None:
        info = trace.header.get("recorded_with") or {}
        recorded = info.get("version") if info.get("impl") == "vllm" else None
        # A trace kvcache recorded is not explained by kvcache (it would explain itself).
        newer = explainable_release(side) if judge.old_is_expected else profile_release(recorded)
        explainer = Explainer(trace.config, trace.hash_seed, newer) if newer else None
    calls: list[tuple[str, Mapping[str, Any]]] = []
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
        calls.append((op, args))
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
                if not judgement.known:
                    judgement = Judgement(
                        False, explain_outcome(explainer, judge, calls, expected, actual)
                    )
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
                if diff and not known:
                    known = explain_state(explainer, judge, calls, record["state"], observed)
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
