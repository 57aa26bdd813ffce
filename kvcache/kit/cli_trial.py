"""``python -m kvcache replay`` and ``fuzz``: put an implementation on trial.

``replay`` replays recorded traces on an implementation and prints the first
divergence (the call, the calls before it, both states); ``fuzz`` runs random
scheduler sequences on it and a reference in lockstep. ``kvcache.kit.cli``
builds the parser and dispatches here.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any


def _print_divergence(
    path: Path, trace: Any, impl: str, result: Any, context: int, full_states: bool
) -> None:
    from kvcache.kit.driver import describe_call, describe_calls
    from kvcache.kit.trace import short, state_diff

    mismatch = result.mismatch
    limit = 10**9 if full_states else 1500
    print(f"{path}: DIVERGES on {impl} (new divergence: {mismatch.kind}, not in the ledger)")
    if mismatch.index < 0:
        print(f"  building the manager: {mismatch.detail}")
        return
    record = trace.records[mismatch.index]
    print(f"  at record #{mismatch.index} of {len(trace.records)}:")
    print(describe_call(mismatch.index, record).replace("  #", "    #", 1))
    print("  " + mismatch.detail.replace("\n", "\n  "))
    first = max(0, mismatch.index - context)
    if mismatch.index > first:
        print(f"  preceding calls (results as recorded on {trace.recorded_with}):")
        print(textwrap.indent(describe_calls(trace.records[first : mismatch.index], first), "  "))
    expected, observed = mismatch.expected_state, mismatch.observed_state
    if expected is None:
        print("  states: the trace holds no state for this call")
    elif observed is None:
        print(f"  states: {impl} has no abstract_state(); expected state after the call:")
        print("    " + short(expected, limit))
    elif not (diff := state_diff(expected, observed)):
        print(f"  state after the call: {impl}'s equals the trace's (only the result differs)")
        if full_states:
            print(f"    {short(expected, limit)}")
        return
    else:
        print(f"  state after the call, expected (from the trace):\n    {short(expected, limit)}")
        print(f"  state after the call, observed ({impl}):\n    {short(observed, limit)}")
        print("  differences:\n" + "\n".join("  " + d for d in diff))
    if not full_states:
        print("  (--full-states prints the states uncut)")


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvcache.kit.levels import replay_at, trial_for
    from kvcache.kit.trace import read_trace

    traces = [read_trace(path) for path in args.traces]  # all readable before any replay
    diverged = 0
    for path, trace in zip(args.traces, traces, strict=True):
        trial = trial_for(args.impl, args.compare, args.features, trace.header)
        result, undeclared = replay_at(trace, args.impl, trial)
        if undeclared:
            print(f"{path}: not judged: it uses features {args.impl} does not declare "
                  f"({', '.join(sorted(undeclared))})")
            continue
        compared = "results and states" if result.states_compared else "results"
        if trial.level != "exact":
            compared = f"compared at level {trial.level}: " + compared
        known = ", ".join(f"{k} x{n}" for k, n in sorted(result.known.items()))
        where = f"({trace.config.layout}, recorded on {trace.recorded_with})"
        if result.cannot_build is not None:
            if result.cannot_build_known:
                print(
                    f"{path}: known difference ({result.cannot_build_known}): {result.cannot_build}"
                )
            else:
                diverged += 1
                print(f"{path}: {result.cannot_build} (no ledger entry explains it)")
            continue
        if result.mismatch is None:
            if result.known:
                print(
                    f"{path}: {len(trace.records)} records {where} replay on {args.impl} "
                    f"with known differences only ({known}; {compared} compared)"
                )
            else:
                print(
                    f"{path}: {len(trace.records)} records {where} replay identically on "
                    f"{args.impl} ({compared} compared)"
                )
            continue
        mismatch = result.mismatch
        if mismatch.known:
            label = "fixed" if result.fixed else "known difference"
            extra = f"; normalised before: {known}" if known else ""
            print(
                f"{path}: {label} ({', '.join(mismatch.known)}) at record #{mismatch.index} "
                f"of {len(trace.records)} {where}: {mismatch.op} [{mismatch.part}]{extra}"
            )
            continue
        diverged += 1
        if known:
            print(f"{path}: known differences before the divergence: {known}")
        _print_divergence(Path(path), trace, args.impl, result, args.context, args.full_states)
    return 1 if diverged else 0


def _cmd_fuzz(args: argparse.Namespace) -> int:
    from kvcache.kit.fuzz import fuzz
    from kvcache.kit.levels import trial_for

    trial = trial_for(args.impl, args.compare, args.features)
    families = args.layouts.split(",") if args.layouts else None
    seconds = None if args.sequences and args.minutes is None else 60.0 * (args.minutes or 1.0)
    outcome = fuzz(
        args.impl,
        reference=args.reference,
        families=families,
        seconds=seconds,
        max_sequences=args.sequences,
        seed=args.seed,
        out=Path(args.out) if args.out else None,
        shrink_s=args.shrink_seconds,
        census=args.census,
        census_dir=Path(args.census_dir),
        trial=trial,
    )
    stats = outcome.stats
    print(
        f"fuzz {args.impl} vs {args.reference}, seed {args.seed}: {stats.sequences} sequences "
        f"[{stats.layout_summary()}], {stats.calls} calls in {outcome.seconds:.0f} s"
    )
    if not trial.plain:
        from kvcache.kit.levels import trial_lines

        print("\n".join(trial_lines(outcome)))
    if stats.known:
        known = ", ".join(f"{k} x{n}" for k, n in sorted(stats.known.items()))
        print(f"known differences normalised (ledger): {known}")
    if outcome.skipped:
        by_why: dict[str, list[str]] = {}
        for family, why in outcome.skipped.items():
            by_why.setdefault(why, []).append(family)
        for why, names in by_why.items():
            print(f"skipped {len(names)} families ({why}): {', '.join(names)}")
    if outcome.not_built:
        print(
            f"not run, a side refused the config ({sum(outcome.not_built.values())} sequences, "
            "not counted above):"
        )
        for family, n in sorted(outcome.not_built.items()):
            print(f"  {family} x{n}: {outcome.not_built_reasons[family]}")
    elif args.census:
        for reason, n in sorted(outcome.cannot_build.items()):
            print(f"not built ({n} sequences): {reason}")
    if outcome.harness_error:
        print(f"error: {outcome.harness_error}", file=sys.stderr)
        return 2
    if args.census:
        print(f"census: first differences of {sum(outcome.census.values())} sequences by kind")
        for kind, n in sorted(outcome.census.items(), key=lambda kv: (-kv[1], kv[0])):
            example = outcome.census_examples.get(kind)
            where = f"  {example[0]} ({example[1]} calls)" if example else ""
            print(f"  {n:>6}  {kind}{where}")
        unknown = outcome.unknown_kinds
        print(f"unknown kinds: {len(unknown)}" + (f" ({', '.join(unknown)})" if unknown else ""))
        print(f"findings (unknown differences by root cause): {len(outcome.findings)}")
        for finding in outcome.findings:
            print(finding.line())
        return 1 if unknown else 0
    if outcome.counterexample is None:
        print(f"no divergence: {args.impl} matches {args.reference} on every call")
        return 0
    print(
        f"DIVERGENCE: a counterexample of {outcome.counterexample_calls} calls is in "
        f"{outcome.counterexample}\nreproduce it: python -m kvcache replay "
        f"{outcome.counterexample} --impl {args.impl}"
    )
    return 1
