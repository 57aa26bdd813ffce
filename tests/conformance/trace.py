"""Call traces: the canonical form of results and states, and the JSON Lines file format.

A trace file (``tests/data/*.jsonl``) holds one JSON object per line:

* line 1, the config: ``{"kind": "config", "format": "kvcache-trace/1", ...}``
  with the ``ManagerConfig`` fields, the ``PYTHONHASHSEED`` the hashes were
  made under and the vLLM version that produced the results;
* then one record per call: ``{"op": NAME, "args": {...}}`` plus either
  ``"ok": RESULT`` or ``"raises": EXCEPTION_TYPE_NAME``, and ``"state"``, the
  abstract state (``docs/contract.md``) after the call.

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
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

TRACE_FORMAT = "kvcache-trace/1"


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


def state_diff(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """One line per top-level key of two canonical states that differs."""
    lines = []
    for key in sorted(set(expected) | set(actual)):
        if not results_equal(expected.get(key), actual.get(key)):
            lines.append(
                f"  {key}: expected {short(expected.get(key))}, got {short(actual.get(key))}"
            )
    return lines


def short(value: Any, limit: int = 400) -> str:
    """Compact JSON for messages, cut at ``limit`` characters."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_trace(
    path: Path, config: Mapping[str, Any], records: Sequence[Mapping[str, Any]]
) -> None:
    """Write a config line and one line per call record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(dict(config), sort_keys=True) + "\n")
        for record in records:
            f.write(json.dumps(dict(record), sort_keys=True, separators=(",", ":")) + "\n")


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a trace file into (config, call records).

    Raises:
        ValueError: if the first line is not a config record of this format.
    """
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty trace")
    config = json.loads(lines[0])
    if config.get("kind") != "config" or config.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: first line is not a {TRACE_FORMAT} config record")
    return config, [json.loads(line) for line in lines[1:]]
