"""Fuzz an implementation against a reference with random scheduler sequences.

Each sequence draws a config from one layout family (``driver.FAMILIES``:
full attention, sliding window, chunked local, Mamba, cross attention and their
hybrids, EAGLE on and off) and runs ``driver.RandomScheduler`` in lockstep on
the reference (``spec`` by default, or ``vllm``) and the subject. The first
divergence is shrunk (delta debugging over the calls) and written as a trace
that ``python -m kvcache replay`` reproduces.

Across vLLM release lines the ledger (``kvcache.kit.ledger``) judges each
difference: a known one is counted and the run goes on; a config a side cannot
build is counted as "cannot build", never a divergence. ``census=True`` does not
stop at an unknown divergence either: it tallies every sequence's first
difference by kind (``op/part``) and by ledger entry, and writes one shrunk
counterexample per kind; for each ledger normaliser it met, it also writes the
shortest prefix of its first sequence that meets it (``known_<id>.jsonl``), a
minimal replay for the changelog.
"""

from __future__ import annotations

import re
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvcache.kit.driver import (
    FAMILIES,
    Call,
    DriverError,
    Lockstep,
    SequenceResult,
    Stats,
    record_reference,
    replay_lockstep,
    run_sequence,
    write_counterexample,
)
from kvcache.kit.features import families_for
from kvcache.kit.findings import SHRINKS_PER_SIGNATURE, Finding, FindingsCollector
from kvcache.kit.ledger import REFERENCE_LINE, release_line_of
from kvcache.kit.levels import Trial, trial_for
from kvcache.kit.sides import resolve_adapter
from kvcache.kit.trace import write_trace

SEEDS_PER_RUN_SEED = 1_000_000  # sequence i of --seed S has seed S * 1e6 + i


@dataclass
class FuzzOutcome:
    """What a fuzz run did: its counts, and the counterexample if it found one."""

    stats: Stats = field(default_factory=Stats)
    failure: SequenceResult | None = None
    counterexample: Path | None = None
    counterexample_calls: int = 0
    harness_error: str | None = None
    seconds: float = 0.0
    #: First differences by kind: ``known:<ledger id>`` or ``op/part`` (unknown).
    census: Counter[str] = field(default_factory=Counter)
    #: One shrunk counterexample per kind (census), with its number of calls; an
    #: unknown kind's is its most frequent finding's.
    census_examples: dict[str, tuple[Path, int]] = field(default_factory=dict)
    #: Census: for each ledger normaliser met, the shortest prefix of its first
    #: sequence that meets it, written as ``known_<id>.jsonl`` (and its calls).
    normalised_examples: dict[str, tuple[Path, int]] = field(default_factory=dict)
    #: Census: the differences no ledger entry explains, by root cause (first
    #: differing field and how, shape of the shrunk trace), most frequent first.
    findings: list[Finding] = field(default_factory=list)
    #: Why configs could not be built, by reason (first words), and the ledger entry.
    cannot_build: Counter[str] = field(default_factory=Counter)
    #: Families left out before the run, with why (a side's release predates them);
    #: not in ``stats``. Census runs leave none out (their refusals are tallied).
    skipped: dict[str, str] = field(default_factory=dict)
    #: Outside a census: sequences drawn whose config a side refused, by family,
    #: and the first refusal of each family; never run, so not in ``stats``.
    not_built: Counter[str] = field(default_factory=Counter)
    not_built_reasons: dict[str, str] = field(default_factory=dict)
    #: The level and features the run used (``kvcache.kit.levels.Trial``).
    trial: Trial = field(default_factory=Trial)
    #: Families left out because the subject does not declare a feature they need.
    undeclared: list[str] = field(default_factory=list)

    @property
    def features_exercised(self) -> Counter[str]:
        """How often each feature was exercised (calls, or configs for config knobs)."""
        return Counter({
            k.removeprefix("feature:"): n
            for k, n in self.stats.events.items() if k.startswith("feature:")
        })

    @property
    def unknown_kinds(self) -> list[str]:
        """Census kinds no ledger entry explains."""
        return sorted(
            k for k in self.census if not k.startswith("known:") and k != NEWER_FAMILY
        )


class Progress:
    """A one-line progress bar on a terminal; a line every ``every_s`` seconds elsewhere."""

    WIDTH = 24

    def __init__(self, stream: TextIO, total_s: float | None, total_n: int | None) -> None:
        self.stream = stream
        self.total_s = total_s
        self.total_n = total_n
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self.last = 0.0
        self.every_s = 0.25 if self.tty else 10.0

    def fraction(self, done: int) -> float:
        parts = []
        if self.total_s:
            parts.append((time.monotonic() - self.started) / self.total_s)
        if self.total_n:
            parts.append(done / self.total_n)
        return min(1.0, max(parts, default=0.0))

    def update(self, stats: Stats, family: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        filled = int(self.fraction(stats.sequences) * self.WIDTH)
        elapsed = int(now - self.started)
        line = (
            f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {elapsed // 60}:{elapsed % 60:02d} "
            f"{stats.sequences} sequences, {stats.calls} calls, "
            f"{stats.mismatching_sequences} divergences ({family})"
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(100)[:100])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        self.stream.write(("\n" if self.tty else "") + text + "\n")
        self.stream.flush()


#: Implementation names that follow vLLM 0.25.1 (the reference release line).
REFERENCE_LINE_IMPLS = frozenset({"kvcache", "kvcache-pure", "spec"})


def release_line(impl: str) -> str | None:
    """The vLLM release line (``"0.25"``) implementation ``impl`` behaves like, or
    None where the kit cannot tell (a third party's ``module:factory``)."""
    if impl in REFERENCE_LINE_IMPLS:
        return REFERENCE_LINE
    adapter = resolve_adapter(impl)
    line = getattr(adapter, "release_line", None)  # kvcache-0.33, spec-0.33
    if isinstance(line, str) and line:
        return line
    if adapter.name == "vllm":  # the installed release's line
        return release_line_of(adapter.version)
    return None


def _line_key(line: str) -> tuple[int, ...]:
    return tuple(int(part) for part in line.split(".") if part.isdigit())


def skipped_families(
    names: Sequence[str], *impls: str, every_side: bool = False
) -> dict[str, str]:
    """The families of ``names`` a side of ``impls`` cannot build because its release
    line predates the family's (``Family.since``), each with why, briefly; with
    ``every_side``, only those whose family is newer than every side's line."""
    lines = {impl: release_line(impl) for impl in impls}
    skipped = {}
    for name in names:
        since = FAMILIES[name].since
        first = _line_key(release_line_of(since))
        older = sorted({i for i, line in lines.items() if line and _line_key(line) < first})
        if older and (not every_side or len(older) == len(lines)):
            follow = "; ".join(f"{i} follows vLLM {lines[i]}" for i in older)
            skipped[name] = f"added in vLLM {since}; {follow}"
    return skipped


#: The census kind of a refusal of a family newer than both sides' release lines: no
#: difference between them (neither release has it), so not an unknown one.
NEWER_FAMILY = "not-in-either-release"


def brief(reason: str, width: int = 110) -> str:
    """``reason`` on one line, shortened at a word boundary."""
    text = " ".join(reason.removeprefix("cannot build: ").split())
    return textwrap.shorten(text, width=width, placeholder=" ...")


def default_out(subject: str, seed: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", subject)
    return Path(f"counterexample-{safe}-seed{seed}.jsonl")


def census_kind(sequence: SequenceResult) -> str | None:
    """A sequence's first difference as a census kind, or None when it had none."""
    if sequence.cannot_build is not None:
        if sequence.cannot_build_known:
            return "known:" + sequence.cannot_build_known
        return "cannot-build"
    if sequence.mismatch is None:
        return None
    if sequence.mismatch.known:
        return "known:" + ",".join(sequence.mismatch.known)
    return sequence.mismatch.kind


def write_normalised_example(
    sequence: SequenceResult,
    entry_id: str,
    subject: str,
    reference: str,
    path: Path,
    make_run: Callable[..., Lockstep] = Lockstep,
) -> tuple[Path, int] | None:
    """The shortest prefix of ``sequence``'s calls at whose last call the ledger
    normaliser ``entry_id`` makes the sides agree, written as a trace recorded on
    ``reference``; returns its path and number of calls (None: not reproduced)."""
    if sequence.run is None:
        return None
    calls: list[Call] = [(r["op"], r["args"]) for r in sequence.run.records]
    hash_seed = sequence.run.hash_seed

    def meets(n: int) -> bool:
        valid, _, run = replay_lockstep(
            sequence.config, calls[:n], subject, reference, [True] * n, hash_seed, make_run
        )
        return valid and run is not None and run.stats.known[entry_id] > 0

    if not calls or not meets(len(calls)):
        return None
    low, high = 0, len(calls)  # meets(high), not meets(low)
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    header, records = record_reference(
        sequence.config,
        calls[:high],
        reference,
        hash_seed,
        make_run,
        source=f"random sequence: family {sequence.family}, seed {sequence.seed}, "
        f"cut after the first call the ledger normalises as {entry_id}",
        note=f"{subject} differs from {reference} at the last call; the ledger normalises it",
        kind=f"known:{entry_id}",
    )
    write_trace(path, header, records)
    return path, len(records)


def fuzz(
    subject: str,
    reference: str = "spec",
    families: Sequence[str] | None = None,
    seconds: float | None = 60.0,
    max_sequences: int | None = None,
    seed: int = 0,
    out: Path | None = None,
    shrink_s: float = 60.0,
    stream: TextIO | None = None,
    census: bool = False,
    census_dir: Path | None = None,
    trial: Trial | None = None,
    shrinks_per_finding: int = SHRINKS_PER_SIGNATURE,
) -> FuzzOutcome:
    """Run sequences until time or count runs out or the subject diverges.

    Args:
        subject: The implementation under test (an implementation name).
        reference: What it must match: ``spec`` (default) or ``vllm``.
        families: Layout families to cycle through (default: all).
        seconds: Time budget (None: no limit).
        max_sequences: Sequence budget (None: no limit).
        seed: Run seed; sequence ``i`` uses seed ``seed * 1e6 + i``.
        out: Where to write the counterexample (default
            ``counterexample-<subject>-seed<seed>.jsonl``).
        shrink_s: Time budget for shrinking the counterexample (census: per kind).
        stream: Where progress goes (default stderr).
        census: Go on after divergences, tally first differences by kind and
            ledger entry; group the unknown ones into findings
            (``kvcache.kit.findings``), each with its shortest trace; write one shrunk
            counterexample per known kind.
        census_dir: Where the census counterexamples go (default ``census/``).
        trial: The level compared and the features drawn (default: ``exact``, the
            features the subject declares); families needing an undeclared feature are
            left out.
        shrinks_per_finding: Census: sequences shrunk per signature of an unknown
            difference (the soonest first); more may split a signature by shape.
    """
    names = list(families) if families else list(FAMILIES)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise ValueError(
            f"unknown layout famil{'ies' if len(unknown) > 1 else 'y'} {unknown}; "
            f"choose from {', '.join(FAMILIES)}"
        )
    if seconds is None and max_sequences is None:
        raise ValueError("give a time or a sequence budget")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"a time budget of {seconds:g} s runs nothing; give a positive one")
    if max_sequences is not None and max_sequences <= 0:
        raise ValueError(f"{max_sequences} sequences is no run; give a positive number")
    if shrinks_per_finding < 1:
        raise ValueError(
            f"shrinks_per_finding={shrinks_per_finding}: shrink at least one sequence"
        )
    resolve_adapter(subject)  # a bad name is a usage error, not a divergence
    resolve_adapter(reference)
    trial = trial or trial_for(subject, None, None)  # exact, the subject's declaration
    result = FuzzOutcome(trial=trial)
    if not trial.plain:
        runnable = families_for(trial.features, {n: FAMILIES[n] for n in names})
        result.undeclared = [n for n in names if n not in runnable]
        names = runnable
        if not names:
            raise ValueError(
                "no layout family uses only the declared features "
                f"({', '.join(sorted(trial.features))})"
            )
    make_run = trial.lockstep
    if not census:  # a census tallies the refusals: they are what it is for
        result.skipped = skipped_families(names, subject, reference)
        names = [name for name in names if name not in result.skipped]
        if not names:
            raise ValueError(
                "no layout family to run: "
                + "; ".join(f"{n}: {why}" for n, why in result.skipped.items())
            )
    newer = skipped_families(names, subject, reference, every_side=True) if census else {}
    progress = Progress(stream or sys.stderr, seconds, max_sequences)
    deadline = None if seconds is None else time.monotonic() + seconds
    index = 0
    family = names[0]
    firsts: dict[str, SequenceResult] = {}
    normalised: dict[str, SequenceResult] = {}  # census: first sequence per normaliser
    collector = FindingsCollector()
    while True:
        if max_sequences is not None and index >= max_sequences:
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        family = names[index % len(names)]
        sequence_seed = seed * SEEDS_PER_RUN_SEED + index
        known_before = Counter(result.stats.known)
        sequence_stats = Stats()
        try:
            sequence = run_sequence(
                sequence_seed, family, subject, reference, sequence_stats, make_run=make_run
            )
        except DriverError as exc:
            result.harness_error = (
                f"sequence seed {sequence_seed} ({family}): the reference {reference} rejected "
                f"a call the driver expected it to accept: {exc}"
            )
            break
        index += 1
        if census or sequence.cannot_build is None:
            result.stats.add(sequence_stats)  # outside a census, only what ran counts
        else:
            result.not_built[family] += 1
            result.not_built_reasons.setdefault(family, brief(sequence.cannot_build))
        progress.update(result.stats, family)
        if sequence.cannot_build is not None:
            result.cannot_build[f"{family}: {sequence.cannot_build}"[:160]] += 1
        for entry_id, n in result.stats.known.items():
            if census and n > known_before[entry_id] and entry_id not in normalised:
                normalised[entry_id] = sequence
        if census:
            collector.add(sequence)
        kind = census_kind(sequence)
        if kind == "cannot-build" and family in newer:
            kind = NEWER_FAMILY
        if kind is not None:
            result.census[kind] += 1
            if kind not in firsts and sequence.cannot_build is None and not sequence.unknown:
                firsts[kind] = sequence  # an unknown one's example is its finding's
        if not census and sequence.unknown:
            result.failure = sequence
            break
    progress.update(result.stats, family, force=True)
    result.seconds = time.monotonic() - progress.started
    if len(result.cannot_build) and not result.stats.calls:
        result.harness_error = "no config could be built: " + "; ".join(result.cannot_build)
    elif not result.stats.sequences:
        result.harness_error = f"no sequence ran in {result.seconds:.1f} s"
    if census:
        folder = census_dir or Path("census")
        folder.mkdir(parents=True, exist_ok=True)
        result.findings = collector.find(
            subject, reference, folder, shrink_s, make_run, shrinks_per_finding,
            fuzz_seed=seed, **trial.header(),
        )  # fmt: skip
        for finding in result.findings:  # most frequent first
            kind = finding.signature.split(" ", 1)[0]
            if finding.path is not None and kind not in result.census_examples:
                result.census_examples[kind] = (finding.path, finding.calls)
        for kind, first in sorted(firsts.items()):
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", kind)
            path, n = write_counterexample(
                first,
                subject,
                reference,
                folder / f"{safe}.jsonl",
                shrink_s,
                make_run,
                fuzz_seed=seed,
                kind=kind,
                **trial.header(),
            )
            result.census_examples[kind] = (path, n)
        for entry_id, first in sorted(normalised.items()):
            path = folder / f"known_{entry_id}.jsonl"
            if f"known:{entry_id}" in firsts:
                continue  # a stopping example of the same entry is written already
            example = write_normalised_example(
                first, entry_id, subject, reference, path, make_run
            )
            if example is not None:
                result.normalised_examples[entry_id] = example
        return result
    if result.failure is not None:
        failure = result.failure
        progress.message(
            f"{subject} diverges from {reference} (family {failure.family}, "
            f"seed {failure.seed}):\n  {failure.mismatch}\nshrinking (up to {shrink_s:.0f} s)..."
        )
        path = out or default_out(subject, failure.seed)
        result.counterexample, result.counterexample_calls = write_counterexample(
            failure, subject, reference, path, shrink_s, make_run, fuzz_seed=seed, **trial.header()
        )
    return result
