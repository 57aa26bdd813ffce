"""Checking a vLLM release against the ledger, and writing the semantic changelog.

``release_check`` is the CI stage's body (``make check-0.33``): replay the stored
traces on the installed vLLM and run a short census against kvcache; every
difference must be a ledger entry. ``compare_trace_sets`` does the same without
any vLLM installed: two trace sets recorded on two releases (the same scenarios,
matched by file name) are compared record by record through the ledger, one
played back as the other's side (``RecordedSide``). ``changelog`` writes a readable Markdown
changelog between two releases: the API of ``KVCacheManager`` in each (read by
the two venvs' Pythons), every ledger entry with its verdict and a minimal
replay, and what the stored traces and a census saw.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.kit.driver import ReplayResult, describe_calls, replay_trace, trace_line
from kvcache.kit.fuzz import FuzzOutcome, fuzz
from kvcache.kit.ledger import Entry, load_ledger
from kvcache.kit.sides import Adapter, HarnessError, Side
from kvcache.kit.trace import Trace, read_trace

#: The methods whose signatures the changelog's API table compares.
API_CLASSES = (
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks"),
    ("vllm.v1.core.block_pool", "BlockPool"),
)


@dataclass
class TraceReport:
    """One stored trace replayed on a release: its verdict and the entries it met."""

    path: str
    verdict: str  # identical | known | cannot-build | divergence | unpaired (trace sets)
    entries: tuple[str, ...]
    detail: str
    records: int = 0
    #: The record where the replay stopped (a known or unknown difference), if it did.
    index: int | None = None


@dataclass
class ReleaseCheck:
    """What ``release_check`` found."""

    version: str
    traces: list[TraceReport] = field(default_factory=list)
    census: FuzzOutcome | None = None
    seconds: float = 0.0

    @property
    def unknown(self) -> list[str]:
        """Every difference no ledger entry explains, one line each."""
        lines = [
            f"{t.path}: {t.detail}"
            for t in self.traces
            if t.verdict in ("divergence", "cannot-build")
        ]
        if self.census is not None:
            lines += [f"census: {f.key}" for f in self.census.findings]
            found = {f.signature.split(" ", 1)[0] for f in self.census.findings}
            lines += [f"census: {k}" for k in self.census.unknown_kinds if k not in found]
        return lines

    def summary(self) -> str:
        """One line: traces by verdict, census figures, unknown differences."""
        verdicts = Counter(t.verdict for t in self.traces)
        parts = [
            f"release-check vLLM {self.version}: {len(self.traces)} traces ("
            + ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
            + ")"
        ]
        if self.census is not None:
            stats = self.census.stats
            parts.append(
                f"census {stats.sequences} sequences, {stats.calls} calls, "
                f"{len(self.census.census)} kinds"
            )
        parts.append(f"{len(self.unknown)} unknown differences in {self.seconds:.0f} s")
        return "; ".join(parts)


def trace_report(path: str, result: ReplayResult) -> TraceReport:
    """A replay result as a ``TraceReport``."""
    entries: tuple[str, ...] = tuple(sorted(result.known))
    if result.cannot_build is not None:
        known = result.cannot_build_known
        return TraceReport(path, result.verdict, (known,) if known else (), result.cannot_build)
    if result.mismatch is not None:
        mismatch = result.mismatch
        entries = tuple(sorted(set(entries) | set(mismatch.known)))
        label = "fixed" if result.fixed else "stops at"
        detail = f"{label} record #{mismatch.index} {mismatch.kind}"
        if mismatch.known:
            detail += f" ({', '.join(mismatch.known)})"
        return TraceReport(path, result.verdict, entries, detail, index=mismatch.index)
    return TraceReport(path, result.verdict, entries, "all records")


def release_check(
    traces: Sequence[str],
    census_seconds: float,
    census_dir: Path,
    seed: int = 0,
    stream: Any = None,
    census_sequences: int | None = None,
) -> ReleaseCheck:
    """Replay ``traces`` on the installed vLLM and run a census against kvcache.

    ``census_sequences`` bounds the census by a count of sequences instead of
    ``census_seconds`` (then the same sequences run on any machine, loaded or not).
    """
    from kvcache.kit.sides import resolve_adapter

    started = time.monotonic()
    version = str(resolve_adapter("vllm").version)
    check = ReleaseCheck(version)
    for path in traces:
        trace = read_trace(path)
        report = trace_report(path, replay_trace(trace, "vllm"))
        report.records = len(trace.records)
        check.traces.append(report)
    if census_sequences or census_seconds > 0:
        check.census = fuzz(
            "vllm",
            reference="kvcache",
            seconds=None if census_sequences else census_seconds,
            max_sequences=census_sequences or None,
            seed=seed,
            shrink_s=5.0,
            census=True,
            census_dir=census_dir,
            stream=stream,
        )
    check.seconds = time.monotonic() - started
    return check


# ---------------------------------------------------------------- two recorded trace sets


class RecordedSide(Side):
    """A recorded trace played back as a side: each call returns the outcome the
    trace recorded for it, and ``state()`` the state recorded after it.

    The calls must come in the trace's order with the trace's arguments; a call
    that differs (the two recordings' schedulers parted, after some result
    differed) is a ``HarnessError``, which a replay reports where it happens.
    """

    def __init__(self, trace: Trace) -> None:
        info = trace.header.get("recorded_with") or {}
        name = str(info.get("impl") or "recorded")
        version = info.get("version")
        self.adapter = Adapter(name, _no_manager, None if version is None else str(version))
        self.name = name
        self.config = trace.config
        self.trace = trace
        self.position = 0
        self.current: dict[str, Any] = {}

    def call(self, op: str, args: Any) -> Any:
        """The recorded result of the next record (raises what it recorded)."""
        if self.position >= len(self.trace.records):
            raise HarnessError(f"the other recording ends after {self.position} records")
        record = self.trace.records[self.position]
        if record["op"] != op or _canon_args(record["args"]) != _canon_args(args):
            raise HarnessError(
                f"the two recordings' calls part at record #{self.position}: "
                f"{op} here, {record['op']} in the other"
            )
        self.position += 1
        self.current = record
        if "raises" in record:
            raise _recorded_exception(str(record["raises"]), str(record.get("message", "")))
        return record.get("ok")

    def raw_state(self) -> dict[str, Any] | None:
        state = self.current.get("state")
        return dict(state) if isinstance(state, dict) else None

    def state(self) -> dict[str, Any] | None:
        return self.raw_state()  # recorded in canonical form already

    def num_free_blocks(self) -> int:
        state = self.current.get("state") or {}
        queue = state.get("free_queue") if isinstance(state, dict) else None
        return len(queue) if isinstance(queue, list) else -1

    def check_invariants(self) -> str | None:
        return None


def _no_manager(*args: Any, **kwargs: Any) -> None:
    """A recorded side builds no manager."""
    return None


def _canon_args(args: Any) -> str:
    return json.dumps(args, sort_keys=True, default=str)


_EXCEPTIONS: dict[str, type[Exception]] = {}


def _recorded_exception(name: str, message: str) -> Exception:
    """An exception whose type is called ``name`` (what a recording raised)."""
    if name not in _EXCEPTIONS:
        _EXCEPTIONS[name] = type(name, (Exception,), {})
    return _EXCEPTIONS[name](message)


def trace_version(trace: Trace) -> str:
    """The release a trace records (vLLM's version, or the line kvcache behaves like)."""
    info = trace.header.get("recorded_with") or {}
    if info.get("impl") == "vllm" and info.get("version"):
        return str(info["version"])
    return str(trace.header.get("behaves_like") or "0.25.1")


def _with_states_of(old: Trace, new: Trace) -> Trace:
    """``old`` without the states ``new`` did not record (only both are compared)."""
    records = []
    for i, record in enumerate(old.records):
        has_other = i < len(new.records) and "state" in new.records[i]
        records.append(record if has_other else {k: v for k, v in record.items() if k != "state"})
    return Trace(old.header, old.config, records)


def compare_trace_sets(old_dir: Path, new_dir: Path) -> ReleaseCheck:
    """Compare two recorded trace sets (the older release's first) file by file.

    Files are paired by name (``*.jsonl`` and ``*.jsonl.gz``); each pair is
    replayed as the older trace against the newer one played back, so the ledger
    judges every difference as in ``release_check``. A file in only one set is a
    ``unpaired`` report naming the set that lacks it (not a difference).

    Raises:
        ValueError: a folder that does not exist or holds no traces (naming it),
            or two traces of the same release line.
    """
    sets = []
    for name, folder in (("old_dir", old_dir), ("new_dir", new_dir)):
        if not folder.is_dir():
            raise ValueError(f"{name}={str(folder)!r} is not a folder of traces")
        files = {
            p.name: p for p in sorted(folder.iterdir()) if p.name.endswith((".jsonl", ".jsonl.gz"))
        }
        if not files:
            raise ValueError(f"{name}={str(folder)!r} holds no *.jsonl / *.jsonl.gz traces")
        sets.append(files)
    old_files, new_files = sets
    versions: set[str] = set()
    check = ReleaseCheck("?")
    started = time.monotonic()
    for name in sorted(set(old_files) | set(new_files)):
        if name not in new_files or name not in old_files:
            lacking = "newer" if name not in new_files else "older"
            path = str(old_files.get(name) or new_files[name])
            detail = f"not in the {lacking} trace set"
            check.traces.append(TraceReport(path, "unpaired", (), detail))
            continue
        old, new = read_trace(old_files[name]), read_trace(new_files[name])
        if trace_line(old) == trace_line(new):
            raise ValueError(
                f"{name}: both recordings are of release line {trace_line(old)}; "
                "compare traces of two release lines"
            )
        versions.add(trace_version(new))
        result = replay_trace(_with_states_of(old, new), "recorded", side=RecordedSide(new))
        report = trace_report(str(old_files[name]), result)
        report.records = len(old.records)
        check.traces.append(report)
    check.version = ", ".join(sorted(versions)) or "?"
    check.seconds = time.monotonic() - started
    return check


# ---------------------------------------------------------------- the changelog

API_PROBE = """
import inspect, json, importlib, os
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
import vllm
out = {"version": vllm.__version__, "classes": {}}
for module, name in %r:
    cls = getattr(importlib.import_module(module), name)
    methods = {}
    for attr, fn in sorted(vars(cls).items()):
        if attr.startswith("_") and attr != "__init__":
            continue
        target = fn.fget if isinstance(fn, property) else getattr(fn, "__func__", fn)
        if not callable(target):
            continue
        try:
            methods[attr] = str(inspect.signature(target))
        except (TypeError, ValueError):
            methods[attr] = "(...)"
    out["classes"][name] = methods
print(json.dumps(out))
"""


def api_of(python: str) -> dict[str, Any]:
    """The public method signatures of vLLM's manager classes, read by ``python``.

    Raises:
        ValueError: ``python`` cannot import vLLM (naming it and its error).
    """
    proc = subprocess.run(
        [python, "-c", API_PROBE % (API_CLASSES,)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ValueError(f"python={python!r} cannot read vLLM's API: {proc.stderr[-400:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def api_table(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Markdown rows: methods added, removed or with a changed signature."""
    rows = [
        "| class | method | " + old["version"] + " | " + new["version"] + " |",
        "|---|---|---|---|",
    ]
    for cls in sorted(set(old["classes"]) | set(new["classes"])):
        a, b = old["classes"].get(cls, {}), new["classes"].get(cls, {})
        for name in sorted(set(a) | set(b)):
            if a.get(name) == b.get(name):
                continue
            before = f"`{a[name]}`" if name in a else "—"
            after = f"`{b[name]}`" if name in b else "removed"
            if name not in a:
                after = f"added: `{b[name]}`"
            rows.append(f"| {cls} | `{name}` | {before} | {after} |")
    return rows


def _replay_block(path: Path, limit: int = 12, upto: int | None = None) -> list[str]:
    trace = read_trace(path)
    records = trace.records if upto is None else trace.records[:upto]
    calls = records[-limit:]
    first = len(records) - len(calls)
    return ["```", describe_calls(calls, first), "```"]


def changelog(
    old_version: str,
    new_version: str,
    check: ReleaseCheck,
    entries: Sequence[Entry] | None = None,
    old_python: str | None = None,
    new_python: str | None = None,
    census_dir: Path | None = None,
    trace_sets: tuple[str, str] | None = None,
) -> str:
    """The semantic changelog as Markdown (see the module docstring).

    ``trace_sets``: the two recorded trace folders ``check`` compared
    (``compare_trace_sets``), instead of traces replayed on an installed vLLM.
    """
    entries = list(load_ledger() if entries is None else entries)
    # Only what differs at the newer release: entries of releases in between only (a
    # range ending before it) are in docs/bisect.md.
    entries = [e for e in entries if e.covers(new_version)]
    out = [f"# vLLM {old_version} → {new_version}: what changed at the KV-cache manager", ""]
    if trace_sets is None:
        out += [
            "Generated by `python -m kvcache changelog --from "
            f"{old_version} --to {new_version}` from the known-differences ledger "
            "(kvcache/kit/ledger.toml), the stored traces (tests/data) replayed on "
            f"{new_version}, and a census of random scheduler sequences against kvcache "
            f"(which behaves like {old_version}). Do not edit by hand: regenerate.",
            "",
        ]
    else:
        out += [
            "Generated by `python -m kvcache changelog --from-traces "
            f"{trace_sets[0]} --to-traces {trace_sets[1]}` from the known-differences "
            f"ledger (kvcache/kit/ledger.toml) and two trace sets recorded on {old_version} "
            f"and {new_version}, compared record by record (no vLLM installed, so no API "
            "table and no census). Do not edit by hand: regenerate.",
            "",
        ]
    if old_python and new_python:
        out += ["## API", "", "Public methods whose signature changed:", ""]
        out += api_table(api_of(old_python), api_of(new_python))
        out.append("")
    by_verdict = Counter(e.verdict for e in entries)
    out += [
        "## Behaviour differences (the ledger)",
        "",
        f"{len(entries)} entries: "
        + ", ".join(f"{n} {v}" for v, n in sorted(by_verdict.items()))
        + ".",
        "",
    ]
    seen_in: dict[str, list[str]] = {}
    for report in sorted(check.traces, key=lambda r: (r.records, r.path)):  # shortest first
        for entry_id in report.entries:
            seen_in.setdefault(entry_id, []).append(report.path)
    census_counts: Counter[str] = Counter()
    if check.census is not None:
        census_counts.update(check.census.stats.known)
        for kind, n in check.census.census.items():
            if kind.startswith("known:"):
                for entry_id in kind[6:].split(","):
                    census_counts[entry_id] += n
    for entry in entries:
        verdict = entry.verdict + (f" {entry.fixed_in}" if entry.is_bug else "")
        out += [
            f"### `{entry.id}` — {verdict}",
            "",
            f"Releases: `{entry.releases}` (measured by `python -m kvcache bisect`, "
            "docs/bisect.md).",
            "",
            entry.what,
            "",
        ]
        if entry.upstream:
            out += [f"Upstream: {entry.upstream}.", ""]
        out += [f"Recognised by rule `{entry.rule}` (kvcache/kit/ledger.py).", ""]
        traces = seen_in.get(entry.id, [])
        if not traces and entry.rule == "adapter":  # every replay goes through the adapter
            replayed = [r for r in check.traces if r.verdict in ("identical", "known")]
            traces = [min(replayed, key=lambda r: (r.records, r.path)).path] if replayed else []
        more = f" (also in {len(traces) - 1} more)" if len(traces) > 1 else ""
        if traces and trace_sets is None:
            out += [
                "Replay (the shortest stored trace that shows it): `python -m kvcache replay "
                + traces[0]
                + " --impl vllm`"
                + more,
                "",
            ]
        elif traces and trace_sets is not None:
            report = next(r for r in check.traces if r.path == traces[0])
            where = f" at record #{report.index}" if report.index is not None else ""
            out += [f"Seen in the recorded pair `{Path(traces[0]).name}`{where}{more}.", ""]
            if report.index is not None:
                out += [
                    f"Minimal replay (the {trace_sets[0]} recording up to that record):",
                    "",
                    *_replay_block(Path(traces[0]), upto=report.index + 1),
                    "",
                ]
        example = None
        if census_dir is not None:
            candidate = census_dir / f"known_{entry.id}.jsonl"
            example = candidate if candidate.exists() else None
        if example is not None:
            out += [
                "Minimal replay (a census example recorded on kvcache, shrunk where the "
                "entry stops a sequence, else cut after the first call the entry "
                "normalises; the difference is at the last call):",
                "",
                *_replay_block(example),
                "",
            ]
        if census_counts.get(entry.id):
            out += [f"Census: met {census_counts[entry.id]} times.", ""]
        if entry.rule == "adapter":
            out += [
                f"Handled by the adapter (kvcache/kit/vllm_side.py: the release line's API "
                f"facts, read off the installed vLLM): every replay and census on "
                f"{new_version} goes through it.",
                "",
            ]
        elif not traces and example is None and not census_counts.get(entry.id):
            out += [
                "Not met by the stored traces or this census (a case the random "
                "scheduler does not make yet).",
                "",
            ]
    title = "Recorded trace pairs" if trace_sets else "Stored traces replayed on " + new_version
    out += [
        "## " + title,
        "",
        "| trace | verdict | ledger entries |",
        "|---|---|---|",
    ]
    for report in check.traces:
        out.append(
            f"| {report.path} | {report.verdict}: {report.detail} | "
            f"{', '.join(report.entries) or '—'} |"
        )
    out.append("")
    if check.census is not None:
        census = check.census
        out += [
            "## Census",
            "",
            f"{census.stats.sequences} sequences, {census.stats.calls} calls "
            f"({census.seconds:.0f} s). First difference of each sequence, by kind:",
            "",
            "| sequences | kind | counterexample |",
            "|---|---|---|",
        ]
        for kind, n in sorted(census.census.items(), key=lambda kv: (-kv[1], kv[0])):
            shrunk = census.census_examples.get(kind)
            where = f"{shrunk[1]} calls" if shrunk else "—"
            out.append(f"| {n} | `{kind}` | {where} |")
        out.append("")
        unknown = census.unknown_kinds
        out += [f"Unknown kinds (not yet in the ledger): {len(unknown)}.", ""]
        if census.findings:
            out += [
                "Unknown differences by root cause (first differing field and how; the "
                "kinds of call of the shrunk trace):",
                "",
                "| sequences | finding | counterexample |",
                "|---|---|---|",
            ]
            out += [f"| {f.sequences} | `{f.key}` | {f.calls} calls |" for f in census.findings]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def python_version_of(python: str) -> str:
    """``vllm.__version__`` as ``python`` sees it."""
    return str(api_of(python)["version"])
