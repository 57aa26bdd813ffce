"""Side-by-side benchmark of KV-cache managers on the same call sequences.

Every workload runs on every implementation in one process, in alternating
order over several repetitions. The result digests must be equal (same block
ids, hits and failures); only then are timings reported: manager seconds per
implementation (median, min–max), microseconds per call for each method, and
the ratio ``other / kvcache`` per repetition (median, min–max), for each
kvcache build (``kvcache`` is the build imported, ``kvcache-pure`` the
pure-Python sources beside a compiled one), and the spec's steps per second.
Beside the manager's time, the requests' block hashing is timed
(``HashingTimer``: what a serving engine's scheduler also pays), with the
ratios of hashing and of the sum.

``bench_trace`` does the same for a trace recorded from vLLM: each
implementation replays the trace's calls (``kvcache.kit.driver.replay_trace``
first checks that it replays identically, states included), then the calls are
replayed again, timed: only the time inside the manager's own methods (and its
block pool's) counts (``kvcache.kit.sides.Stopwatch``), not the kit's request
building or result normalising, and each call's fastest time over a repetition's
replays (``bench_trace``). Every timed replay's results must equal the recorded
ones.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.kit.adapters import make_impl, vllm_available
from kvcache.kit.workloads import RequestSpec, Workload, make_workload, simulate


@dataclass
class ImplTiming:
    """Repetitions of one implementation on one workload."""

    manager_seconds: list[float] = field(default_factory=list)
    method_seconds: dict[str, list[float]] = field(default_factory=dict)
    method_calls: dict[str, int] = field(default_factory=dict)
    hashing_seconds: list[float] = field(default_factory=list)

    @property
    def total_seconds(self) -> list[float]:
        """Manager plus hashing seconds, one value per repetition (manager seconds
        alone where the requests' hashing could not be timed)."""
        if len(self.hashing_seconds) != len(self.manager_seconds):
            return list(self.manager_seconds)
        return [m + h for m, h in zip(self.manager_seconds, self.hashing_seconds, strict=True)]


class HashingTimer:
    """Times the requests' block hashing of one simulation.

    A request's hashes are made by its ``block_hasher`` (kvcache's
    ``get_request_block_hasher``, vLLM's, a third party's), which both ``Request``
    classes keep as ``_block_hasher`` and call from ``update_block_hashes`` when the
    request is built and whenever tokens are appended. ``wrap`` makes a workload's
    ``new_request`` swap in a timed copy of that hasher and hash the new request
    again from scratch under it, so every hash a request ever gets is timed.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.timed = True

    def wrap(self, new_request: Any) -> Any:
        perf = time.perf_counter

        def timed_new_request(spec: RequestSpec) -> Any:
            request = new_request(spec)
            hasher = getattr(request, "_block_hasher", None)
            if hasher is None or not hasattr(request, "update_block_hashes"):
                self.timed = False
                return request

            def timed_hasher(req: Any) -> Any:
                t = perf()
                hashes = hasher(req)
                self.seconds += perf() - t
                return hashes

            expected = list(request.block_hashes)
            request._block_hasher = timed_hasher
            request.block_hashes.clear()
            request.update_block_hashes()
            if list(request.block_hashes) != expected:
                raise AssertionError(f"{spec.request_id}: hashing again gave other hashes")
            return request

        return timed_new_request


@dataclass
class WorkloadResult:
    """Timings of all implementations on one workload, and whether they agreed."""

    workload: str
    num_requests: int
    steps: int
    preemptions: int
    hit_rate: float
    digests: dict[str, str]
    timings: dict[str, ImplTiming]
    #: Where the outputs first differ, when they do (``first_difference``).
    difference: str = ""

    @property
    def identical(self) -> bool:
        """Whether every implementation produced the same result digest."""
        return len(set(self.digests.values())) == 1

    def ratios(self, other: str, base: str = "kvcache", what: str = "manager") -> list[float]:
        """``other / base`` time, one value per repetition: of the manager's calls
        (``what="manager"``), of the requests' hashing (``"hashing"``) or of both
        (``"total"``); empty where hashing was not timed on both sides."""
        a, b = (self._seconds(i, what) for i in (other, base))
        if len(a) != len(b) or 0.0 in b:
            return []
        return [x / y for x, y in zip(a, b, strict=True)]

    def _seconds(self, impl: str, what: str) -> list[float]:
        timing = self.timings[impl]
        if what == "manager":
            return timing.manager_seconds
        if len(timing.hashing_seconds) != len(timing.manager_seconds):
            return []
        return timing.hashing_seconds if what == "hashing" else timing.total_seconds


def _median_min_max(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


class _LoggedManager:
    """A manager whose method calls are logged with their results (normalised), so
    that two implementations' runs of one workload can be compared call by call."""

    def __init__(self, manager: Any, log: list[tuple[str, str, Any]]) -> None:
        self._manager = manager
        self._log = log

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._manager, name)
        if name.startswith("_") or not callable(value):
            return value

        def logged(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            words = [_brief(a) for a in args] + [f"{k}={_brief(v)}" for k, v in kwargs.items()]
            self._log.append((name, ", ".join(words), _normal(result)))
            return result

        return logged


def _brief(value: Any) -> str:
    request_id = getattr(value, "request_id", None)
    if request_id is not None:
        return f"request {request_id!r}"
    if hasattr(value, "get_block_ids"):
        return f"blocks {_normal(value)}"
    return repr(value)


def _normal(value: Any) -> Any:
    """A manager result as plain data: block ids for blocks, tuples as lists."""
    if hasattr(value, "get_block_ids"):
        return [list(ids) for ids in value.get_block_ids()]
    if isinstance(value, tuple | list):
        return [_normal(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return type(value).__name__


def first_difference(workload: Workload, impls: list[str]) -> str:
    """Where the implementations' runs of ``workload`` first differ: the call (its
    number, scheduler step, method and arguments) and each one's result."""
    from kvcache.kit.trace import short

    logs: dict[str, list[tuple[str, str, Any]]] = {}
    for impl_name in impls:
        impl = make_impl(impl_name, workload)
        log = logs[impl_name] = []
        simulate(workload, dataclasses.replace(impl, manager=_LoggedManager(impl.manager, log)))
    base, base_log = impls[0], logs[impls[0]]
    for other in impls[1:]:
        other_log = logs[other]
        for index in range(max(len(base_log), len(other_log))):
            a = base_log[index] if index < len(base_log) else None
            b = other_log[index] if index < len(other_log) else None
            if a == b:
                continue
            shown = a or b
            assert shown is not None
            step = sum(call[0] == "new_step_starts" for call in base_log[:index]) - 1
            where = f"call #{index} (step {max(0, step)}) {shown[0]}({shown[1]})"
            if a is None or b is None:
                return f"{where}: only {other if a is None else base} makes it"
            if a[:2] != b[:2]:
                return f"{where}: {other} calls {b[0]}({b[1]}) instead"
            return f"{where}: {base} -> {short(a[2], 160)}, {other} -> {short(b[2], 160)}"
    return "the digests differ but no call does (a nondeterministic implementation?)"


def bench_workload(
    name: str,
    impls: list[str],
    repetitions: int = 3,
    num_requests: int = 2000,
    workload: Workload | None = None,
    progress: Callable[[str], None] | None = None,
) -> WorkloadResult:
    """Run one workload on each implementation ``repetitions`` times, alternating order.

    ``workload``, when given, is run instead of the built-in one named ``name`` (a
    request stream from a file: ``kvcache.kit.streams``). ``progress`` is told each
    run before it starts (``"chat: kvcache, repetition 1 of 3"``). Where the outputs
    differ, ``WorkloadResult.difference`` names the first differing call.

    Raises:
        ValueError: if ``repetitions`` < 1 or ``impls`` is empty.
    """
    if repetitions < 1 or not impls:
        raise ValueError(f"need repetitions >= 1 and impls, got {repetitions}, {impls}")
    if workload is None:
        workload = make_workload(name, num_requests)
    timings = {impl: ImplTiming() for impl in impls}
    digests: dict[str, str] = {}
    steps = preemptions = 0
    hit_rate = 0.0
    for rep in range(repetitions):
        order = impls if rep % 2 == 0 else impls[::-1]
        for impl_name in order:
            if progress is not None:
                progress(f"{name}: {impl_name}, repetition {rep + 1} of {repetitions}")
            impl = make_impl(impl_name, workload)
            hashing = HashingTimer()
            impl = dataclasses.replace(impl, new_request=hashing.wrap(impl.new_request))
            gc.collect()
            result = simulate(workload, impl)
            timing = timings[impl_name]
            timing.manager_seconds.append(result.manager_seconds)
            if hashing.timed:
                timing.hashing_seconds.append(hashing.seconds)
            for method, secs in result.method_seconds.items():
                timing.method_seconds.setdefault(method, []).append(secs)
            timing.method_calls = dict(result.method_calls)
            digests[impl_name] = result.digest
            steps, preemptions = result.steps, result.preemptions
            hit_rate = result.hit_tokens / max(1, result.prompt_tokens)
    outcome = WorkloadResult(
        name, len(workload.requests), steps, preemptions, hit_rate, digests, timings
    )
    if not outcome.identical:
        outcome.difference = first_difference(workload, impls)
    return outcome


def format_workload(result: WorkloadResult) -> str:
    """A readable table of one workload's timings and ratios."""
    lines = [
        f"== {result.workload}: {result.num_requests} requests, {result.steps} steps, "
        f"{result.preemptions} preemptions, hit rate {result.hit_rate:.2f}, outputs "
        + ("identical" if result.identical else f"DIFFER: first at {result.difference}")
    ]
    methods = sorted({m for t in result.timings.values() for m in t.method_seconds})
    header = f"{'impl':<10}{'manager s (min-max)':>26}" + "".join(
        f"{m + ' us':>26}" for m in methods
    )
    lines.append(header)
    for impl, timing in result.timings.items():
        med, lo, hi = _median_min_max(timing.manager_seconds)
        row = f"{impl:<10}{f'{med:.3f} ({lo:.3f}-{hi:.3f})':>26}"
        for m in methods:
            calls = max(1, timing.method_calls.get(m, 1))
            per_call = statistics.median(timing.method_seconds.get(m, [0.0])) / calls * 1e6
            row += f"{per_call:>26.2f}"
        lines.append(row)
    hashed = [i for i, t in result.timings.items() if t.hashing_seconds]
    if hashed:
        lines.append(f"{'impl':<14}{'manager s':>12}{'hashing s':>12}{'sum s':>12}")
        for impl in hashed:
            timing = result.timings[impl]
            lines.append(
                f"{impl:<14}{statistics.median(timing.manager_seconds):>12.3f}"
                f"{statistics.median(timing.hashing_seconds):>12.3f}"
                f"{statistics.median(timing.total_seconds):>12.3f}"
            )
    bases = [b for b in ("kvcache", "kvcache-pure") if b in result.timings]
    for base in bases:
        for impl in result.timings:
            if impl in bases:
                continue
            med, lo, hi = _median_min_max(result.ratios(impl, base))
            line = f"ratio {impl}/{base}: {med:.2f} (min {lo:.2f}, max {hi:.2f})"
            for what in ("hashing", "total"):
                ratios = result.ratios(impl, base, what)
                if ratios:
                    med, lo, hi = _median_min_max(ratios)
                    label = "sum" if what == "total" else what
                    line += f"; {label} {med:.2f} ({lo:.2f}-{hi:.2f})"
            lines.append(line)
    if "spec" in result.timings:
        med = statistics.median(result.timings["spec"].manager_seconds)
        lines.append(f"spec: {result.steps / med:.0f} scheduler steps per second of manager time")
    return "\n".join(lines)


# ---------------------------------------------------------------- traces


@dataclass
class TraceResult:
    """Timings of all implementations replaying one trace, and whether they agreed."""

    trace: str
    num_records: int
    layout: str
    replays_per_repetition: int
    digests: dict[str, str]
    manager_seconds: dict[str, list[float]]
    timed_calls: int = 0
    timer_overhead: float = 0.0

    @property
    def identical(self) -> bool:
        """Whether every implementation returned the same results (the recorded ones)."""
        return len(set(self.digests.values())) == 1

    def ratios(self, other: str, base: str = "kvcache", net: bool = False) -> list[float]:
        """``other / base`` manager time, one value per repetition; ``net``: with the
        stopwatch's own cost (``timer_overhead`` per timed call) taken off both."""
        cost = self.timer_overhead * self.timed_calls if net else 0.0
        a, b = self.manager_seconds[other], self.manager_seconds[base]
        return [(x - cost) / (y - cost) for x, y in zip(a, b, strict=True)]


class TraceReplayError(AssertionError):
    """An implementation did not replay a benchmarked trace identically."""


def timed_replay(trace: Any, impl: str) -> tuple[list[float], str]:
    """Replay ``trace``'s calls on a fresh ``impl``; return the seconds of each timed
    manager call and a digest of the results.

    Raises:
        TraceReplayError: a result differs from the recorded one.
    """
    from kvcache.kit.driver import compare_outcomes, outcome
    from kvcache.kit.sides import Stopwatch, make_side

    side = make_side(impl, trace.config, trace.hash_seed)
    stopwatch = side.timing = Stopwatch()
    sha = hashlib.sha256()
    # The trace's records (and everything else alive now) out of the collector's
    # reach: a full collection walking a big trace would otherwise land inside
    # whichever manager call happens to trigger it.
    gc.collect()
    gc.freeze()
    try:
        for index, record in enumerate(trace.records):
            expected = {k: record[k] for k in ("ok", "raises") if k in record}
            actual = outcome(side, record["op"], record["args"])
            ok, note = compare_outcomes(expected, actual)
            if not ok:
                raise TraceReplayError(f"{impl}: record {index} ({record['op']}): {note}")
            # Results, and that a call raised (its type is checked above, where vLLM's
            # assert may meet kvcache's ValueError; the messages differ).
            sha.update(json.dumps(actual.get("ok", "raised"), sort_keys=True).encode())
    finally:
        gc.unfreeze()
    return stopwatch.durations, sha.hexdigest()


def record_bench_trace(workload: str, num_requests: int) -> Any:
    """A trace of ``workload`` with ``num_requests`` requests recorded from vLLM in this
    process (``kvcache.kit.record.record_workload``; a state every 200th call)."""
    from kvcache.kit.config import ManagerConfig
    from kvcache.kit.record import record_workload
    from kvcache.kit.trace import Trace

    recording = record_workload(make_workload(workload, num_requests), "vllm", 200)
    if recording.error is not None:
        raise recording.error
    config = ManagerConfig.from_record(recording.header["config"])
    path = Path(f"{workload}-{num_requests}-requests (recorded now)")
    return Trace(recording.header, config, recording.records, path)


def bench_trace(
    trace: Any,
    impls: list[str],
    repetitions: int = 5,
    min_records: int = 10_000,
    min_replays: int = 3,
) -> TraceResult:
    """Replay one trace (a ``Trace`` or a path) on each implementation ``repetitions``
    times, alternating order.

    Each implementation first replays the trace as ``python -m kvcache replay``
    does (results and recorded states); then each timed repetition replays its
    calls again, on a fresh manager, ``min_replays`` times or as often as it takes
    to replay ``min_records`` records, the implementations taking turns replay by
    replay. A repetition's manager time is the sum over the calls of each call's
    fastest time in its replays: the replays make the same calls, and on a shared
    machine a call that was descheduled midway (milliseconds, against a
    microsecond call) would otherwise weigh more than all the others.

    Raises:
        ValueError: if ``repetitions`` < 1 or ``impls`` is empty.
        TraceReplayError: if an implementation does not replay the trace identically.
    """
    from kvcache.kit.driver import replay_trace
    from kvcache.kit.trace import read_trace

    if repetitions < 1 or not impls:
        raise ValueError(f"need repetitions >= 1 and impls, got {repetitions}, {impls}")
    if isinstance(trace, (str, Path)):
        trace = read_trace(trace)
    name = trace.path.name if trace.path is not None else "trace"
    for impl in impls:
        checked = replay_trace(trace, impl)
        if checked.verdict != "identical":
            raise TraceReplayError(
                f"{name}: {impl} does not replay identically ({checked.verdict}): "
                f"{checked.mismatch or checked.cannot_build}"
            )
    from kvcache.kit.sides import Stopwatch

    replays = max(min_replays, -(-min_records // max(1, len(trace.records))))
    seconds: dict[str, list[float]] = {impl: [] for impl in impls}
    digests: dict[str, str] = {}
    calls: set[int] = set()
    for rep in range(repetitions):
        fastest: dict[str, list[float]] = {}
        for replay in range(replays):
            for impl in impls if (rep + replay) % 2 == 0 else impls[::-1]:
                durations, digests[impl] = timed_replay(trace, impl)
                calls.add(len(durations))
                if len(calls) != 1:
                    raise TraceReplayError(
                        f"{name}: the implementations made {sorted(calls)} timed calls"
                    )
                best = fastest.setdefault(impl, durations)
                fastest[impl] = [min(a, b) for a, b in zip(best, durations, strict=True)]
        for impl in impls:
            seconds[impl].append(sum(fastest[impl]))
    return TraceResult(
        name,
        len(trace.records),
        trace.config.layout,
        replays,
        digests,
        seconds,
        calls.pop(),
        Stopwatch.overhead(),
    )


def format_trace(result: TraceResult) -> str:
    """A readable table of one trace's replay timings and ratios."""
    lines = [
        f"== trace {result.trace} ({result.layout}): {result.num_records} records, "
        f"{result.replays_per_repetition} replays per repetition (each call's fastest "
        "counts), outputs "
        + ("identical" if result.identical else f"DIFFER {result.digests}")
    ]
    for impl, secs in result.manager_seconds.items():
        med, lo, hi = _median_min_max(secs)
        lines.append(f"{impl:<14}manager s per replay {med:.5f} ({lo:.5f}-{hi:.5f})")
    bases = [b for b in ("kvcache", "kvcache-pure") if b in result.manager_seconds]
    for base in bases:
        for impl in result.manager_seconds:
            if impl not in bases:
                med, lo, hi = _median_min_max(result.ratios(impl, base))
                net = statistics.median(result.ratios(impl, base, net=True))
                lines.append(
                    f"ratio {impl}/{base}: {med:.2f} (min {lo:.2f}, max {hi:.2f}); "
                    f"net of the stopwatch {net:.2f}"
                )
    lines.append(
        f"{result.timed_calls} timed calls per replay; the stopwatch's own cost "
        f"{result.timer_overhead * 1e9:.0f} ns per call is in the manager seconds"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- scaling


def _scaling_workload(num_blocks: int, block_size: int = 16) -> Workload:
    from kvcache.kit.workloads import GroupLayout

    return Workload(
        name=f"scaling-{num_blocks}",
        num_blocks=num_blocks,
        groups=(GroupLayout("full", block_size),),
        max_model_len=1 << 20,
        token_budget=1 << 20,
        max_num_seqs=1 << 20,
        requests=(),
    )


def measure_per_call(
    impl_name: str, num_blocks: int, prompt_len: int, rounds: int = 20
) -> dict[str, float]:
    """Microseconds per get_computed_blocks / allocate_slots / free for one prompt
    length in a pool of ``num_blocks``: a cached prefix of ``prompt_len`` tokens is
    hit, a fresh prompt of that length allocated, and both freed, ``rounds`` times."""
    workload = _scaling_workload(num_blocks)
    impl = make_impl(impl_name, workload)
    m = impl.manager
    base = RequestSpec("warm", tuple(range(prompt_len + 1)), 1, 0)
    warm = impl.new_request(base)
    m.allocate_slots(warm, warm.num_tokens)
    m.free(warm)
    perf = time.perf_counter
    totals = {"get_computed_blocks": 0.0, "allocate_slots": 0.0, "free": 0.0}
    for r in range(rounds):
        hit_req = impl.new_request(RequestSpec(f"h{r}", base.prompt_token_ids, 1, 0))
        fresh = impl.new_request(
            RequestSpec(f"f{r}", tuple(10**6 + r * prompt_len + i for i in range(prompt_len)), 1, 0)
        )
        t = perf()
        found = m.get_computed_blocks(hit_req)  # 2 values, or 3 from vLLM 0.26.0 on
        totals["get_computed_blocks"] += perf() - t
        hits, n = found[0], found[1]
        if n < prompt_len - workload.groups[0].block_size:
            raise RuntimeError(f"expected a hit of ~{prompt_len} tokens, got {n}")
        m.allocate_slots(hit_req, hit_req.num_tokens - n, n, hits)
        t = perf()
        out = m.allocate_slots(fresh, fresh.num_tokens)
        totals["allocate_slots"] += perf() - t
        if out is None:
            raise RuntimeError("pool too small for the scaling run")
        t = perf()
        m.free(fresh)
        totals["free"] += perf() - t
        m.free(hit_req)
    return {k: v / rounds * 1e6 for k, v in totals.items()}


def scaling(impls: list[str], pool_sizes: list[int], prompt_lens: list[int]) -> dict[str, Any]:
    """Per-call cost against pool size (prompt 1,024) and against prompt length
    (pool sized to fit); each figure is the fastest of three measurements, so a
    busy machine inflates it less."""

    def best_of_3(impl: str, num_blocks: int, prompt_len: int) -> dict[str, float]:
        runs = [measure_per_call(impl, num_blocks, prompt_len) for _ in range(3)]
        return {k: min(r[k] for r in runs) for k in runs[0]}

    out: dict[str, Any] = {"pool": {}, "prompt": {}}
    for impl in impls:
        out["pool"][impl] = {n: best_of_3(impl, n, 1024) for n in pool_sizes}
        out["prompt"][impl] = {
            p: best_of_3(impl, max(4096, 4 * p // 16 + 64), p) for p in prompt_lens
        }
    return out


def format_scaling(data: dict[str, Any]) -> str:
    """Tables of the scaling figures (microseconds per call)."""
    lines = []
    for axis, label in (("pool", "pool blocks"), ("prompt", "prompt tokens")):
        lines.append(f"== per-call us vs {label}")
        for impl, rows in data[axis].items():
            for size, cost in rows.items():
                lines.append(
                    f"{impl:<10}{size:>10}  " + "  ".join(f"{k}={v:9.1f}" for k, v in cost.items())
                )
    return "\n".join(lines)


# ---------------------------------------------------------------- plots and entry


def plot(results: list[WorkloadResult], scaling_data: dict[str, Any] | None, path: str) -> str:
    """Draw manager time per workload and implementation (and scaling), to a PNG.

    Returns:
        A note: where the file went, or why none was written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    ncols = 3 if scaling_data else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5), squeeze=False)
    ax = axes[0][0]
    impls = list(results[0].timings) if results else []
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        xs = [j + i * width for j in range(len(results))]
        ys = [statistics.median(r.timings[impl].manager_seconds) for r in results]
        ax.bar(xs, ys, width, label=impl)
    ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(results))])
    ax.set_xticklabels([r.workload for r in results], rotation=20)
    ax.set_ylabel("manager seconds (median)")
    ax.set_title("Manager time per workload")
    ax.legend()
    if scaling_data:
        for col, axis in ((1, "pool"), (2, "prompt")):
            ax = axes[0][col]
            for impl, rows in scaling_data[axis].items():
                sizes = list(rows)
                for method in ("get_computed_blocks", "allocate_slots", "free"):
                    ax.plot(
                        sizes,
                        [rows[s][method] for s in sizes],
                        marker="o",
                        label=f"{impl} {method}",
                    )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("pool blocks" if axis == "pool" else "prompt tokens")
            ax.set_ylabel("us per call")
            ax.set_title(f"Per-call cost vs {'pool size' if axis == 'pool' else 'prompt length'}")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def default_impls() -> tuple[list[str], str]:
    """kvcache (both builds when the compiled one is loaded) and spec, plus vllm
    when importable; and a note saying which builds these are."""
    import kvcache

    ours = ["kvcache", "kvcache-pure"] if kvcache.COMPILED else ["kvcache"]
    build = (
        "kvcache = the compiled build, kvcache-pure = the pure-Python sources"
        if kvcache.COMPILED
        else "note: kvcache is the pure-Python build (no current compiled build loaded)"
    )
    if vllm_available():
        return [*ours, "vllm", "spec"], build
    return [*ours, "spec"], f"{build}; note: vLLM 0.25.1 is not installed"


def results_json(
    results: list[WorkloadResult],
    scaling_data: dict[str, Any] | None,
    trace_results: list[TraceResult] | None = None,
) -> str:
    """Machine-readable results for tracking over time."""
    payload = {
        "workloads": [
            {
                "workload": r.workload,
                "identical": r.identical,
                "digests": r.digests,
                "steps": r.steps,
                "preemptions": r.preemptions,
                "hit_rate": r.hit_rate,
                "manager_seconds": {i: t.manager_seconds for i, t in r.timings.items()},
                "method_seconds": {i: t.method_seconds for i, t in r.timings.items()},
                "method_calls": {i: t.method_calls for i, t in r.timings.items()},
                "hashing_seconds": {i: t.hashing_seconds for i, t in r.timings.items()},
                "ratios": {
                    i: r.ratios(i) for i in r.timings if i != "kvcache" and "kvcache" in r.timings
                },
                "hashing_ratios": {
                    i: r.ratios(i, what="hashing")
                    for i in r.timings
                    if i != "kvcache" and "kvcache" in r.timings
                },
                "sum_ratios": {
                    i: r.ratios(i, what="total")
                    for i in r.timings
                    if i != "kvcache" and "kvcache" in r.timings
                },
            }
            for r in results
        ],
        "scaling": scaling_data,
        "traces": [
            {
                "trace": t.trace,
                "layout": t.layout,
                "num_records": t.num_records,
                "replays_per_repetition": t.replays_per_repetition,
                "timed_calls": t.timed_calls,
                "timer_overhead_s": t.timer_overhead,
                "identical": t.identical,
                "manager_seconds": t.manager_seconds,
                "ratios": {
                    i: t.ratios(i)
                    for i in t.manager_seconds
                    if i != "kvcache" and "kvcache" in t.manager_seconds
                },
            }
            for t in trace_results or []
        ],
    }
    return json.dumps(payload, indent=1)
