"""``python -m kvcache`` (also the ``kvcache`` command): put a KV-cache manager on trial.

Commands: ``record`` a trace, ``replay`` one against an implementation,
``fuzz`` an implementation against the oracle or vLLM, ``bench`` and
``simulate``. Run ``python -m kvcache COMMAND --help`` for each.

This module builds the parser and runs ``bench``, ``simulate``, ``record`` and
``make-trace``; the other commands live in modules by job: ``cli_trial``
(``replay``, ``fuzz``), ``cli_releases`` (``release-check``, ``bisect``,
``changelog``) and ``cli_effectiveness``. The argument checks are in ``cli_args``,
imported here under their own names (``from kvcache.kit.cli import ...`` keeps
working).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcache.kit.cli_args import NON_NEGATIVE as NON_NEGATIVE
from kvcache.kit.cli_args import POSITIVE as POSITIVE
from kvcache.kit.cli_args import Parser as Parser
from kvcache.kit.cli_args import float_above as float_above
from kvcache.kit.cli_args import int_at_least as int_at_least
from kvcache.kit.cli_args import need_matplotlib as need_matplotlib
from kvcache.kit.cli_args import output_path as output_path
from kvcache.kit.cli_args import workload_list as workload_list
from kvcache.kit.cli_effectiveness import _cmd_effectiveness
from kvcache.kit.cli_releases import _cmd_bisect, _cmd_changelog, _cmd_release_check
from kvcache.kit.cli_trial import _cmd_fuzz, _cmd_replay
from kvcache.kit.streams import add_stream_options
from kvcache.kit.workloads import WORKLOAD_NAMES

IMPL_HELP = (
    "implementation: kvcache, spec (the oracle), vllm (the installed vLLM), a package "
    "with a KVCacheManager, or module:factory (see docs/kit.md)"
)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvcache.kit import bench

    names = args.workloads
    if names is None:  # the built-in workloads, unless a stream file is benchmarked alone
        names = "" if args.requests_from else ",".join(WORKLOAD_NAMES)
    if not (names.strip(",") or args.requests_from or args.traces or args.trace_requests
            or args.scaling):  # fmt: skip
        raise ValueError(
            "nothing to bench: give --workloads, --requests-from, --traces, --trace-requests "
            "or --scaling"
        )
    if args.impls:  # given: no need to find out whether vLLM imports (seconds)
        impls, note = [name for name in args.impls.split(",") if name], ""
        from kvcache.kit.sides import resolve_adapter

        for name in impls:  # a bad name is refused before the first run, not after it
            resolve_adapter(name)
    else:
        impls, note = bench.default_impls()
    if args.plot:
        need_matplotlib("--plot")
    if note:
        print(note)
    results = []
    started = time.monotonic()

    def progress(text: str) -> None:  # stderr: stdout stays the tables alone
        print(f"bench: {text} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    for name in filter(None, names.split(",")):
        result = bench.bench_workload(
            name, impls, args.repetitions, args.requests, progress=progress
        )
        print(bench.format_workload(result), flush=True)
        results.append(result)
    if args.requests_from:
        from kvcache.kit.streams import workload_from_args
        from kvcache.kit.sweeps import parse_pool_sizes

        stream = workload_from_args(args)
        sizes = parse_pool_sizes(args.pool_sizes) if args.pool_sizes else [stream.num_blocks]
        for size in sizes:  # one table per pool size: the manager's cost depends on it
            sized = dataclasses.replace(stream, num_blocks=size)
            name = f"{stream.name}, pool {size}" if args.pool_sizes else stream.name
            result = bench.bench_workload(name, impls, args.repetitions, workload=sized)
            print(bench.format_workload(result), flush=True)
            results.append(result)
    elif args.pool_sizes:
        raise ValueError("--pool-sizes: give --requests-from (a stream to run at each size)")
    trace_impls = [i for i in impls if i != "spec"]
    traces: list[Any] = list(args.traces)
    if args.trace_requests:
        traces += [
            bench.record_bench_trace(name, args.trace_requests)
            for name in ("chat", "chat-swa", "chat-mamba")
        ]
    trace_results = []
    for trace in traces:
        progress(f"trace {getattr(trace, 'path', None) or trace}: {', '.join(trace_impls)}")
        trace_result = bench.bench_trace(
            trace,
            trace_impls,
            args.trace_repetitions,
            args.trace_min_records,
            args.trace_min_replays,
        )
        print(bench.format_trace(trace_result), flush=True)
        trace_results.append(trace_result)
    scaling_data = None
    if args.scaling:
        scaling_impls = [i for i in impls if i != "spec"]
        scaling_data = bench.scaling(
            scaling_impls,
            [10**3, 10**4, 10**5, 10**6],
            [16, 256, 2048, 8192, 32768],
        )
        print(bench.format_scaling(scaling_data))
    if args.json:
        with open(args.json, "w") as f:
            f.write(bench.results_json(results, scaling_data, trace_results))
        print(f"results written to {args.json}")
    if args.plot and results:
        print(bench.plot(results, scaling_data, args.plot))
    identical = all(r.identical for r in results) and all(t.identical for t in trace_results)
    return 0 if identical else 1


SIMULATE_PLOT_HELP = (
    "draw to this PNG: at one pool size, prefix hit rate, preemptions, usage and queue "
    "lengths over time (implementations overlaid); with --pool-sizes, hit rate against "
    "pool size with the infinite-cache ideal"
)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from kvcache.kit.sweeps import simulate_command

    if args.plot:
        need_matplotlib("--plot")
    return simulate_command(args)


def _cmd_make_trace(args: argparse.Namespace) -> int:
    from kvcache.kit.streams import make_trace_command

    return make_trace_command(args)


def _layouts() -> list[str]:
    from kvcache.kit.driver import FAMILIES

    return list(FAMILIES)


def _cmd_record(args: argparse.Namespace) -> int:
    from kvcache.kit.trace import write_trace

    out = Path(args.out)
    if args.workload == "random":
        from kvcache.kit.record import record_random

        if args.layout not in _layouts():
            raise ValueError(f"--layout {args.layout!r}; choose from {', '.join(_layouts())}")
        header, records = record_random(args.layout, args.seed, args.impl)
        write_trace(out, header, records)
        what = f"a random {args.layout} sequence (seed {args.seed})"
        error = None
    else:
        from kvcache.kit.record import record_workload
        from kvcache.kit.workloads import make_workload

        if args.requests_from:
            from kvcache.kit.streams import workload_from_args

            workload = workload_from_args(args)
        else:
            workload = make_workload(args.workload, args.requests, args.seed)
        state_every = args.state_every
        if state_every < 0:  # auto: every call on small pools, sparser on big ones
            state_every = 1 if workload.num_blocks <= 256 else 500
        recording = record_workload(workload, args.impl, state_every)
        header, records, error = recording.header, recording.records, recording.error
        write_trace(out, header, records)
        steps = f", {recording.result.steps} steps" if recording.result else ""
        what = f"workload {workload.name} ({len(workload.requests)} requests{steps})"
    info = header["recorded_with"]
    size = out.stat().st_size
    print(
        f"recorded {len(records)} records of {what} on {info['impl']} "
        f"{info['version'] or ''} to {out} ({size / 1024:.0f} KiB)".replace("  ", " ")
    )
    if error is not None:
        print(
            f"error: the run stopped: {type(error).__name__}: {error} "
            f"(the trace ends with that call)",
            file=sys.stderr,
        )
        return 1
    return 0


def _trial_options(p: argparse.ArgumentParser, default: str) -> None:
    """``--compare`` and ``--features`` (kvcache.kit.levels, kvcache.kit.features)."""
    from kvcache.kit.features import LEVELS, parse_features

    def features(text: str) -> frozenset[str]:
        try:
            return parse_features(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("--features: ")) from None

    p.add_argument(
        "--compare",
        choices=LEVELS,
        default=None,
        help=f"what must match (docs/protocol.md; default {default}): admission "
        "(the same calls succeed or fail, free counts), hits (+ hit lengths), "
        "sharing (+ block ids up to one renaming), exact (+ ids, events, stats, "
        "hashes, states)",
    )
    p.add_argument(
        "--features",
        type=features,
        default=None,
        metavar="A,B,...",
        help="the features the subject supports (default: what it declares, else "
        "all); only those are drawn (docs/protocol.md lists them)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvcache``."""
    parser = Parser(
        prog="python -m kvcache",
        description="kvcache: a verified reference of vLLM's KV-cache manager (0.25.1, the "
        "default, and 0.33.0: kvcache.vllm_0_33), and a kit to put any KV-cache manager "
        "on trial: record traces, replay them, fuzz.",
        epilog="Implementations (--impl): kvcache, spec (the oracle), vllm (the installed "
        "vLLM), kvcache-0.33 and spec-0.33 (both under vLLM 0.33.0's profile), a package "
        "with a KVCacheManager, or module:factory, where factory has "
        "KVCacheManager's constructor signature. Trace format: docs/trace-format.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "bench",
        help="time implementations side by side on the same workloads",
        description="Run each workload on each implementation in one process, check the "
        "outputs are identical, and print manager time, per-method us and ratios.",
    )
    p.add_argument(
        "--workloads",
        default=None,
        type=workload_list,
        help=f"comma-separated, from {', '.join(WORKLOAD_NAMES)} (default: all; none "
        "with --requests-from)",
    )
    p.add_argument("--impls", default="", help="comma-separated (default: kvcache,vllm,spec)")
    p.add_argument("--repetitions", type=POSITIVE, default=3, help="alternating runs (default 3)")
    p.add_argument("--requests", type=POSITIVE, default=2000, help="requests per workload")
    p.add_argument(
        "--scaling",
        action="store_true",
        help="also measure per-call cost vs pool size and prompt length",
    )
    p.add_argument(
        "--traces",
        nargs="*",
        default=[],
        metavar="TRACE",
        help="also replay these traces (recorded from vLLM) on kvcache and vllm, timed",
    )
    p.add_argument(
        "--trace-requests",
        type=NON_NEGATIVE,
        default=0,
        metavar="N",
        help="also record chat, chat-swa and chat-mamba with N requests from vLLM now and "
        "replay them, timed (default 0: none)",
    )
    p.add_argument(
        "--trace-repetitions",
        type=POSITIVE,
        default=5,
        help="alternating trace replays (default 5)",
    )
    p.add_argument(
        "--trace-min-records",
        type=POSITIVE,
        default=10_000,
        metavar="N",
        help="a repetition replays a short trace until N records are replayed (default 10000)",
    )
    p.add_argument(
        "--trace-min-replays",
        type=POSITIVE,
        default=3,
        metavar="N",
        help="replays per repetition at least (default 3; each call's fastest counts)",
    )
    p.add_argument(
        "--json", default="", type=output_path, help="write results as JSON to this path"
    )
    p.add_argument("--plot", default="", type=output_path, help="draw a PNG bar chart to this path")
    add_stream_options(p, sweep_options=True)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "simulate",
        help="run a workload through the scheduler simulation and report over time",
        description="A built-in workload or a request stream (--requests-from) through the "
        "scheduler loop: per implementation, hit rates against the infinite-cache ideal, "
        "preemptions, queueing and usage, then step by step (--rows) and, with --plot, a "
        "chart. --impl a,b,... runs several on the same workload and compares every manager "
        "result call by call (exit 1 naming the first differing call); --pool-sizes sweeps "
        "pool sizes.",
    )
    p.add_argument("--workload", default="chat", choices=WORKLOAD_NAMES)
    p.add_argument(
        "--impl",
        default="kvcache",
        help=IMPL_HELP + "; several comma-separated run side by side and must agree",
    )
    p.add_argument("--requests", type=POSITIVE, default=2000, help="requests in the workload")
    p.add_argument("--rows", type=POSITIVE, default=20, help="table rows to print")
    p.add_argument(
        "--plot",
        default="",
        type=output_path,
        help=SIMULATE_PLOT_HELP,
    )
    add_stream_options(p, sweep_options=True)
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser(
        "record",
        help="record a scheduler simulation (or a random sequence) as a trace",
        description="Run a workload through the scheduler simulation (kvcache.kit.workloads."
        "simulate) on one implementation and write every manager call, with its arguments, "
        "its result and the abstract state after it, as a trace (JSON Lines; gzip when "
        "--out ends in .gz; format: docs/trace-format.md). Record on vllm to capture the "
        "reference's behaviour, then replay the trace on any implementation.",
        epilog="example: python -m kvcache record --impl vllm --workload chat-swa "
        "--requests 20 --out chat-swa.jsonl.gz",
    )
    p.add_argument("--impl", default="vllm", help=IMPL_HELP + " (default: vllm)")
    p.add_argument(
        "--workload",
        default="chat",
        choices=[*WORKLOAD_NAMES, "random"],
        help="what to run: a benchmark workload, or 'random' for one random scheduler "
        "sequence of --layout (default: chat)",
    )
    p.add_argument(
        "--requests", type=POSITIVE, default=20, help="requests in the workload (default 20)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload / sequence seed (default 0)")
    p.add_argument(
        "--layout",
        default="full+swa",
        metavar="LAYOUT",
        help="layout family of --workload random (default full+swa); one of: "
        + ", ".join(_layouts()),
    )
    p.add_argument(
        "--state-every",
        type=int_at_least(-1),
        default=-1,
        metavar="N",
        help="store the abstract state after every N-th call (0: never; default: every "
        "call for pools up to 256 blocks, else every 500th)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=output_path,
        help="trace file to write (.jsonl or .jsonl.gz)",
    )
    add_stream_options(p)
    p.set_defaults(func=_cmd_record)

    p = sub.add_parser(
        "make-trace",
        help="write a synthetic request stream (mooncake or jsonl) for simulate/bench/record",
        description="Write a small synthetic request stream in the Mooncake trace format "
        "or kvcache's own JSON lines (docs/request-streams.md): conversations sharing "
        "system prompts and earlier turns, Poisson arrivals. Tests and demos use it; "
        "no implementation runs, so module:factory names do not apply.",
        epilog="example: python -m kvcache make-trace --format mooncake --requests 200 "
        "--out demo.jsonl",
    )
    p.add_argument("--format", default="mooncake", choices=("mooncake", "jsonl"))
    p.add_argument("--requests", type=int, default=100, help="requests (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--mean-gap-ms", type=float, default=1000.0,
                   help="mean time between arrivals, ms (default 1000)")  # fmt: skip
    p.add_argument("--block-tokens", type=int, default=512,
                   help="jsonl: tokens per prefix_ids segment (default 512)")  # fmt: skip
    p.add_argument("--max-output", type=int, default=200, help="longest output (default 200)")
    p.add_argument("--out", required=True, help="file to write")
    p.set_defaults(func=_cmd_make_trace)

    p = sub.add_parser(
        "replay",
        help="replay traces on an implementation; report the first divergence",
        description="Replay each trace's calls on one implementation and compare every "
        "result, every exception and (where the trace holds one) the abstract state with "
        "what the trace recorded. At the first divergence print the call, the preceding "
        "calls, and both states. Exit status: 0 all identical, 1 a divergence, 2 a trace "
        "that cannot be read.",
        epilog="example: python -m kvcache replay tests/data/*.jsonl --impl mypkg.manager:make",
    )
    p.add_argument("traces", nargs="+", type=Path, metavar="TRACE", help="trace files")
    p.add_argument("--impl", default="kvcache", help=IMPL_HELP + " (default: kvcache)")
    p.add_argument(
        "--context",
        type=NON_NEGATIVE,
        default=8,
        metavar="N",
        help="preceding calls shown (default 8)",
    )
    p.add_argument("--full-states", action="store_true", help="print states uncut")
    _trial_options(p, "the trace's own (its header's compare), else exact")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser(
        "fuzz",
        help="run random scheduler sequences against the oracle or vLLM",
        description="Run random scheduler-like call sequences (every layout family: full "
        "attention, sliding window, chunked local, Mamba, cross attention, their hybrids, "
        "mixed block sizes, EAGLE) on --impl and on --reference in lockstep, comparing "
        "every result and the abstract state after every call. On the first divergence, "
        "shrink it to a minimal call sequence and write it as a trace that `replay` "
        "reproduces. Progress goes to stderr. Exit status: 0 no divergence, 1 a "
        "counterexample written, 2 a usage or harness error.",
        epilog="example: python -m kvcache fuzz --impl mypkg.manager:make --minutes 5",
    )
    p.add_argument("--impl", default="kvcache", help=IMPL_HELP + " (default: kvcache)")
    p.add_argument(
        "--reference",
        default="spec",
        help="what --impl must match: spec (the oracle, default) or vllm (the real vLLM)",
    )
    p.add_argument(
        "--minutes",
        type=float_above(0.0),
        default=None,
        help="time budget (default 1, or none with --sequences)",
    )
    p.add_argument(
        "--sequences", type=POSITIVE, default=None, help="stop after this many sequences"
    )
    p.add_argument("--seed", type=int, default=0, help="run seed (default 0): same seed, same run")
    p.add_argument(
        "--layouts",
        default="",
        metavar="A,B,...",
        help="layout families to cycle through (default: all): " + ", ".join(_layouts()),
    )
    p.add_argument(
        "--out",
        default="",
        type=output_path,
        help="counterexample file (default counterexample-<impl>-seed<N>.jsonl)",
    )
    p.add_argument(
        "--shrink-seconds",
        type=float_above(0.0, inclusive=True),
        default=60.0,
        help="time to shrink a failure (default 60)",
    )
    p.add_argument(
        "--census",
        action="store_true",
        help="do not stop at a divergence: tally every sequence's first difference by kind "
        "and ledger entry; group unknown ones into findings by root cause (first differing "
        "field and how, kinds of call of the shrunk trace), each with its shortest trace "
        "(--census-dir)",
    )
    p.add_argument(
        "--census-dir", default="census", help="where census counterexamples go (default census/)"
    )
    _trial_options(p, "exact")
    p.set_defaults(func=_cmd_fuzz)

    p = sub.add_parser(
        "release-check",
        help="replay traces on the installed vLLM and run a census; every difference "
        "must be in the ledger",
        description="Replay stored traces on the installed vLLM release and run a short "
        "census of random sequences against kvcache. Exit 1 when a difference is not a "
        "ledger entry (kvcache/kit/ledger.toml). Implementations: module:factory as for "
        "the other commands does not apply here (vLLM only).",
    )
    p.add_argument("traces", nargs="*", metavar="TRACE", help="trace files to replay")
    p.add_argument(
        "--census-seconds",
        type=float_above(0.0, inclusive=True),
        default=60.0,
        help="census time (default 60)",
    )
    p.add_argument("--census-sequences", type=NON_NEGATIVE, default=0,
                   help="census of this many sequences instead of a time (the same on any "
                        "machine; CI uses it)")  # fmt: skip
    p.add_argument("--census-dir", default="build/census", help="census counterexamples")
    p.add_argument("--seed", type=int, default=0, help="census seed (default 0)")
    p.add_argument("--json", default="", type=output_path, help="also write the result as JSON")
    p.set_defaults(func=_cmd_release_check)

    p = sub.add_parser(
        "bisect",
        help="for every ledger entry, the first release whose behaviour shows it",
        description="Run release-check (the traces and a census of a fixed number of "
        "sequences) in each release's venv with every ledger entry judging, then tell per "
        "entry and release: shows / like 0.25.1 / cannot build / not exercised, the "
        "measured range, and whether ledger.toml's range agrees (vLLM only: module:factory "
        "names do not apply). Exit 1 on a range that "
        "disagrees or an unknown difference. Venvs: make reference-X (default: .venv, "
        ".venv-vllm-*, .venv-0.33 of this checkout).",
    )
    p.add_argument("traces", nargs="*", metavar="TRACE", help="trace files to replay")
    p.add_argument("--python", action="append", default=[], metavar="PATH",
                   help="a release venv's python (repeat; default: this checkout's)")  # fmt: skip
    p.add_argument("--census-sequences", type=NON_NEGATIVE, default=300,
                   help="census sequences per release (default 300)")  # fmt: skip
    p.add_argument("--out", default="docs/bisect.md", type=output_path, help="the table")
    p.add_argument("--work-dir", default="build/bisect", help="records and census examples")
    p.add_argument("--reuse", action="store_true",
                   help="judge the last run's records again (after a ledger edit)")  # fmt: skip
    p.set_defaults(func=_cmd_bisect)

    p = sub.add_parser(
        "changelog",
        help="write the semantic changelog between two vLLM releases",
        description="Write a Markdown changelog between two vLLM releases: the API table "
        "(both venvs' Pythons), every ledger entry with its verdict and a minimal replay, "
        "the stored traces replayed on the newer release, a census. Run it with the newer "
        "release's Python; module:factory names do not apply (vLLM only). Or, with no "
        "vLLM installed, from two recorded trace sets (--from-traces, --to-traces): the "
        "ledger judges each pair of recordings record by record (no API table, no census).",
    )
    p.add_argument("traces", nargs="*", metavar="TRACE", help="trace files to replay")
    p.add_argument("--from", dest="from_version", default="", help="older release, 0.25.1")
    p.add_argument("--to", dest="to_version", default="", help="newer (installed) release")
    p.add_argument(
        "--from-traces",
        default="",
        metavar="DIR",
        help="instead of a venv: traces recorded on the older release (no vLLM needed)",
    )
    p.add_argument(
        "--to-traces",
        default="",
        metavar="DIR",
        help="the same scenarios recorded on the newer release (paired by file name)",
    )
    p.add_argument("--from-python", default="", help="the older release venv's python")
    p.add_argument(
        "--census-seconds",
        type=float_above(0.0, inclusive=True),
        default=60.0,
        help="census time (default 60)",
    )
    p.add_argument("--census-dir", default="build/census", help="census counterexamples")
    p.add_argument("--seed", type=int, default=0, help="census seed (default 0)")
    p.add_argument(
        "--out", default="", type=output_path, help="output (default docs/vllm-FROM-to-TO.md)"
    )
    p.set_defaults(func=_cmd_changelog)

    p = sub.add_parser(
        "effectiveness",
        help="the prefix-cache scenario suite: realized vs achievable hits, loss by rule",
        description="Run the scenario suite (kvcache.kit.effectiveness.SCENARIOS) on every "
        "family, EAGLE off and on, retention unset / 0 / 2 blocks where a group is sparse, "
        "lookahead none / slots / hash (LOOKAHEADS; hash where the release has it); print "
        "realized / achievable tokens and the loss each named rule explains. Exits 1 on an "
        "unexplained loss, a false hit, or a 0-hit lookup the pool could serve, unless "
        "--expect-flag names the row; and on an --expect-flag no row met.",
    )
    p.add_argument("--impl", default="kvcache", help=IMPL_HELP + " (default kvcache)")
    p.add_argument("--families", default="", help="comma-separated families (default: the suite)")
    p.add_argument(
        "--scenarios", default="", help="comma-separated scenarios (default: all of SCENARIOS)"
    )
    p.add_argument(
        "--lookaheads", default="", help="comma-separated of none,slots,hash (default: all)"
    )
    p.add_argument(
        "--eagle-master-switch",
        choices=("auto", "on", "off"),
        default="auto",
        help="whether use_eagle gates EAGLE groups in the judge: auto (default) reads it off "
        "the implementation's release (vLLM 0.30.0 and later: on; kvcache-0.33: on); on / "
        "off for an implementation whose release the kit cannot tell (module:factory)",
    )
    p.add_argument(
        "--expect-flag",
        action="append",
        default=[],
        metavar="FAMILY:SCENARIO[:eagle|no-eagle][:lookahead=X][:retention=Y]",
        help="a flagged row that does not fail the run (repeatable); one no row meets does",
    )
    p.add_argument(
        "--expect-known",
        action="store_true",
        help="expect the flags KNOWN_FLAGS lists for the implementation's release line",
    )
    p.add_argument(
        "--no-table", action="store_true", help="print only the summary and the failing flags"
    )
    p.add_argument("--json", default="", type=output_path, help="write the rows as JSON here")
    p.add_argument(
        "--plot", default="", type=output_path, help="draw realized vs achievable (PNG) here"
    )
    p.set_defaults(func=_cmd_effectiveness)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:  # TraceError is one: bad traces, bad names, bad arguments
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a third-party module a command needs
        from kvcache import _deps

        missing = _deps.third_party(exc)
        if missing is None:
            raise
        print(_deps.missing_line(missing), file=sys.stderr)
        return _deps.CLI_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
