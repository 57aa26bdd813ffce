"""``python -m kvcache``: benchmark and simulate KV-cache managers.

Run ``python -m kvcache --help`` for the commands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvcache.kit.workloads import WORKLOAD_NAMES


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvcache.kit import bench

    impls, note = bench.default_impls()
    if args.impls:
        impls = args.impls.split(",")
        note = ""
    if note:
        print(note)
    results = []
    for name in args.workloads.split(","):
        result = bench.bench_workload(name, impls, args.repetitions, args.requests)
        print(bench.format_workload(result), flush=True)
        results.append(result)
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
            f.write(bench.results_json(results, scaling_data))
        print(f"results written to {args.json}")
    if args.plot:
        print(bench.plot(results, scaling_data, args.plot))
    return 0 if all(r.identical for r in results) else 1


def _cmd_simulate(args: argparse.Namespace) -> int:
    from kvcache.kit.adapters import make_impl
    from kvcache.kit.workloads import make_workload, simulate

    workload = make_workload(args.workload, args.requests)
    result = simulate(workload, make_impl(args.impl, workload))
    print(
        f"{workload.name} on {args.impl}: {len(workload.requests)} requests, {result.steps} "
        f"steps, {result.preemptions} preemptions, prefix hit rate "
        f"{result.hit_tokens / max(1, result.prompt_tokens):.3f}, manager time "
        f"{result.manager_seconds:.3f} s"
    )
    print(f"{'step':>8}{'usage':>8}{'free':>8}{'running':>9}{'waiting':>9}")
    every = max(1, len(result.series) // args.rows)
    for step, usage, free, running, waiting in result.series[::every]:
        print(f"{step:>8}{usage:>8.2f}{free:>8}{running:>9}{waiting:>9}")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("no plot: matplotlib is not installed (pip install matplotlib)")
            return 0
        steps = [s[0] for s in result.series]
        fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
        axes[0].plot(steps, [s[1] for s in result.series])
        axes[0].set_ylabel("usage")
        axes[1].plot(steps, [s[2] for s in result.series])
        axes[1].set_ylabel("free blocks")
        axes[2].plot(steps, [s[3] for s in result.series], label="running")
        axes[2].plot(steps, [s[4] for s in result.series], label="waiting")
        axes[2].set_ylabel("requests")
        axes[2].set_xlabel("step")
        axes[2].legend()
        fig.suptitle(f"{workload.name} on {args.impl}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot written to {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvcache``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcache",
        description="kvcache: a verified reference of vLLM 0.25.1's KV-cache manager. "
        "Implementations (--impl) are kvcache, spec, vllm (the real package, when "
        "installed) or module:factory for your own.",
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
        default=",".join(WORKLOAD_NAMES),
        help=f"comma-separated, from {', '.join(WORKLOAD_NAMES)} (default: all)",
    )
    p.add_argument("--impls", default="", help="comma-separated (default: kvcache,vllm,spec)")
    p.add_argument("--repetitions", type=int, default=3, help="alternating runs (default 3)")
    p.add_argument("--requests", type=int, default=2000, help="requests per workload")
    p.add_argument(
        "--scaling",
        action="store_true",
        help="also measure per-call cost vs pool size and prompt length",
    )
    p.add_argument("--json", default="", help="write results as JSON to this path")
    p.add_argument("--plot", default="", help="draw a PNG bar chart to this path")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "simulate",
        help="run a workload through the scheduler simulation and report over time",
        description="Hit rate, usage, preemptions, free blocks and queue lengths over time.",
    )
    p.add_argument("--workload", default="chat", choices=WORKLOAD_NAMES)
    p.add_argument("--impl", default="kvcache", help="kvcache, spec, vllm or module:factory")
    p.add_argument("--requests", type=int, default=2000, help="requests in the workload")
    p.add_argument("--rows", type=int, default=20, help="table rows to print")
    p.add_argument("--plot", default="", help="draw usage/free/queues to this PNG")
    p.set_defaults(func=_cmd_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
