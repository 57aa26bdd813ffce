"""``python -m kvcache release-check``, ``bisect`` and ``changelog``: vLLM releases compared.

``release-check`` replays the stored traces on the installed vLLM and runs a
census; ``bisect`` finds, per ledger entry, the first release that shows it;
``changelog`` writes the semantic changelog between two releases (from two venvs
or two recorded trace sets). ``kvcache.kit.cli`` builds the parser and
dispatches here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_release_check(args: argparse.Namespace) -> int:
    from kvcache.kit.releases import release_check

    check = release_check(
        args.traces, args.census_seconds, Path(args.census_dir), args.seed,
        census_sequences=args.census_sequences,
    )  # fmt: skip
    for report in check.traces:
        entries = f" [{', '.join(report.entries)}]" if report.entries else ""
        print(f"{report.path}: {report.verdict}: {report.detail}{entries}")
    if check.census is not None:
        for kind, n in sorted(check.census.census.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"census {n:>5}  {kind}")
    for line in check.unknown:
        print(f"UNKNOWN {line}")
    print(check.summary())
    if args.json:
        from kvcache.kit.bisect import check_record

        Path(args.json).write_text(json.dumps(check_record(check), indent=1), encoding="utf-8")
    return 1 if check.unknown else 0


def _cmd_bisect(args: argparse.Namespace) -> int:
    from kvcache.kit.bisect import default_pythons, main_bisect

    pythons = args.python or default_pythons()
    if len(pythons) < 2:
        raise ValueError(
            f"python={pythons!r}: bisect needs two release venvs or more "
            "(make reference-0.29.0, ... or --python PATH per release)"
        )
    return main_bisect(
        pythons, args.traces, args.census_sequences, Path(args.out), Path(args.work_dir),
        reuse=args.reuse,
    )  # fmt: skip


def _cmd_changelog(args: argparse.Namespace) -> int:
    from kvcache.kit.releases import changelog, python_version_of, release_check
    from kvcache.kit.sides import resolve_adapter

    if args.from_traces or args.to_traces:
        return _changelog_from_traces(args)
    if not args.from_version or not args.to_version:
        raise ValueError("give --from and --to (or --from-traces and --to-traces)")
    installed = str(resolve_adapter("vllm").version)
    if installed != args.to_version:
        raise ValueError(
            f"--to {args.to_version}: this Python has vLLM {installed}; run the changelog "
            f"with the {args.to_version} venv's Python (make reference-0.33)"
        )
    if args.from_python and python_version_of(args.from_python) != args.from_version:
        raise ValueError(f"--from-python {args.from_python} does not have vLLM {args.from_version}")
    census_dir = Path(args.census_dir)
    check = release_check(args.traces, args.census_seconds, census_dir, args.seed)
    text = changelog(
        args.from_version,
        args.to_version,
        check,
        old_python=args.from_python or None,
        new_python=sys.executable if args.from_python else None,
        census_dir=census_dir,
    )
    out = Path(args.out or f"docs/vllm-{args.from_version}-to-{args.to_version}.md")
    out.write_text(text, encoding="utf-8")
    print(f"changelog written to {out} ({check.summary()})")
    for line in check.unknown:
        print(f"UNKNOWN {line}")
    return 1 if check.unknown else 0  # a changelog with unexplained differences is not done


def _changelog_from_traces(args: argparse.Namespace) -> int:
    """``changelog --from-traces A --to-traces B``: no vLLM needed, no census."""
    from kvcache.kit.releases import changelog, compare_trace_sets, trace_version
    from kvcache.kit.trace import read_trace

    if not (args.from_traces and args.to_traces):
        raise ValueError("give both --from-traces and --to-traces")
    old_dir, new_dir = Path(args.from_traces), Path(args.to_traces)
    check = compare_trace_sets(old_dir, new_dir)
    versions = []
    for name, folder, given in (
        ("--from-traces", old_dir, args.from_version),
        ("--to-traces", new_dir, args.to_version),
    ):
        found = sorted(
            {
                trace_version(read_trace(p))
                for p in folder.iterdir()
                if p.name.endswith((".jsonl", ".jsonl.gz"))
            }
        )
        if len(found) != 1:
            raise ValueError(f"{name} {folder}: traces of several releases {found}")
        if given and given != found[0]:
            raise ValueError(f"{name} {folder} records vLLM {found[0]}, not {given}")
        versions.append(found[0])
    text = changelog(versions[0], versions[1], check, trace_sets=(str(old_dir), str(new_dir)))
    out = Path(args.out or f"docs/vllm-{versions[0]}-to-{versions[1]}.md")
    out.write_text(text, encoding="utf-8")
    print(f"changelog written to {out} ({check.summary()})")
    return 1 if check.unknown else 0
