"""Bisecting the ledger over installed vLLM releases (``python -m kvcache bisect``).

Each release runs in its own venv (``make reference-X``): the stored traces and a
census of a fixed number of sequences, judged by *every* ledger entry whatever
its ``releases`` range (``ALL_RELEASES_ENV``), so an entry is recognised wherever
its behaviour shows. Per entry and release the result is one of:

* ``shows``: a trace or the census met the entry there;
* ``like 0.25.1``: a trace that shows the entry on some release ran there to its
  end without it (identical to kvcache, or differing only by other entries'
  normalisers) — exercised, and absent;
* ``cannot build``: every such trace needs a layout that release cannot build;
* ``not exercised``: nothing there could tell.

The measured range of an entry is from the first release that shows it to the
first later release that is ``like 0.25.1`` again (``">=0.29.0"``,
``">=0.26.0,<0.30.0"``), which is what ledger.toml's ``releases`` must say;
``bisect`` reports every entry whose ledger range differs from the measured one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.kit.ledger import ALL_RELEASES_ENV, Entry, in_range, load_ledger, version_key

SHOWS, LIKE_REFERENCE, CANNOT_BUILD, NOT_EXERCISED = (
    "shows",
    "like 0.25.1",
    "cannot build",
    "not exercised",
)


#: Ledger entries that are API facts, not behaviour: read off the release's classes
#: (``api_record``) rather than met by a trace. Entry id -> (method, parameter) or
#: the ``ReleaseLine`` fact that shows it.
API_FACTS: dict[str, tuple[str, str]] = {
    "ctor-max-in-flight-tokens": ("__init__", "max_in_flight_tokens"),
    "lookahead-arguments-added": ("__init__", "num_hash_lookahead_tokens"),
    "allocate-skip-zeroing-arg": ("allocate_slots", "skip_zeroing_group_ids"),
    "lookup-three-values": ("line", "lookup_values=3"),
}


def api_record() -> dict[str, list[str]]:
    """The installed vLLM's ``KVCacheManager`` parameters per method, and its release
    line's facts (``line``: ``name=value``), for ``API_FACTS``."""
    import inspect

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvcache.kit.vllm_side import VllmAdapter

    out = {
        name: list(inspect.signature(getattr(KVCacheManager, name)).parameters)
        for name in ("__init__", "allocate_slots", "get_computed_blocks")
    }
    line = VllmAdapter().line
    out["line"] = [
        f"lookup_values={line.lookup_values}",
        f"stats_at_admission={line.stats_at_admission}",
        f"retention_in_kv_cache_config={line.retention_in_kv_cache_config}",
    ]
    return out


def check_record(check: Any) -> dict[str, Any]:
    """A ``ReleaseCheck`` as plain JSON (what ``release-check --json`` writes)."""
    census = check.census
    return {
        "version": check.version,
        "api": api_record(),
        "traces": [
            {"path": t.path, "verdict": t.verdict, "entries": list(t.entries), "detail": t.detail}
            for t in check.traces
        ],
        "census": None
        if census is None
        else {
            "sequences": census.stats.sequences,
            "calls": census.stats.calls,
            "known": dict(census.stats.known),
            "kinds": dict(census.census),
            "unknown": census.unknown_kinds,
        },
        "unknown": check.unknown,
    }


def run_release(
    python: str, traces: Sequence[str], census_sequences: int, out_dir: Path, seed: int = 0
) -> dict[str, Any]:
    """``release-check`` of every trace and a census, in the venv of ``python``, with
    every ledger entry judging; its JSON record.

    Raises:
        ValueError: the run wrote no record (its output's tail is in the message).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    record_path = out_dir / f"release-check-{Path(python).parent.parent.name}.json"
    record_path.unlink(missing_ok=True)
    argv = [python, "-m", "kvcache", "release-check", "--json", str(record_path),
            "--census-sequences", str(census_sequences), "--seed", str(seed),
            "--census-dir", str(out_dir / f"census-{Path(python).parent.parent.name}"),
            *traces]  # fmt: skip
    env = dict(os.environ, **{ALL_RELEASES_ENV: "1"})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if not record_path.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise ValueError(
            f"python={python!r}: release-check wrote no record (rc {done.returncode}):\n{tail}"
        )
    record: dict[str, Any] = json.loads(record_path.read_text(encoding="utf-8"))
    return record


def statuses(records: Sequence[Mapping[str, Any]], entry: Entry) -> dict[str, str]:
    """Release -> ``SHOWS`` / ``LIKE_REFERENCE`` / ``CANNOT_BUILD`` / ``NOT_EXERCISED``
    for one entry (see the module docstring)."""
    telling = {  # the traces that show the entry on some release
        t["path"] for r in records for t in r["traces"] if entry.id in t["entries"]
    }
    out = {}
    for record in records:
        if entry.id in API_FACTS:
            method, fact = API_FACTS[entry.id]
            shows = fact in record.get("api", {}).get(method, ())
            out[record["version"]] = SHOWS if shows else LIKE_REFERENCE
            continue
        census = record.get("census") or {}
        met = {
            name
            for kind in census.get("kinds", {})
            if kind.startswith("known:")
            for name in kind.removeprefix("known:").split(",")
        }
        traces = [t for t in record["traces"] if t["path"] in telling]
        if (
            census.get("known", {}).get(entry.id)
            or entry.id in met
            or any(entry.id in t["entries"] for t in traces)
        ):
            out[record["version"]] = SHOWS
        elif any(t["detail"] == "all records" for t in traces):  # ran through, without it
            out[record["version"]] = LIKE_REFERENCE
        elif traces and all(t["verdict"] == "cannot-build" for t in traces):
            out[record["version"]] = CANNOT_BUILD
        else:
            out[record["version"]] = NOT_EXERCISED
    return out


def measured_range(status: Mapping[str, str]) -> str | None:
    """The range of releases an entry shows on: from the first that shows it to the
    first later one like 0.25.1; None when none shows it."""
    ordered = sorted(status, key=version_key)
    shown = [v for v in ordered if status[v] == SHOWS]
    if not shown:
        return None
    after = [v for v in ordered if version_key(v) > version_key(shown[-1])]
    gone = next((v for v in after if status[v] == LIKE_REFERENCE), None)
    return f">={shown[0]}" + (f",<{gone}" if gone else "")


@dataclass
class Bisected:
    """One ledger entry over the bisected releases."""

    entry: Entry
    status: dict[str, str]
    measured: str | None

    @property
    def agrees(self) -> bool:
        """Whether the ledger's range says the same as the measurement on every
        release that could tell (shows / like 0.25.1)."""
        for version, status in self.status.items():
            if status == SHOWS and not self.entry.covers(version):
                return False
            if status == LIKE_REFERENCE and self.entry.covers(version):
                return False
        return True


def bisect(
    records: Sequence[Mapping[str, Any]], entries: Sequence[Entry] | None = None
) -> list[Bisected]:
    """Every ledger entry's status per release and measured range."""
    entries = load_ledger() if entries is None else entries
    result = []
    for entry in entries:
        status = statuses(records, entry)
        result.append(Bisected(entry, status, measured_range(status)))
    return result


def markdown(records: Sequence[Mapping[str, Any]], bisected: Sequence[Bisected]) -> str:
    """The bisect table (docs/bisect.md): one row per entry, one column per release."""
    versions = sorted((r["version"] for r in records), key=version_key)
    mark = {SHOWS: "**x**", LIKE_REFERENCE: "·", CANNOT_BUILD: "n/b", NOT_EXERCISED: ""}
    lines = [
        "# The known-differences ledger, bisected over vLLM releases",
        "",
        "Generated by `make releases` (`python -m kvcache bisect`: each release's venv "
        "replays the stored traces and runs a census, every ledger entry judging; "
        "docs/releases.md). Do not edit by hand.",
        "",
        "| entry | ledger range | measured | " + " | ".join(versions) + " |",
        "|---|---|---|" + "---|" * len(versions),
    ]
    for b in bisected:
        cells = [mark[b.status[v]] for v in versions]
        flag = "" if b.agrees else " (differs)"
        lines.append(
            f"| {b.entry.id} | `{b.entry.releases}` | `{b.measured or '—'}`{flag} | "
            + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "**x**: the entry shows there; ·: exercised and absent (a trace that shows it "
        "elsewhere ran to its end there without it); n/b: those traces cannot be built "
        "there; empty: not exercised (its traces stop earlier, at another entry).",
        "",
        "| release | census sequences | calls | unknown differences |",
        "|---|---|---|---|",
    ]
    for record in sorted(records, key=lambda r: version_key(r["version"])):
        census = record.get("census") or {}
        unknown = record.get("unknown") or []
        lines.append(
            f"| {record['version']} | {census.get('sequences', 0)} | {census.get('calls', 0)} | "
            + ("; ".join(f"`{u}`" for u in unknown) if unknown else "0")
            + " |"
        )
    return "\n".join(lines) + "\n"


def default_pythons(root: Path = Path(".")) -> list[str]:
    """The venvs of this checkout that hold a vLLM release: ``.venv`` (0.25.1),
    ``.venv-vllm-*`` (``make reference-X``) and ``.venv-0.33``."""
    candidates = [root / ".venv", *sorted(root.glob(".venv-vllm-*")), root / ".venv-0.33"]
    return [str(c / "bin" / "python") for c in candidates if (c / "bin" / "python").exists()]


def main_bisect(
    pythons: Sequence[str],
    traces: Sequence[str],
    census_sequences: int,
    out: Path,
    work_dir: Path,
    stream: Any = None,
    reuse: bool = False,
) -> int:
    """Run every release, write the table to ``out``; 1 if an entry's ledger range
    disagrees with the measurement or a release has unknown differences. With
    ``reuse``, the records of an earlier run in ``work_dir`` are judged again by
    the current ledger, nothing is run."""
    stream = stream or sys.stdout
    records = []
    for python in pythons:
        if reuse:
            path = work_dir / f"release-check-{Path(python).parent.parent.name}.json"
            if not path.exists():
                raise ValueError(f"--reuse: no record {path} (run bisect without it first)")
            record = json.loads(path.read_text(encoding="utf-8"))
        else:
            record = run_release(python, traces, census_sequences, work_dir)
        census = record.get("census") or {}
        print(
            f"vLLM {record['version']}: {len(record['traces'])} traces, census "
            f"{census.get('sequences', 0)} sequences / {census.get('calls', 0)} calls, "
            f"{len(record['unknown'])} unknown",
            file=stream,
        )
        records.append(record)
    versions = [r["version"] for r in records]
    if len(set(versions)) != len(versions):
        raise ValueError(f"pythons: two venvs hold the same vLLM release ({versions})")
    bisected = bisect(records)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(records, bisected), encoding="utf-8")
    differing = [b for b in bisected if not b.agrees]
    for b in differing:
        print(
            f"RANGE {b.entry.id}: ledger {b.entry.releases!r}, measured {b.measured!r}",
            file=stream,
        )
    unknown = sum(len(r["unknown"]) for r in records)
    print(
        f"bisect over {', '.join(sorted(versions, key=version_key))}: {len(bisected)} entries, "
        f"{len(differing)} ranges differ, {unknown} unknown differences; table in {out}",
        file=stream,
    )
    return 1 if differing or unknown else 0


__all__ = ["ALL_RELEASES_ENV", "Bisected", "bisect", "in_range", "main_bisect", "markdown"]
