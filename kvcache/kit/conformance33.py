"""Conformance of kvcache's 0.33.0 profile against the real vLLM 0.33.0 (``make conformance-0.33``).

The same seeded random scheduler sequences as the 0.25.1 conformance tests
(``tests/conformance/test_conformance.py``; ``kvcache.kit.driver``), run in
lockstep on vLLM 0.33.0 (the reference) and on ``kvcache-0.33``: kvcache through
its drop-in module ``kvcache.vllm_0_33`` (``Profile("0.33.0")``). Both sides are
of the same release line, so no ledger entry normalises anything: results,
exceptions, events, stats, block hashes and the abstract state must be equal
after every call.

Run it with vLLM 0.33.0 importable (``.venv-0.33``, ``make reference-0.33``)::

    .venv-0.33/bin/python -m kvcache.kit.conformance33 --sequences 100

It prints one ``conformance: ...`` line per family and a ``conformance-0.33:``
total, lists the families vLLM 0.33.0 cannot build (``NOT_IN_0_33``: not run,
and said so), and exits 1 on any mismatch, writing the first one's shrunk
counterexample under ``build/conformance-0.33-failures/``.

First the kit's own statement of the fine-grained-hit rule (which the driver and
the ledger use) is checked against vLLM 0.33.0's decision on random layouts
(``kvcache.kit.fine_grained_check``; ``--rule-layouts``), and the examples of
docs/divergences.md's "vLLM 0.33.0: matched although doubtful" run on both sides
(``kvcache.kit.doubts33``; ``--no-doubts`` skips them).

Then vLLM 0.33.0's own ``Scheduler`` runs the streams of
``kvcache.kit.scheduler_drive`` with ``kvcache.vllm_0_33.KVCacheManager`` swapped
in, and must decide every step exactly as on vLLM's own manager (one ``vllm
scheduler on kvcache [...]: ... identical`` line per stream).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcache.kit.driver import FAMILIES, Family, SequenceResult, Stats, run_sequence

SUBJECT = "kvcache-0.33"
#: Set to 1 (``make conformance-0.33-compiled``): refuse to run on kvcache's pure build.
EXPECT_COMPILED_ENV = "KVCACHE_EXPECT_COMPILED"
REFERENCE = "vllm"
REFERENCE_VERSION = "0.33.0"

#: Mamba modes 0.33.0 builds only with caching off.
CACHING_OFF_MAMBA_KINDS = frozenset({"mamba-all", "mamba-none"})
#: Layout families of ``kvcache.kit.driver.FAMILIES`` vLLM 0.33.0 cannot build (their
#: spec classes are gone), with why. Every other family runs (``conformant_families``);
#: configs 0.33.0 cannot build (a Mamba group caching outside 'align') must be refused
#: by both sides (``both_refuse``).
NOT_IN_0_33: dict[str, str] = {
    name: "vLLM 0.33.0 has no TQFullAttentionSpec (a 0.25.1 layout only)"
    for name, family in FAMILIES.items()
    if "tq" in family.kinds
}

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
    """Whether ``family`` (as run under 0.33.0) must reach a diverged connector lookup
    (``REQUIRED_WITH_CONNECTOR``): cached, with a full-attention group beside a Mamba
    group caching in 'align' mode (checkpoints included)."""
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


def under_0_33(family: Family) -> Family:
    """``family`` as the runner drives it: a family whose Mamba mode vLLM 0.33.0
    builds only uncached ('all', 'none') runs with caching off, so that every
    sequence runs (the refusal with caching on is checked in the ``mamba`` family,
    whose random modes include them, and by the unit tests). A context-parallel
    family gets 0.33.0's block geometry (``Family.cp_geometry``): 0.33.0 refuses
    0.25.1's under pcp > 1, and most of its sequences would compare refusals only."""
    if CACHING_OFF_MAMBA_KINDS & set(family.kinds):
        family = dataclasses.replace(family, enable_caching=False)
    if family.context_parallel:
        family = dataclasses.replace(family, cp_geometry="0.33.0")
    return family


def conformant_families(subject: str = SUBJECT) -> list[Family]:
    """The families run (for any ``subject``): every driver family not in
    ``NOT_IN_0_33``."""
    return [under_0_33(f) for name, f in FAMILIES.items() if name not in NOT_IN_0_33]


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
    family: Family, family_index: int, sequences: int, base_seed: int = 0, subject: str = SUBJECT
) -> FamilyResult:
    """Run ``sequences`` random sequences of ``family`` on both sides (``subject``:
    kvcache's 0.33 profile, or ``spec-0.33``, the spec under it)."""
    from kvcache.kit.vllm_side import VllmAdapter

    # Both sides play 0.33.0's scheduler: it keeps the lookup's shared-prefix boundary
    # on the request (kvcache-0.33's adapter always does).
    VllmAdapter.stores_shared_prefix_boundary = True
    family = under_0_33(family)
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

    A layout vLLM 0.33.0 removed (a Mamba group caching outside 'align'), or a
    geometry it refuses (one caching group under pcp_world_size > 1 with the hash
    block of 0.25.1's block_size * dcp * pcp), must be refused by kvcache's 0.33.0
    profile as well, with the same exception type:
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


def run_scheduler_streams() -> list[str]:
    """vLLM 0.33.0's Scheduler on ``kvcache.vllm_0_33.KVCacheManager`` and on its own
    manager, every stream of ``scheduler_drive``; the failures, one line each."""
    from kvcache import vllm_0_33
    from kvcache.kit import scheduler_drive

    failures = []
    with scheduler_drive.cpu_platform():
        for stream in scheduler_drive.STREAMS:
            try:
                result = scheduler_drive.compare(stream, vllm_0_33.KVCacheManager)
            except scheduler_drive.SchedulerDiffers as exc:
                failures.append(str(exc))
                continue
            print(result.summary(), flush=True)
            reached = (result.finished == stream.num_requests and result.hits > 0
                       and result.preemptions > 0)  # fmt: skip
            if not reached:
                failures.append(f"{stream.name}: the stream did not reach its cases ({result})")
        failures += compare_published_events(scheduler_drive, vllm_0_33.KVCacheManager)
    return failures


EVENT_STREAMS = ("shared_prefix_preemption", "hybrid_full_swa")
"""The streams whose KV events are published over ZMQ and compared (evictions, two groups)."""


def compare_published_events(scheduler_drive: Any, manager_cls: type) -> list[str]:
    """vLLM 0.33.0's Scheduler with KV events on, publishing through its own
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
    """Run the conformance families; 0 when every one has 0 mismatches."""
    parser = argparse.ArgumentParser(prog="python -m kvcache.kit.conformance33")
    parser.add_argument("--sequences", type=int, default=100, help="sequences per family")
    parser.add_argument("--seed", type=int, default=0, help="shifts every seed")
    parser.add_argument(
        "--families", default="", help="comma-separated family names (default: all conformant)"
    )
    parser.add_argument("--failure-dir", default="build/conformance-0.33-failures")
    parser.add_argument(
        "--subject",
        default=SUBJECT,
        choices=(SUBJECT, "spec-0.33"),
        help="the side checked against vLLM 0.33.0 (spec-0.33: the spec under its profile)",
    )
    parser.add_argument(
        "--no-scheduler", action="store_true", help="skip vLLM 0.33.0's Scheduler streams"
    )
    parser.add_argument(
        "--no-doubts", action="store_true",
        help="skip the examples of docs/divergences.md's 0.33.0 doubts (kvcache.kit.doubts33)",
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

    import vllm

    import kvcache

    if vllm.__version__ != REFERENCE_VERSION:
        print(f"conformance-0.33: needs vLLM {REFERENCE_VERSION}, found {vllm.__version__}")
        return 2
    if os.environ.get(EXPECT_COMPILED_ENV, "0") not in ("", "0") and not kvcache.COMPILED:
        # make conformance-0.33-compiled: a stale or missing build must not pass as compiled.
        print(f"conformance-0.33: {EXPECT_COMPILED_ENV}=1 but kvcache's pure build is loaded "
              "(make compiled)")
        return 2
    build = ""
    if args.subject == SUBJECT:
        build = f" [{'compiled' if kvcache.COMPILED else 'pure'} build]"
    chosen = conformant_families(args.subject)
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
    if not args.no_doubts:
        from kvcache.kit import doubts33

        wrong = doubts33.check()
        print(f"doubts33: {len(doubts33.examples()[1])} examples of docs/divergences.md "
              f"on vLLM {REFERENCE_VERSION} and kvcache: {len(wrong)} claims wrong",
              flush=True)  # fmt: skip
        for line in wrong:
            print(f"  {line}", flush=True)
        if wrong:
            failed.append("doubts33")
    for family in chosen:
        result = run_family(
            family, family_index(family.name), args.sequences, args.seed, args.subject
        )
        total.add(result.stats)
        print(f"{result.stats.summary()} in {result.stats.seconds:.1f}s", flush=True)
        if result.stats.events[CONNECTOR_LOOKUP]:
            print(f"  {connector_summary(result.stats)}", flush=True)
        if result.failures:
            failed.append(family.name)
            print(describe_failure(result, Path(args.failure_dir), args.subject), flush=True)
        if result.missing_paths:
            failed.append(family.name)
            print(f"{family.name}: the driver never reached {result.missing_paths}", flush=True)
    print(
        "not in vLLM 0.33.0 (not run): "
        + (", ".join(sorted(NOT_IN_0_33)) or "none")
    )
    for reason in sorted(set(NOT_IN_0_33.values())):
        names = sorted(n for n, r in NOT_IN_0_33.items() if r == reason)
        print(f"  {', '.join(names)}: {reason}")
    if not args.no_scheduler:
        for line in run_scheduler_streams():
            failed.append("scheduler")
            print(f"vllm scheduler on kvcache: {line}", flush=True)
    print(f"{total.summary('conformance-0.33')} in {total.seconds:.0f}s{build}")
    print(f"conformance-0.33: {connector_summary(total)}")
    if failed:
        print(f"conformance-0.33: FAILED in {', '.join(sorted(set(failed)))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
