"""Conformance of kvcache's profile of a vLLM release against that release itself
(``--release``, default the installed vLLM's; ``make conformance-0.33`` for 0.33.0).

The releases kvcache has a profile and a drop-in module for are ``TARGETS`` (today
0.33.0: ``kvcache.vllm_0_33``, ``Profile("0.33.0")``). The same seeded random
scheduler sequences as the 0.25.1 conformance tests
(``tests/conformance/test_conformance.py``; ``kvcache.kit.driver``) run in lockstep
on the installed vLLM (the reference) and on the release's subject (``kvcache-0.33``,
or ``spec-0.33``: the spec under the profile). Both sides are of the same release
line, so no ledger entry normalises anything: results, exceptions, events, stats,
block hashes and the abstract state must be equal after every call.

Run it with the release importable (``.venv-0.33``, ``make reference-0.33``)::

    .venv-0.33/bin/python -m kvcache.kit.conformance --release 0.33.0 --sequences 100

It prints one ``conformance: ...`` line per family and a ``conformance-0.33:``
total (``conformance-<line>``), lists the families the release cannot build
(``Target.not_in``: not run, and said so), and exits 1 on any mismatch, writing the
first one's shrunk counterexample under ``build/conformance-0.33-failures/``.

First the kit's own statement of the fine-grained-hit rule (which the driver and
the ledger use) is checked against vLLM 0.33.0's decision on random layouts
(``kvcache.kit.fine_grained_check``; ``--rule-layouts``), and the examples of
docs/divergences.md's "vLLM 0.33.0: matched although doubtful" run on both sides
(``kvcache.kit.doubts``; ``--no-doubts`` skips them).

Then the release's own ``Scheduler`` runs the streams of
``kvcache.kit.scheduler_drive`` with the drop-in's ``KVCacheManager`` swapped in,
and must decide every step exactly as on vLLM's own manager (one ``vllm scheduler
on kvcache [...]: ... identical`` line per stream).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcache.kit.doubts import drop_in_module
from kvcache.kit.driver import FAMILIES, Family, SequenceResult, Stats, run_sequence

#: Set to 1 (``make conformance-0.33-compiled``): refuse to run on kvcache's pure build.
EXPECT_COMPILED_ENV = "KVCACHE_EXPECT_COMPILED"
REFERENCE = "vllm"


@dataclasses.dataclass(frozen=True)
class Target:
    """A vLLM release kvcache has a profile of, as this runner checks it."""

    #: The release (``0.33.0``): the installed vLLM must be it.
    version: str
    #: The sides checked against it: kvcache under its profile, the spec under it.
    subject: str
    spec_subject: str
    #: Layout families of ``kvcache.kit.driver.FAMILIES`` the release cannot build
    #: (their spec classes are gone), with why. Every other family runs
    #: (``conformant_families``); configs it cannot build must be refused by both
    #: sides (``both_refuse``).
    not_in: dict[str, str]
    #: Mamba modes the release builds only with caching off.
    caching_off_mamba_kinds: frozenset[str] = frozenset()
    #: Whether docs/divergences.md has a "matched although doubtful" section for it.
    doubts: bool = False

    @property
    def line(self) -> str:
        """The release line, ``0.33``."""
        return ".".join(self.version.split(".")[:2])

    @property
    def label(self) -> str:
        """The summary lines' label, ``conformance-0.33``."""
        return f"conformance-{self.line}"

    @property
    def drop_in(self) -> str:
        """kvcache's drop-in module for the release (``kvcache.vllm_0_33``)."""
        return drop_in_module(self.version)


#: The releases this runner checks, by version.
TARGETS: dict[str, Target] = {
    "0.33.0": Target(
        "0.33.0",
        "kvcache-0.33",
        "spec-0.33",
        not_in={
            name: "vLLM 0.33.0 has no TQFullAttentionSpec (a 0.25.1 layout only)"
            for name, family in FAMILIES.items()
            if "tq" in family.kinds
        },
        caching_off_mamba_kinds=frozenset({"mamba-all", "mamba-none"}),
        doubts=True,
    ),
}
#: The release the functions below check when none is named.
DEFAULT_RELEASE = "0.33.0"
SUBJECT = TARGETS[DEFAULT_RELEASE].subject


def target(release: str | None = None) -> Target:
    """The target for ``release`` (None: the installed vLLM's release).

    Raises:
        ValueError: a release this runner has no profile for, named with the ones it
            has (or no vLLM installed when ``release`` is None).
    """
    if release is None:
        try:
            import vllm
        except ImportError as exc:
            raise ValueError("release=None: no vLLM is installed to take its release "
                             f"from; name one of {', '.join(TARGETS)}") from exc  # fmt: skip
        release = str(vllm.__version__)
    if release not in TARGETS:
        raise ValueError(
            f"release={release!r}: kvcache has no profile checked against it; "
            f"choose from {', '.join(TARGETS)}"
        )
    return TARGETS[release]

# Paths the driver must reach in every family (as in the 0.25.1 conformance tests),
# so that a driver bug cannot make the comparison trivial.
REQUIRED_PATHS = ("allocate_none", "raises:ValueError", "raises:AssertionError", "reset_True")
REQUIRED_WITH_CACHING = ("prefix_hit", "event:BlockStored", "event:BlockRemoved")
# ... and with caching, vLLM 0.33.0's request fields (``REQUEST_FIELDS_0_33``): events
# carrying a session id, and lookups hitting for a request in the "full" report mode.
REQUIRED_WITH_REQUEST_FIELDS = ("event:session_id", "full_report_hit")
# ... and in a lookahead family: configs with each lookahead, events listing lookahead tokens.
REQUIRED_WITH_LOOKAHEAD = ("config:hash_lookahead", "config:prefill_lookahead", "event:lookahead")
# ... and beside a cached Mamba group with others (fine-grained hits): copy-on-write
# copies taken and their retained blocks freed (``RandomScheduler.take_copies``).
REQUIRED_WITH_COPIES = ("cow_copies",)
# ... and with Mamba prefill checkpoints: prefill chunks the scheduler lets run past
# the prompt's checkpoint, the layer saving it inside (``RandomScheduler.mamba_split``).
REQUIRED_WITH_CHECKPOINTS = ("checkpoint_chunk",)
# ... and with a cached Mamba 'align' group: boundary-state offloads offered
# (``RandomScheduler.take_offloads``: compared, block ids and all, every step).
REQUIRED_WITH_OFFLOADS = ("boundary_offloads",)
# ... and beside a full-attention group and a Mamba 'align' group: connector lookups
# whose groups' hits diverged (``RandomScheduler.connector_lookup``).
REQUIRED_WITH_CONNECTOR = ("connector_diverged",)
#: The lookup of a scheduler whose KV connector takes divergent hybrid hits
#: (``RandomScheduler.connector_lookup``).
CONNECTOR_LOOKUP = "get_computed_blocks_for_connector"


def connector_summary(stats: Stats) -> str:
    """How often the connector lookup ran, diverged, and was looked up again."""
    events = stats.events
    return (
        f"{events[CONNECTOR_LOOKUP]} connector lookups, {events['connector_diverged']} "
        f"diverged ({events['connector_diverged_external']} with external tokens, "
        f"{events['connector_fallback']} looked up again)"
    )


def diverged_required(family: Family) -> bool:
    """Whether ``family`` (as run under 0.33.0, ``under_release``) must reach a
    diverged connector lookup (``REQUIRED_WITH_CONNECTOR``): cached, with a
    full-attention group beside a Mamba group caching in 'align' mode (checkpoints
    included)."""
    return (
        family.enable_caching is not False
        and "full" in family.kinds
        and bool({"mamba-align", "mamba-checkpoint"} & set(family.kinds))
    )


def copies_required(family: Family) -> bool:
    """Whether ``family`` (as run under 0.33.0) must reach a copy-on-write copy: a
    cached layout with a Mamba group beside other groups."""
    return (
        family.enable_caching is not False
        and len(family.kinds) > 1
        and any(kind.startswith("mamba") for kind in family.kinds)
    )


def full_reports(family: Family) -> bool:
    """Whether ``family``'s configs can draw the "full" report mode
    (``kvcache.kit.driver.full_report_works``): not where every config has
    fine-grained hits or dcp > 1 (the Mamba 'align' families beside others, the
    context-parallel ones)."""
    return not family.context_parallel and not (
        "mamba-align" in family.kinds and len(family.kinds) > 1
    )


def under_release(family: Family, release: str = DEFAULT_RELEASE) -> Family:
    """``family`` as the runner drives it under ``release``: a family whose Mamba mode
    the release builds only uncached (0.33.0: 'all', 'none') runs with caching off, so
    that every sequence runs (the refusal with caching on is checked in the ``mamba``
    family, whose random modes include them, and by the unit tests). A
    context-parallel family gets the release's block geometry (``Family.cp_geometry``):
    0.33.0 refuses 0.25.1's under pcp > 1, and most of its sequences would compare
    refusals only."""
    chosen = target(release)
    if chosen.caching_off_mamba_kinds & set(family.kinds):
        family = dataclasses.replace(family, enable_caching=False)
    if family.context_parallel:
        family = dataclasses.replace(family, cp_geometry=chosen.version)
    return family


def conformant_families(
    subject: str | None = None, release: str = DEFAULT_RELEASE
) -> list[Family]:
    """The families run under ``release`` (for any ``subject``): every driver family
    not in its ``Target.not_in``."""
    chosen = target(release)
    return [
        under_release(f, release) for name, f in FAMILIES.items() if name not in chosen.not_in
    ]


def family_index(name: str) -> int:
    """The index of a family in ``FAMILIES`` (its sequences' seeds derive from it)."""
    return list(FAMILIES).index(name)


def family_seed(base_seed: int, family_index: int, index: int) -> int:
    """The seed of sequence ``index`` of a family (distinct across families)."""
    return base_seed * 10_000_000 + family_index * 100_000 + index


@dataclasses.dataclass
class FamilyResult:
    """One family's run: its stats, mismatching sequences and unreached paths."""

    family: Family
    stats: Stats
    failures: list[SequenceResult]
    missing_paths: list[str]

    @property
    def ok(self) -> bool:
        """No mismatch, nothing that could not be built, every required path reached."""
        return not self.failures and not self.missing_paths


def run_family(
    family: Family,
    family_index: int,
    sequences: int,
    base_seed: int = 0,
    subject: str | None = None,
    release: str = DEFAULT_RELEASE,
) -> FamilyResult:
    """Run ``sequences`` random sequences of ``family`` on both sides (``subject``:
    kvcache's profile of ``release`` by default, or the spec under it)."""
    from kvcache.kit.vllm_side import VllmAdapter

    subject = subject or target(release).subject
    # Both sides play 0.33.0's scheduler: it keeps the lookup's shared-prefix boundary
    # on the request (kvcache-0.33's adapter always does).
    VllmAdapter.stores_shared_prefix_boundary = True
    family = under_release(family, release)
    stats = Stats()
    started = time.monotonic()
    failures = []
    for index in range(sequences):
        result = run_sequence(
            family_seed(base_seed, family_index, index), family, subject, REFERENCE, stats
        )
        if result.cannot_build is not None and both_refuse(result, subject, REFERENCE):
            stats.events["both_refuse"] += 1
            continue
        if result.mismatch is not None or result.cannot_build is not None:
            failures.append(result)
    stats.seconds = time.monotonic() - started
    caching = family.enable_caching is not False and "cross" not in family.kinds
    required: tuple[str, ...] = REQUIRED_PATHS
    if caching:
        required += REQUIRED_WITH_CACHING + REQUIRED_WITH_REQUEST_FIELDS
        if not full_reports(family):
            required = tuple(p for p in required if p != "full_report_hit")
    if family.lookahead:
        required += REQUIRED_WITH_LOOKAHEAD
    if copies_required(family):
        required += REQUIRED_WITH_COPIES
    if "mamba-checkpoint" in family.kinds:
        required += REQUIRED_WITH_CHECKPOINTS
    if caching and ({"mamba-align", "mamba-checkpoint"} & set(family.kinds)):
        required += REQUIRED_WITH_OFFLOADS
    if diverged_required(family):
        required += REQUIRED_WITH_CONNECTOR
    missing = [path for path in required if stats.events[path] == 0]
    return FamilyResult(family, stats, failures, missing)


def both_refuse(result: SequenceResult, subject: str, reference: str) -> bool:
    """Whether a config the reference cannot build is refused by the subject too.

    A layout the release removed (0.33.0: a Mamba group caching outside 'align'), or
    a geometry it refuses (one caching group under pcp_world_size > 1 with the hash
    block of 0.25.1's block_size * dcp * pcp), must be refused by kvcache's profile
    of it as well, with the same exception type:
    then the sequence agrees (nothing to run). The subject building it, or
    refusing it with another exception type, is a failure.
    """
    from kvcache.kit.sides import CannotBuild, make_side

    reason = result.cannot_build or ""
    if f"{reference} rejects" not in reason:
        return False  # the subject (or something else) could not build
    try:
        make_side(subject, result.config, "0")
    except CannotBuild as exc:
        kind = reason.partition("(")[2].partition(":")[0]
        return bool(kind) and f"({kind}:" in exc.reason
    return False


def describe_failure(result: FamilyResult, failure_dir: Path, subject: str = SUBJECT) -> str:
    """The first failure of a family, its counterexample written under ``failure_dir``."""
    from kvcache.kit.driver import write_counterexample

    first = result.failures[0]
    if first.cannot_build is not None:
        return f"seed {first.seed}: {first.cannot_build} (config {first.config})"
    path = failure_dir / f"{first.family}-seed-{first.seed}.jsonl"
    write_counterexample(first, subject, REFERENCE, path)
    return (
        f"{len(result.failures)} sequence(s) diverge, first seed {first.seed}, config "
        f"{first.config}:\n{first.mismatch}\nMinimal trace: {path}\n"
        f"Replay it: python -m kvcache replay {path} --impl {subject}"
    )


def run_scheduler_streams(release: str = DEFAULT_RELEASE) -> list[str]:
    """The installed vLLM's Scheduler (``release``) on the drop-in's
    ``KVCacheManager`` (``kvcache.vllm_0_33`` for 0.33.0) and on its own manager,
    every stream of ``scheduler_drive``; the failures, one line each."""
    from kvcache.kit import scheduler_drive

    drop_in: Any = importlib.import_module(target(release).drop_in)

    failures = []
    with scheduler_drive.cpu_platform():
        for stream in scheduler_drive.STREAMS:
            try:
                result = scheduler_drive.compare(stream, drop_in.KVCacheManager)
            except scheduler_drive.SchedulerDiffers as exc:
                failures.append(str(exc))
                continue
            print(result.summary(), flush=True)
            reached = (result.finished == stream.num_requests and result.hits > 0
                       and result.preemptions > 0)  # fmt: skip
            if not reached:
                failures.append(f"{stream.name}: the stream did not reach its cases ({result})")
        failures += compare_published_events(scheduler_drive, drop_in.KVCacheManager)
    return failures


EVENT_STREAMS = ("shared_prefix_preemption", "hybrid_full_swa")
"""The streams whose KV events are published over ZMQ and compared (evictions, two groups)."""


def compare_published_events(scheduler_drive: Any, manager_cls: type) -> list[str]:
    """The installed vLLM's Scheduler with KV events on, publishing through its own
    ``ZmqEventPublisher`` over ``ipc://``: a subscriber decoding with vLLM's
    ``KVEventBatch`` must read the same batches from kvcache's manager as from
    vLLM's. The failures, one line each (a line per stream that matched)."""
    import tempfile

    failures = []
    streams = [s for s in scheduler_drive.STREAMS if s.name in EVENT_STREAMS]
    with tempfile.TemporaryDirectory() as tmp:
        for stream in streams:
            try:
                ours = scheduler_drive.published_events(
                    stream, manager_cls, 7, f"ipc://{tmp}/{stream.name}-kvcache.ipc"
                )
                stock = scheduler_drive.published_events(
                    stream, None, 7, f"ipc://{tmp}/{stream.name}-stock.ipc"
                )
            except scheduler_drive.SchedulerDiffers as exc:
                failures.append(f"events: {exc}")
                continue
            first = next((i for i, (a, b) in enumerate(zip(ours, stock, strict=False))
                          if a != b), None)  # fmt: skip
            if first is not None or len(ours) != len(stock):
                failures.append(
                    f"events [{stream.name}]: {len(ours)} vs {len(stock)} batches, first "
                    f"differing batch {first}"
                )
                continue
            events = sum(len(batch) for batch in stock)
            print(f"kv events over zmq [{stream.name}]: {len(stock)} batches, {events} "
                  "events: decoded identically", flush=True)  # fmt: skip
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    """Run the conformance families of a release; 0 when every one has 0 mismatches,
    1 on a mismatch, 2 on a bad argument or the wrong vLLM installed."""
    parser = argparse.ArgumentParser(prog="python -m kvcache.kit.conformance")
    parser.add_argument(
        "--release", default=None,
        help=f"the vLLM release checked (default: the installed one); one of "
        f"{', '.join(TARGETS)}",
    )  # fmt: skip
    parser.add_argument("--sequences", type=int, default=100, help="sequences per family")
    parser.add_argument("--seed", type=int, default=0, help="shifts every seed")
    parser.add_argument(
        "--families", default="", help="comma-separated family names (default: all conformant)"
    )
    parser.add_argument(
        "--failure-dir", default=None,
        help="where counterexamples go (default build/conformance-<line>-failures)",
    )  # fmt: skip
    parser.add_argument(
        "--subject",
        default=None,
        help="the side checked against the release: kvcache under its profile (default, "
        "kvcache-0.33 for 0.33.0) or the spec under it (spec-0.33)",
    )
    parser.add_argument(
        "--no-scheduler", action="store_true", help="skip the release's Scheduler streams"
    )
    parser.add_argument(
        "--no-doubts", action="store_true",
        help="skip the examples of docs/divergences.md's doubts of the release "
        "(kvcache.kit.doubts)",
    )  # fmt: skip
    parser.add_argument(
        "--rule-layouts", type=int, default=400,
        help="random layouts on which the kit's fine-grained-hit rule is checked (0: skip)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.rule_layouts < 0:
        parser.error(f"--rule-layouts must not be negative, got {args.rule_layouts}")
    if args.sequences < 1:
        parser.error(f"--sequences must be positive, got {args.sequences}")
    try:
        chosen_target = target(args.release)
    except ValueError as exc:
        print(f"conformance: --release: {exc}", file=sys.stderr)
        return 2
    label = chosen_target.label
    release = chosen_target.version
    subject = args.subject or chosen_target.subject
    if subject not in (chosen_target.subject, chosen_target.spec_subject):
        print(f"conformance: --subject={subject!r}: choose {chosen_target.subject} or "
              f"{chosen_target.spec_subject} for vLLM {release}", file=sys.stderr)  # fmt: skip
        return 2
    failure_dir = Path(args.failure_dir or f"build/{label}-failures")

    import vllm

    import kvcache

    if vllm.__version__ != release:
        print(f"{label}: needs vLLM {release}, found {vllm.__version__}")
        return 2
    if os.environ.get(EXPECT_COMPILED_ENV, "0") not in ("", "0") and not kvcache.COMPILED:
        # make conformance-0.33-compiled: a stale or missing build must not pass as compiled.
        print(f"{label}: {EXPECT_COMPILED_ENV}=1 but kvcache's pure build is loaded "
              "(make compiled)")
        return 2
    build = ""
    if subject == chosen_target.subject:
        build = f" [{'compiled' if kvcache.COMPILED else 'pure'} build]"
    chosen = conformant_families(subject, release)
    if args.families:
        wanted = [n.strip() for n in args.families.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in FAMILIES]
        if unknown:
            parser.error(f"--families: unknown {unknown}; known: {', '.join(FAMILIES)}")
        chosen = [FAMILIES[n] for n in wanted]
    total = Stats()
    failed: list[str] = []
    if args.rule_layouts:
        from kvcache.kit.fine_grained_check import check_rule

        rule = check_rule(args.rule_layouts, args.seed)
        print(rule.summary(), flush=True)
        for line in rule.mismatches:
            print(f"  {line}", flush=True)
        if rule.mismatches or not rule.enabled:
            failed.append("fine-grained rule")
    if not args.no_doubts and chosen_target.doubts:
        from kvcache.kit import doubts

        wrong = doubts.check(release=release)
        print(f"{doubts.summary_label(release)}: {len(doubts.examples(release=release)[1])} "
              f"examples of docs/divergences.md on vLLM {release} and kvcache: "
              f"{len(wrong)} claims wrong", flush=True)  # fmt: skip
        for line in wrong:
            print(f"  {line}", flush=True)
        if wrong:
            failed.append("doubts")
    for family in chosen:
        result = run_family(
            family, family_index(family.name), args.sequences, args.seed, subject, release
        )
        total.add(result.stats)
        print(f"{result.stats.summary()} in {result.stats.seconds:.1f}s", flush=True)
        if result.stats.events[CONNECTOR_LOOKUP]:
            print(f"  {connector_summary(result.stats)}", flush=True)
        if result.failures:
            failed.append(family.name)
            print(describe_failure(result, failure_dir, subject), flush=True)
        if result.missing_paths:
            failed.append(family.name)
            print(f"{family.name}: the driver never reached {result.missing_paths}", flush=True)
    not_in = chosen_target.not_in
    print(f"not in vLLM {release} (not run): " + (", ".join(sorted(not_in)) or "none"))
    for reason in sorted(set(not_in.values())):
        names = sorted(n for n, r in not_in.items() if r == reason)
        print(f"  {', '.join(names)}: {reason}")
    if not args.no_scheduler:
        for line in run_scheduler_streams(release):
            failed.append("scheduler")
            print(f"vllm scheduler on kvcache: {line}", flush=True)
    print(f"{total.summary(label)} in {total.seconds:.0f}s{build}")
    print(f"{label}: {connector_summary(total)}")
    if failed:
        print(f"{label}: FAILED in {', '.join(sorted(set(failed)))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
