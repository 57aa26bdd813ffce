"""``python -m kvcache effectiveness``: the prefix-cache scenario suite on the command line.

Runs ``kvcache.kit.effectiveness``'s suite on an implementation, prints the table
and the flags, and writes the JSON (with the command line that repeats the run)
and the plot. ``kvcache.kit.cli`` builds the parser and dispatches here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

from kvcache.kit.cli_args import need_matplotlib


def _names(text: str, default: Iterable[str]) -> list[str]:
    """The comma-separated names of ``text``, or ``default`` when it names none."""
    return [name for name in text.split(",") if name] or list(default)


def _effectiveness_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run (for the JSON and the docs made from it)."""
    import os
    import shlex

    python = sys.executable
    relative = os.path.relpath(python)
    words = [relative if not relative.startswith("..") else "python", "-m", "kvcache"]
    words += ["effectiveness", "--impl", args.impl]
    for flag in ("families", "scenarios", "lookaheads"):
        if getattr(args, flag):
            words += [f"--{flag}", getattr(args, flag)]
    if args.eagle_master_switch != "auto":
        words += ["--eagle-master-switch", args.eagle_master_switch]
    for pattern in args.expect_flag:
        words += ["--expect-flag", pattern]
    if args.expect_known:
        words.append("--expect-known")
    if args.no_table:
        words.append("--no-table")
    for flag in ("json", "plot"):
        if getattr(args, flag):
            words += [f"--{flag}", getattr(args, flag)]
    return "PYTHONHASHSEED=0 KVCACHE_PURE=1 " + shlex.join(words)


def _cmd_effectiveness(args: argparse.Namespace) -> int:
    import datetime
    import json

    from kvcache.kit import effectiveness as eff

    if args.plot:
        need_matplotlib("--plot")
    expected = [eff.parse_expectation(text) for text in args.expect_flag]
    release = eff.subject_release(args.impl)
    if args.eagle_master_switch == "auto":
        master = bool(release and eff.switch_on("eagle_master_switch", release))
        if release is None:
            print(
                f"note: the kit cannot tell {args.impl}'s vLLM release; judging with use_eagle "
                "not gating EAGLE groups (0.25.1's rule; --eagle-master-switch on for 0.30.0+)",
                file=sys.stderr,
            )
    else:
        master = args.eagle_master_switch == "on"
    rows = eff.run_suite(
        args.impl,
        _names(args.families, eff.SUITE_FAMILIES),
        _names(args.scenarios, eff.SCENARIOS),
        master_switch=master,
        lookaheads=_names(args.lookaheads, eff.LOOKAHEADS),
    )
    if not args.no_table:
        print(eff.format_suite(rows) + "\n")
    known = eff.known_flags(release) if args.expect_known else []
    unexpected, unmet = eff.check_flags(rows, expected, [p for p, _ in known])
    flagged = [row for row in rows if row.flags]
    unbuilt = sum(bool(row.cannot_build) for row in rows)
    print(
        f"{args.impl} (vLLM {release or 'release unknown'}, eagle master switch "
        f"{'on' if master else 'off'}): {len(rows)} rows, {unbuilt} cannot build or run, "
        f"{len(flagged)} flagged, {len(flagged) - len(unexpected)} of them expected"
    )
    for row in unexpected:
        print(f"unexpected flag: {row.key}: {'; '.join(row.flags)}")
    for pattern in unmet:
        print(f"expected flag not seen: {pattern}")
    if args.json:
        data = {
            "impl": args.impl,
            "release": release,
            "eagle_master_switch": master,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "command": _effectiveness_command(args),
            "rows": [row.to_json() for row in rows],
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        eff.plot_suite(rows, args.plot, f"{args.impl} (vLLM {release or '?'})")
    return 1 if unexpected or unmet else 0
