"""Runs compared call by call, pool-size sweeps, and the ``simulate`` command.

A workload (built-in or a request stream, ``kvcache.kit.streams``) runs on each
implementation through the one scheduler loop (``kvcache.kit.workloads.simulate``);
every manager result is digested in windows of ``CHECKPOINT_CALLS`` calls, and where
two implementations' digests part, both are rerun keeping that window to name the
first differing call. A sweep does that at each pool size and reports hit rates
against the infinite-cache ideal, preemptions, queueing and usage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.kit.streams import StreamError, ideal_hits, min_pool_blocks, workload_from_args
from kvcache.kit.workloads import Impl, SimResult, Workload, simulate

#: Observations per checkpoint when comparing runs call by call.
CHECKPOINT_CALLS = 4096

# ---------------------------------------------------------------- comparing runs


class _Checkpoints:
    """An observer that keeps one digest per ``CHECKPOINT_CALLS`` observations, and
    (when asked) the observations of one window of them verbatim."""

    def __init__(self, keep: int = -1) -> None:
        self.count = 0
        self.digests: list[bytes] = []
        self.sha = hashlib.blake2b(digest_size=16)
        self.keep = keep
        self.kept: list[tuple[int, str, str, str]] = []

    def __call__(self, step: int, op: str, request_id: str, result: str) -> None:
        self.sha.update(f"{op}|{request_id}|{result}\n".encode())
        if self.count // CHECKPOINT_CALLS == self.keep:
            self.kept.append((step, op, request_id, result))
        self.count += 1
        if self.count % CHECKPOINT_CALLS == 0:
            self.digests.append(self.sha.digest())

    def finish(self) -> list[bytes]:
        return [*self.digests, self.sha.digest(), self.count.to_bytes(8, "big")]


def _run(
    workload: Workload,
    impl_name: str,
    observer: _Checkpoints,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> SimResult:
    from kvcache.kit.adapters import make_impl

    impl: Impl = make_impl(impl_name, workload)
    result = simulate(workload, impl, max_steps=10**9, observe=observer, progress=progress)
    if result.finished != len(workload.requests):
        raise RuntimeError(
            f"{workload.name} on {impl_name}: {result.finished} of "
            f"{len(workload.requests)} requests finished"
        )
    return result


def locate_difference(workload: Workload, a: str, b: str, window: int) -> str:
    """Rerun ``workload`` on ``a`` and ``b``, keeping observation window ``window``;
    describe the first call whose result differs."""
    runs = []
    for name in (a, b):
        observer = _Checkpoints(keep=window)
        _run(workload, name, observer)
        runs.append(observer.kept)
    offset = window * CHECKPOINT_CALLS
    for i, (x, y) in enumerate(zip(*runs, strict=False)):
        if x != y:
            return (
                f"first differing call #{offset + i} (step {x[0]}, {x[1]} of {x[2]}): "
                f"{a} returned {x[3][:200]}, {b} returned {y[3][:200]}"
                if x[:3] == y[:3]
                else f"first differing call #{offset + i}: {a} made step {x[0]} {x[1]} of "
                f"{x[2]}, {b} step {y[0]} {y[1]} of {y[2]}"
            )
    shorter = a if len(runs[0]) < len(runs[1]) else b
    return f"{shorter} stopped after call #{offset + min(map(len, runs)) - 1}, the other went on"


def _first_window(x: list[bytes], y: list[bytes]) -> int:
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if p != q:
            return i
    return min(len(x), len(y)) - 1


# ---------------------------------------------------------------- sweeps


@dataclass
class SweepRow:
    """One implementation at one pool size."""

    num_blocks: int
    impl: str
    result: SimResult
    step_ms: float

    @property
    def hit_rate_first(self) -> float:
        """Hit tokens over prompt tokens at each request's first admission."""
        return self.result.first_hit_tokens / max(1, self.result.first_prompt_tokens)

    @property
    def hit_rate_all(self) -> float:
        """Hit tokens over prompt tokens over all admissions (re-admissions too)."""
        return self.result.hit_tokens / max(1, self.result.prompt_tokens)

    @property
    def queue_mean_steps(self) -> float:
        """Mean steps from arrival to first admission."""
        return statistics.fmean(self.result.queue_steps) if self.result.queue_steps else 0.0

    @property
    def queue_p90_steps(self) -> float:
        """90th percentile of the steps from arrival to first admission."""
        q = sorted(self.result.queue_steps)
        return float(q[min(len(q) - 1, int(0.9 * len(q)))]) if q else 0.0

    @property
    def usage_mean(self) -> float:
        """Mean pool usage over the steps."""
        return statistics.fmean(s[1] for s in self.result.series) if self.result.series else 0.0

    @property
    def usage_peak(self) -> float:
        """Highest pool usage of any step."""
        return max((s[1] for s in self.result.series), default=0.0)


@dataclass
class Sweep:
    """A pool-size sweep: rows per (pool size, implementation), the ideal, the verdict."""

    workload: str
    num_requests: int
    ideal_hit_tokens: int
    prompt_tokens: int
    rows: list[SweepRow]
    differences: list[str]
    calls: int = 0

    @property
    def ideal(self) -> float:
        """The infinite-cache hit rate (``ideal_hits``)."""
        return self.ideal_hit_tokens / max(1, self.prompt_tokens)


def parse_pool_sizes(text: str) -> list[int]:
    """``A,B,C`` as pool sizes in blocks (each an integer >= 2).

    Raises:
        StreamError: naming the bad item.
    """
    sizes = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 2:
            raise StreamError(f"--pool-sizes {text!r}: {item!r} is not a pool size (integer >= 2)")
        sizes.append(int(item))
    return sizes


def parse_impls(text: str) -> list[str]:
    """``a,b`` as implementation names (no empty or repeated ones).

    Raises:
        StreamError: naming the bad list.
    """
    impls = [i.strip() for i in text.split(",")]
    if not all(impls) or len(set(impls)) != len(impls):
        raise StreamError(f"--impl {text!r}: give distinct comma-separated implementation names")
    return impls


def _progress_printer(label: str, total: int) -> Callable[[int, int, int, int], None]:
    clock = [0.0, 0.0]  # start, last line

    def report(step: int, arrived: int, running: int, waiting: int) -> None:
        now = time.monotonic()
        if step == 0:
            clock[:] = [now, now]
        start = clock[0]
        if now - clock[1] >= 5.0:
            clock[1] = now
            print(
                f"  {label}: step {step}, {arrived}/{total} arrived, {running} running, "
                f"{waiting} waiting ({now - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    return report


def sweep(
    workload: Workload,
    pool_sizes: Sequence[int],
    impls: Sequence[str],
    step_ms: float = 50.0,
    progress: bool = True,
) -> Sweep:
    """Run ``workload`` at each pool size on each implementation and compare them.

    At each pool size every implementation's results are compared call by call with
    the first one's (checkpoint digests; where they differ, both are rerun to name
    the first differing call, which goes to ``Sweep.differences``).

    Raises:
        StreamError: a pool too small for the longest request.
    """
    need = min_pool_blocks(workload)
    for size in pool_sizes:
        if size < need:
            raise StreamError(
                f"--pool-sizes: {size} blocks cannot hold the longest request (at least "
                f"{need} blocks of {workload.scheduler_block_size} tokens)"
            )
    hit, total = ideal_hits(workload)
    rows: list[SweepRow] = []
    differences: list[str] = []
    calls = 0
    for size in pool_sizes:
        sized = dataclasses.replace(workload, num_blocks=size)
        first: tuple[str, list[bytes]] | None = None
        for impl in impls:
            observer = _Checkpoints()
            report = (
                _progress_printer(f"{impl} pool {size}", len(workload.requests))
                if progress
                else None
            )
            result = _run(sized, impl, observer, report)
            calls += observer.count
            digests = observer.finish()
            rows.append(SweepRow(size, impl, result, step_ms))
            if first is None:
                first = (impl, digests)
            elif digests != first[1]:
                where = locate_difference(sized, first[0], impl, _first_window(first[1], digests))
                differences.append(f"pool {size}: {impl} differs from {first[0]}: {where}")
    return Sweep(workload.name, len(workload.requests), hit, total, rows, differences, calls)


def format_sweep(result: Sweep) -> str:
    """The sweep as a table, one row per (pool size, implementation)."""
    lines = [
        f"== {result.workload}: {result.num_requests} requests, {result.prompt_tokens} prompt "
        f"tokens; infinite-cache ideal hit rate {result.ideal:.4f}",
        f"{'pool':>8} {'impl':<10}{'hit first':>10}{'hit all':>9}{'ideal':>8}{'preempt':>9}"
        f"{'queue mean':>11}{'queue p90':>10}{'queue ms':>10}{'usage':>7}{'peak':>6}"
        f"{'steps':>8}{'manager s':>10}",
    ]
    for row in result.rows:
        r = row.result
        lines.append(
            f"{row.num_blocks:>8} {row.impl:<10}{row.hit_rate_first:>10.4f}"
            f"{row.hit_rate_all:>9.4f}{result.ideal:>8.4f}{r.preemptions:>9}"
            f"{row.queue_mean_steps:>11.1f}{row.queue_p90_steps:>10.0f}"
            f"{row.queue_mean_steps * row.step_ms:>10.0f}{row.usage_mean:>7.2f}"
            f"{row.usage_peak:>6.2f}{r.steps:>8}{r.manager_seconds:>10.2f}"
        )
    impls = list(dict.fromkeys(row.impl for row in result.rows))
    if len(impls) > 1:
        if result.differences:
            lines.extend(f"DIFFER: {d}" for d in result.differences)
        else:
            lines.append(
                f"outputs identical on {', '.join(impls)} at every pool size "
                f"({result.calls} manager results compared)"
            )
    lines.append("(queue: steps from arrival to first admission; usage: mean over steps)")
    return "\n".join(lines)


def plot_sweep(result: Sweep, path: str) -> str:
    """Hit rate against pool size per implementation (first admission solid, all
    admissions dashed), the infinite-cache ideal as a line; preemptions below.

    Returns:
        Where the plot went, or why none was drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, height_ratios=(2, 1))
    impls = list(dict.fromkeys(row.impl for row in result.rows))
    markers = "osD^vx+*"
    for i, impl in enumerate(impls):
        rows = [r for r in result.rows if r.impl == impl]
        sizes = [r.num_blocks for r in rows]
        mark = markers[i % len(markers)]
        ax.plot(
            sizes,
            [r.hit_rate_first for r in rows],
            marker=mark,
            label=f"{impl}: first admission",
            markersize=8 - 2 * i,
            alpha=0.8,
        )
        ax.plot(
            sizes,
            [r.hit_rate_all for r in rows],
            marker=mark,
            linestyle="--",
            label=f"{impl}: all admissions",
            markersize=8 - 2 * i,
            alpha=0.6,
        )
        ax2.plot(sizes, [r.result.preemptions for r in rows], marker=mark, label=impl)
    ax.axhline(
        result.ideal, color="gray", linestyle=":", label=f"infinite-cache ideal {result.ideal:.3f}"
    )
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_ylim(0, max(0.05, result.ideal * 1.1, *(r.hit_rate_all for r in result.rows)))
    ax.legend(fontsize=8)
    ax.set_title(f"{result.workload}: {result.num_requests} requests")
    ax2.set_ylabel("preemptions")
    ax2.set_xlabel("pool size (blocks)")
    ax2.set_xscale("log")
    ticks = sorted({r.num_blocks for r in result.rows})
    ax2.set_xticks(ticks, labels=[str(t) for t in ticks])
    ax2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def describe_layout(workload: Workload) -> str:
    """A workload's pool and groups in a few words: ``1024 blocks, full 16 + swa 16 (w 128)``."""
    groups = []
    for group in workload.groups:
        extra = ""
        if group.sliding_window:
            extra = f" (window {group.sliding_window})"
        elif group.attention_chunk_size:
            extra = f" (chunk {group.attention_chunk_size})"
        elif group.kind == "mamba":
            extra = f" ({group.mamba_cache_mode})"
        groups.append(f"{group.kind} {group.block_size}{extra}")
    return f"{workload.num_blocks} blocks, " + " + ".join(groups)


def _hit_rate(totals: tuple[int, int, int]) -> float:
    return totals[0] / max(1, totals[1])


def format_series(row: SweepRow, rows: int) -> str:
    """One run step by step, ``rows`` lines at most: the hit rate and preemptions so
    far, pool usage and free blocks, running and waiting requests."""
    lines = [
        f"{'step':>8}{'hit rate':>10}{'preempted':>11}{'usage':>8}{'free':>8}"
        f"{'running':>9}{'waiting':>9}"
    ]
    pairs = list(zip(row.result.series, row.result.totals, strict=True))
    for (step, usage, free, running, waiting), totals in pairs[:: max(1, -(-len(pairs) // rows))]:
        lines.append(
            f"{step:>8}{_hit_rate(totals):>10.3f}{totals[2]:>11}{usage:>8.2f}{free:>8}"
            f"{running:>9}{waiting:>9}"
        )
    return "\n".join(lines)


def plot_series(result: Sweep, title: str, path: str) -> str:
    """One pool size over time, implementations overlaid: hit rate and preemptions so
    far, pool usage, running and waiting requests.

    Returns:
        Where the plot went, or why none was drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    for n, row in enumerate(result.rows):
        style = {"linestyle": "-" if n == 0 else "--", "linewidth": 1.5 if n == 0 else 1.2}
        series, totals = row.result.series, row.result.totals
        steps = [s[0] for s in series]
        axes[0].plot(steps, [_hit_rate(t) for t in totals], f"C{n}", label=row.impl, **style)
        axes[1].plot(steps, [t[2] for t in totals], f"C{n}", label=row.impl, **style)
        axes[2].plot(steps, [s[1] for s in series], f"C{n}", label=row.impl, **style)
        for column, what, color in ((3, "running", "C2"), (4, "waiting", "C3")):
            queue = [s[column] for s in series]
            axes[3].plot(steps, queue, color, label=f"{what} ({row.impl})", **style)
    axes[0].set_ylabel("prefix hit rate\n(so far)")
    axes[1].set_ylabel("preemptions\n(so far)")
    axes[2].set_ylabel("pool usage")
    axes[3].set_ylabel("requests")
    axes[3].set_xlabel("scheduler step")
    for axis in axes:
        axis.legend(fontsize="small")
    fig.suptitle(f"{title} ({' vs '.join(row.impl for row in result.rows)})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def simulate_command(args: Any) -> int:
    """``simulate``: a built-in workload or a stream file, on one implementation or
    several compared call by call, at one pool size or a sweep of them.

    One pool size: the table, then each implementation step by step (``--rows``
    lines) and, with ``--plot``, over time. Several: the table and hit rate against
    pool size. Exit status 1 when implementations differ (the first differing call
    is named).
    """
    from kvcache.kit.workloads import make_workload

    impls = parse_impls(args.impl)
    if args.requests_from:
        workload = workload_from_args(args)
    else:
        workload = make_workload(args.workload, args.requests)
        if args.num_blocks:
            workload = dataclasses.replace(workload, num_blocks=args.num_blocks)
    sizes = parse_pool_sizes(args.pool_sizes) if args.pool_sizes else [workload.num_blocks]
    result = sweep(workload, sizes, impls, args.step_ms)
    layout = describe_layout(dataclasses.replace(workload, num_blocks=sizes[0]))
    if len(sizes) > 1:
        layout = layout.split(", ", 1)[1]
    print(f"{workload.name} on {', '.join(impls)} ({layout})")
    print(format_sweep(result))
    if len(sizes) == 1:
        for row in result.rows:
            print(f"-- {row.impl}\n{format_series(row, args.rows)}")
    if args.plot:
        title = f"{workload.name}: {layout}"
        print(
            plot_series(result, title, args.plot)
            if len(sizes) == 1
            else plot_sweep(result, args.plot)
        )
    return 1 if result.differences else 0
