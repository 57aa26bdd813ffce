"""Census findings: differences grouped by root cause, each with its shortest trace.

A census (``kvcache.kit.fuzz.fuzz(census=True)``) meets the same bug in many random
sequences, and the call and part of the first difference (``allocate_slots/result``)
lumps different bugs together. A *finding* is one root cause:

* its **signature**: the first differing call and field and how it differs
  (``Mismatch.op``, ``part`` and ``way``, the same key the shrinker keeps with
  ``driver.same_failure``), for example ``get_computed_blocks/result
  result.num_computed_tokens: less``;
* its **shape**: the kinds of call its shrunk trace makes (``add_request,
  get_computed_blocks``), which separates two causes that end in the same field;
  a shrunk trace whose kinds include another's joins it (the same cause met through
  more kinds of call), so only kinds neither of which contains the other split a
  signature;
* its **shortest trace**, written to the census folder, which replays to the same
  failure, and the **count** of sequences whose first difference it is.

Only differences no ledger entry explains become findings: a known one already has
its cause, the ledger entry, and is tallied under it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.kit.driver import (
    Call,
    Lockstep,
    Mismatch,
    SequenceResult,
    record_reference,
    replay_lockstep,
    shrink,
)
from kvcache.kit.trace import read_trace, write_trace

#: Sequences per signature shrunk by default: the shortest first; more can split a
#: signature into findings of different shapes, each shrink costs up to its budget.
SHRINKS_PER_SIGNATURE = 2


def signature(mismatch: Mismatch) -> str:
    """The root-cause key of a difference: ``op/part way`` (what ``same_failure``
    compares, less the ledger entry, which findings never have)."""
    return f"{mismatch.kind} {mismatch.way}".rstrip()


def shape_of(calls: Sequence[Call]) -> tuple[str, ...]:
    """The call kinds of ``calls`` in order of first appearance: a trace's shape,
    indifferent to how many times a kind repeats."""
    return tuple(dict.fromkeys(op for op, _ in calls))


@dataclass
class Finding:
    """One root cause: its signature and shape, its shortest trace, its count."""

    signature: str
    shape: tuple[str, ...]
    #: Sequences whose first difference is this finding (see ``find``).
    sequences: int = 0
    #: The shortest trace written for it, and its number of calls.
    path: Path | None = None
    calls: int = 0
    #: Seeds of the sequences shrunk into it (the first is the trace's).
    seeds: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        """``signature [shape]``: how reports name it."""
        return f"{self.signature} [{', '.join(self.shape)}]"

    def line(self) -> str:
        """One report line: count, key, trace."""
        where = f"  {self.path} ({self.calls} calls)" if self.path is not None else ""
        return f"{self.sequences:>6}  {self.key}{where}"


@dataclass
class FindingsCollector:
    """Gathers a census's unknown differences by signature, then shrinks the shortest
    few of each into findings (``find``)."""

    #: Per signature, every sequence met (in run order).
    by_signature: dict[str, list[SequenceResult]] = field(default_factory=dict)

    def add(self, sequence: SequenceResult) -> None:
        """Count ``sequence`` if its first difference is one no ledger entry explains."""
        if sequence.mismatch is None or sequence.mismatch.known or sequence.run is None:
            return
        self.by_signature.setdefault(signature(sequence.mismatch), []).append(sequence)

    def find(
        self,
        subject: str,
        reference: str,
        folder: Path,
        shrink_s: float,
        make_run: Callable[..., Lockstep] = Lockstep,
        per_signature: int = SHRINKS_PER_SIGNATURE,
        **extra: object,
    ) -> list[Finding]:
        """Shrink up to ``per_signature`` sequences of each signature (those whose first
        difference came soonest), group the shrunk traces by shape (``_group_by_kinds``), write each
        finding's shortest trace to ``folder``; the sequences not shrunk count with
        their signature's first finding. Most frequent first.

        Raises:
            ValueError: ``per_signature`` below 1 or ``shrink_s`` not positive.
        """
        if per_signature < 1:
            raise ValueError(f"per_signature={per_signature}: shrink at least one sequence")
        if not shrink_s > 0:
            raise ValueError(f"shrink_s={shrink_s}: give a positive shrinking budget")
        folder.mkdir(parents=True, exist_ok=True)
        findings: list[Finding] = []
        for number, (sig, sequences) in enumerate(sorted(self.by_signature.items()), 1):
            soonest = sorted(sequences, key=_first_index)[:per_signature]
            shrunk = [
                (sequence, *_shrunk(sequence, subject, reference, shrink_s, make_run))
                for sequence in soonest
            ]
            groups = _group_by_kinds([calls for _, calls, _ in shrunk])
            mine: list[Finding] = []
            for index, members in enumerate(groups, 1):
                best = min(members, key=lambda m: len(shrunk[m][1]))
                sequence, calls, hash_seed = shrunk[best]
                finding = Finding(sig, shape_of(calls), sequences=len(members))
                finding.seeds = [shrunk[m][0].seed for m in members]
                _write(finding, sequence, calls, hash_seed, subject, reference,
                       folder, f"finding{number}", index, make_run, extra)  # fmt: skip
                mine.append(finding)
            mine[0].sequences += len(sequences) - len(soonest)
            findings += mine
        return sorted(findings, key=lambda f: (-f.sequences, f.key))


def _group_by_kinds(traces: Sequence[Sequence[Call]]) -> list[list[int]]:
    """Indices of ``traces`` grouped by their sets of call kinds, a set that contains
    another's joining the smaller (the same cause, met with more kinds of calls):
    only kinds neither of which contains the other tell causes apart. The group of
    the first trace comes first."""
    kinds = [frozenset(shape_of(calls)) for calls in traces]
    roots = sorted(set(kinds), key=len)
    minimal = [k for i, k in enumerate(roots) if not any(r < k for r in roots[:i])]
    groups: dict[frozenset[str], list[int]] = {}
    for i, k in enumerate(kinds):
        home = next(m for m in minimal if m <= k)
        groups.setdefault(home, []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def _first_index(sequence: SequenceResult) -> int:
    assert sequence.mismatch is not None
    return sequence.mismatch.index


def _shrunk(
    sequence: SequenceResult,
    subject: str,
    reference: str,
    shrink_s: float,
    make_run: Callable[..., Lockstep],
) -> tuple[list[Call], str]:
    """The sequence's calls shrunk to the same failure, and its hash seed."""
    assert sequence.run is not None
    calls: list[Call] = [(r["op"], r["args"]) for r in sequence.run.records]
    hash_seed = sequence.run.hash_seed
    small = shrink(sequence.config, calls, subject, reference, hash_seed, shrink_s, make_run)
    return small, hash_seed


def _write(
    finding: Finding,
    sequence: SequenceResult,
    calls: list[Call],
    hash_seed: str,
    subject: str,
    reference: str,
    folder: Path,
    stem: str,
    index: int,
    make_run: Callable[..., Lockstep],
    extra: dict[str, object],
) -> None:
    """Write ``calls`` as the finding's trace (``<stem>[_<index>]_<op>.jsonl``)."""
    op = re.sub(r"[^A-Za-z0-9_.-]+", "_", finding.signature.split("/", 1)[0])
    suffix = "" if index == 1 else f"_{index}"
    path = folder / f"{stem}{suffix}_{op}.jsonl"
    header, records = record_reference(
        sequence.config, calls, reference, hash_seed, make_run,
        source=f"random sequence: family {sequence.family}, seed {sequence.seed}, shrunk",
        note=f"{subject} diverges from {reference} at the last call",
        kind=finding.signature.split(" ", 1)[0], finding=finding.key, **extra,
    )  # fmt: skip
    write_trace(path, header, records)
    finding.path, finding.calls = path, len(records)


def reproduces(
    finding: Finding,
    subject: str,
    reference: str,
    make_run: Callable[..., Lockstep] = Lockstep,
) -> bool:
    """Whether ``finding``'s trace, replayed in lockstep on ``subject`` and
    ``reference``, fails with the finding's signature at its last call: the check
    that a trace written for a finding is a counterexample of it.

    Raises:
        ValueError: the finding has no trace.
    """
    if finding.path is None:
        raise ValueError(f"finding {finding.key!r} has no trace to replay")
    trace = read_trace(finding.path)
    calls: list[Call] = [(r["op"], r["args"]) for r in trace.records]
    valid, mismatch, _ = replay_lockstep(
        trace.config, calls, subject, reference, [True] * len(calls), trace.hash_seed, make_run
    )
    return (
        valid
        and mismatch is not None
        and signature(mismatch) == finding.signature
        and mismatch.index == len(calls) - 1
    )
