"""Call traces: the canonical form of results and states, and the trace file format.

A trace is JSON Lines (gzip-compressed when the file name ends in ``.gz``), the
format ``docs/trace-format.md`` specifies. In short:

* line 1, the header: ``{"record": "header", "format": "kvcache-trace",
  "version": 2, "config": {...}, "pythonhashseed": "0", "recorded_with": {...}}``;
* ``{"record": "request", "request_id": ..., "prompt_token_ids": [...], ...,
  "ok": BLOCK_HASHES}``: a new request (extra keys: ``cache_salt``, ``lora``,
  ``mm_features``, ``prompt_embeds``) and the block hashes the implementation computed for it;
* ``{"record": "call", "op": NAME, "args": {...}, "ok": RESULT | "raises":
  EXCEPTION_TYPE, "state": STATE}``: one manager call (or a scheduler-side
  change of a request: ``update_request``, ``append_output_token_ids``), what it
  returned or raised, and optionally the abstract state after it;
* the last line: ``{"record": "end", "num_records": N}``, so that a cut file is
  noticed.

In memory a trace is a ``Trace``: the header, the ``ManagerConfig`` and the
records as ``{"op", "args", "ok" | "raises", "state"?}`` dicts (a request
record becomes ``op == "add_request"``).

Results and states are stored in canonical form (``canon``): JSON values in
which ``bytes`` become ``{"bytes": HEX}``, tuples ``{"tuple": [...]}``, dicts
with non-string keys ``{"dict": [[key, value], ...]}`` (sorted) and events or
stats ``{"type": CLASS_NAME, "fields": {...}}``, so that a vLLM msgspec struct
and a kvcache dataclass with equal fields compare equal, and a tuple never
equals a list.
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import io
import json
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvcache.kit.config import ManagerConfig

TRACE_FORMAT = "kvcache-trace"
TRACE_VERSION = 2

#: Calls a trace may hold (besides request records): manager methods, the pool's
#: ``free_blocks`` after ``pop_blocks_for_free``, and scheduler-side request changes.
CALL_OPS = (
    "get_computed_blocks",
    "get_computed_blocks_for_connector",
    "allocate_slots",
    "free",
    "pop_blocks_for_free",
    "free_blocks",
    "evict_blocks",
    "reset_prefix_cache",
    "take_events",
    "take_new_block_ids",
    "get_num_common_prefix_blocks",
    "new_step_starts",
    "make_prefix_cache_stats",
    "usage",
    "get_num_free_blocks",
    "get_block_ids",
    "get_blocks",
    "get_block_ids_for_computed_tokens",
    "cache_blocks",
    "remove_skipped_blocks",
    "update_request",
    "append_output_token_ids",
    # the 0.33 line's scheduler duties
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "finalize_partial_tail_offloads",
    "record_blocks_for_zeroing",
)
REQUEST_FIELDS = (
    "request_id",
    "prompt_token_ids",
    "max_tokens",
    "cache_salt",
    "lora",
    "mm_features",
    "skip_reading_prefix_cache",
    "prompt_embeds",
    # the 0.33 line's (``kvcache.kit.driver.REQUEST_FIELDS_0_33``)
    "session_id",
    "kv_cache_report_mode",
)


class TraceError(ValueError):
    """A trace file that cannot be read: wrong format or version, cut, or malformed."""


# ---------------------------------------------------------------- canonical form


def canon(value: Any) -> Any:
    """The canonical, JSON-serialisable form of a result, event or state."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, enum.Enum):
        return canon(value.value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, tuple):
        return {"tuple": [canon(v) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: canon(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, "fields": fields}
    struct_fields = getattr(type(value), "__struct_fields__", None)
    if struct_fields is not None:  # a msgspec.Struct (vLLM's events)
        fields = {name: canon(getattr(value, name)) for name in struct_fields}
        return {"type": type(value).__name__, "fields": fields}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {str(k): canon(v) for k, v in value.items()}
        pairs = [[canon(k), canon(v)] for k, v in value.items()]
        return {"dict": sorted(pairs, key=lambda kv: json.dumps(kv[0], sort_keys=True))}
    if isinstance(value, Iterable):
        return [canon(v) for v in value]
    raise TypeError(f"cannot canonicalise {type(value).__name__}: {value!r}")


def pool_key_hex(hash_hex: str, group_id: int) -> str:
    """The canonical (hex) pool key of a block hash in a group: the hash followed by
    the group id as 4 big-endian bytes (vLLM's ``BlockHashWithGroupId``; the keys of
    ``abstract_state()["cached"]``)."""
    return f"{hash_hex}{group_id:08x}"


def canon_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical form of an ``abstract_state()`` dict (the keys of docs/contract.md)."""
    return {key: canon(state[key]) for key in sorted(state)}


def results_equal(a: Any, b: Any) -> bool:
    """Equality of canonical values; floats (``usage``) compare to 1e-12."""
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, bool) or isinstance(b, bool):
            return a is b
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            return False
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(results_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(results_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def short(value: Any, limit: int = 400) -> str:
    """Compact JSON for messages, cut at ``limit`` characters."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _entries(value: Any) -> dict[str, Any] | None:
    """A canonical mapping as {key text: value}, or None if ``value`` is not one."""
    if isinstance(value, dict) and set(value) == {"dict"}:
        return {short(k, 80): v for k, v in value["dict"]}
    if isinstance(value, dict) and not ({"bytes", "tuple", "type"} & set(value)):
        return {str(k): v for k, v in value.items()}
    return None


def value_diff(expected: Any, actual: Any, limit: int = 6) -> str:
    """Where two canonical values differ, briefly: the differing entries of a
    mapping, the first differing position of a list, else both values."""
    exp_map, act_map = _entries(expected), _entries(actual)
    if exp_map is not None and act_map is not None:
        keys = sorted(
            k
            for k in set(exp_map) | set(act_map)
            if k not in exp_map or k not in act_map or not results_equal(exp_map[k], act_map[k])
        )
        parts = [
            f"[{k}] expected {short(exp_map.get(k, '<absent>'), 120)}, "
            f"got {short(act_map.get(k, '<absent>'), 120)}"
            for k in keys[:limit]
        ]
        if len(keys) > limit:
            parts.append(f"... {len(keys) - limit} more")
        return "; ".join(parts)
    if isinstance(expected, list) and isinstance(actual, list):
        first = next(
            (
                i
                for i, (x, y) in enumerate(zip(expected, actual, strict=False))
                if not results_equal(x, y)
            ),
            min(len(expected), len(actual)),
        )
        lo = max(0, first - 2)
        return (
            f"lengths {len(expected)} / {len(actual)}, first difference at [{first}]: "
            f"expected [{lo}:] = {short(expected[lo : first + 4], 160)}, "
            f"got [{lo}:] = {short(actual[lo : first + 4], 160)}"
        )
    return f"expected {short(expected, 200)}, got {short(actual, 200)}"


def state_diff(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """One line per top-level key of two canonical states that differs."""
    return [
        f"  {key}: {value_diff(expected.get(key), actual.get(key))}"
        for key in sorted(set(expected) | set(actual))
        if not results_equal(expected.get(key), actual.get(key))
    ]


# ---------------------------------------------------------------- files


@dataclass
class Trace:
    """A trace in memory: the header, its manager config and the call records."""

    header: dict[str, Any]
    config: ManagerConfig
    records: list[dict[str, Any]]
    path: Path | None = None

    @property
    def hash_seed(self) -> str:
        return str(self.header.get("pythonhashseed", "0"))

    @property
    def recorded_with(self) -> str:
        info = self.header.get("recorded_with") or {}
        name = info.get("impl", "?")
        return f"{name} {info['version']}" if info.get("version") else str(name)


def make_header(
    config: ManagerConfig,
    recorded_with: str,
    version: str | None,
    hash_seed: str = "0",
    **extra: Any,
) -> dict[str, Any]:
    """The first record of a trace."""
    return {
        "record": "header",
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "recorded_with": {"impl": recorded_with, "version": version},
        **extra,
        "pythonhashseed": hash_seed,
        "config": config.to_record(),
    }


def to_line_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """An in-memory record (``op``/``args``/outcome) in its file form."""
    outcome = {k: record[k] for k in ("ok", "raises", "known") if k in record}
    if record["op"] == "add_request":
        return {"record": "request", **record["args"], **outcome}
    line: dict[str, Any] = {"record": "call", "op": record["op"], "args": record["args"]}
    line.update(outcome)
    if "state" in record:
        line["state"] = record["state"]
    return line


def _open_for_writing(path: Path) -> IO[str]:
    if path.suffix == ".gz":  # mtime=0: the same trace gives the same bytes
        return io.TextIOWrapper(gzip.GzipFile(path, "wb", mtime=0), encoding="utf-8")
    return path.open("w", encoding="utf-8")


def write_trace(
    path: Path | str, header: Mapping[str, Any], records: Sequence[Mapping[str, Any]]
) -> Path:
    """Write a trace: header, one line per record, the end record. Gzip if ``*.gz``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_for_writing(path) as f:
        f.write(json.dumps(dict(header)) + "\n")
        for record in records:  # keys in reading order: record, op, args, outcome, state
            f.write(json.dumps(to_line_record(record), separators=(",", ":")) + "\n")
        f.write(json.dumps({"record": "end", "num_records": len(records)}) + "\n")
    return path


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open("rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    try:
        with (
            io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
            if gzipped
            else path.open(encoding="utf-8")
        ) as stream:
            for number, line in enumerate(stream, start=1):
                if line.strip():
                    yield number, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{path}: the gzip stream is cut or corrupt ({exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a text trace ({exc.reason})") from None


def _check_header(path: Path, number: int, header: Any) -> dict[str, Any]:
    where = f"{path}: line {number}"
    if not isinstance(header, dict):
        raise TraceError(f"{where}: expected the header object, got {short(header, 80)}")
    if header.get("format") == "kvcache-trace/1" or header.get("kind") == "config":
        raise TraceError(
            f"{where}: trace format version 1 (kvcache before the kit); this kvcache reads "
            f"version {TRACE_VERSION}. Re-record it (make traces, or kvcache record)."
        )
    if header.get("record") != "header" or header.get("format") != TRACE_FORMAT:
        raise TraceError(
            f"{where}: not a kvcache trace (the first record must be "
            f'{{"record": "header", "format": "{TRACE_FORMAT}", ...}})'
        )
    version = header.get("version")
    if version != TRACE_VERSION:
        raise TraceError(
            f"{where}: unsupported trace version {version!r}; this kvcache reads version "
            f"{TRACE_VERSION} (docs/trace-format.md)"
        )
    return header


def _check_record(where: str, line: Any) -> dict[str, Any]:
    """A file record (request or call) as an in-memory record."""
    if not isinstance(line, dict):
        raise TraceError(f"{where}: expected a JSON object, got {short(line, 80)}")
    kind = line.get("record")
    outcome = {k: line[k] for k in ("ok", "raises", "state", "known") if k in line}
    known = outcome.get("known")
    if known is not None and not (
        isinstance(known, list) and all(isinstance(k, str) for k in known)
    ):
        raise TraceError(f"{where}: 'known' must be a list of ledger ids")
    if "ok" in outcome and "raises" in outcome:
        raise TraceError(f"{where}: a record has either 'ok' or 'raises', not both")
    if "raises" in outcome and not isinstance(outcome["raises"], str):
        raise TraceError(f"{where}: 'raises' must be an exception type name")
    if kind == "request":
        args = {
            k: v for k, v in line.items() if k not in ("record", "ok", "raises", "state", "known")
        }
        unknown = sorted(set(args) - set(REQUEST_FIELDS))
        if unknown:
            raise TraceError(f"{where}: unknown request field(s) {unknown}")
        if not isinstance(args.get("request_id"), str):
            raise TraceError(f"{where}: a request needs a string request_id")
        tokens = args.get("prompt_token_ids")
        embeds = args.get("prompt_embeds")
        if tokens is None and embeds is not None:
            pass  # a prompt given by its embeddings alone
        elif not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise TraceError(f"{where}: prompt_token_ids must be a list of ints")
        if embeds is not None and not (
            isinstance(embeds, list)
            and all(
                isinstance(row, list) and all(isinstance(x, int | float) for x in row)
                for row in embeds
            )
        ):
            raise TraceError(f"{where}: prompt_embeds must be a list of rows of numbers")
        return {"op": "add_request", "args": args, **outcome}
    if kind == "call":
        op = line.get("op")
        if op not in CALL_OPS:
            raise TraceError(f"{where}: unknown op {op!r}; a trace may call {', '.join(CALL_OPS)}")
        args = line.get("args", {})
        if not isinstance(args, dict):
            raise TraceError(f"{where}: args of {op} must be an object")
        return {"op": op, "args": args, **outcome}
    raise TraceError(
        f"{where}: unknown record type {kind!r} (expected header, request, call or end)"
    )


def read_trace(path: Path | str) -> Trace:
    """Read and validate a trace file (plain or gzip JSON Lines).

    Raises:
        TraceError: the file is missing, not a trace, of another version, cut
            short, or holds a malformed record or an unknown op; the message
            names the line.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    end: int | None = None
    for number, text in _lines(path):
        where = f"{path}: line {number}"
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(
                f"{where}: not valid JSON ({exc.msg}); the file may be cut short"
            ) from None
        if header is None:
            header = _check_header(path, number, line)
            continue
        if end is not None:
            raise TraceError(f"{where}: a record after the end record")
        if isinstance(line, dict) and line.get("record") == "end":
            end = number
            if line.get("num_records") != len(records):
                raise TraceError(
                    f"{where}: the end record counts {line.get('num_records')!r} records, "
                    f"the file holds {len(records)}"
                )
            continue
        records.append(_check_record(where, line))
    if header is None:
        raise TraceError(f"{path}: empty file, not a trace")
    if end is None:
        raise TraceError(
            f"{path}: cut short: no end record after {len(records)} records "
            "(was the recording interrupted?)"
        )
    try:
        config = ManagerConfig.from_record(header.get("config"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise TraceError(f"{path}: line 1: bad config: {exc}") from None
    return Trace(header, config, records, path)
