"""KV-cache events, with vLLM 0.25.1's classes, field names and wire format.

The pool queues a ``BlockStored`` for each batch of newly cached blocks, a
``BlockRemoved`` for each evicted hash and ``AllBlocksCleared`` on a prefix
cache reset; ``KVCacheManager.take_events`` drains them. vLLM builds these as
msgspec structs; here they are plain dataclasses with equal fields, which
``dataclasses.asdict`` turns into the same mapping.

On the wire (what vLLM's event publisher sends and its subscribers decode)
``encode`` gives the bytes vLLM's ``msgspec.msgpack.Encoder`` gives for the
same batch of vLLM's structs: a batch is the array ``[ts, events,
data_parallel_rank]``, an event the map ``{"type": CLASS_NAME, field: value,
...}`` in field order, fields still at their default left out.
msgspec, when installed, packs the bytes; otherwise ``packb``, a small
MessagePack writer of its own, does (the same bytes; a test holds both to it).
With vLLM installed, ``to_vllm`` / ``from_vllm`` convert to and from vLLM's
own event classes. Each pool emits one vocabulary, fixed when it is built: a
manager built from vLLM's objects (``built_from_vllm`` of its ``KVCacheConfig``)
returns vLLM's structs from ``take_events``, so vLLM's ``ZmqEventPublisher``
sends batches vLLM's subscribers decode; one built from kvcache's returns these
dataclasses. Two managers in one process keep their own.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any

from kvcache.kv_cache_utils import ExternalBlockHash

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
"""The host tier (vLLM 0.33.0's HiSparse host pool)."""


@dataclass
class KVCacheEvent:
    """Base class of all KV-cache events."""


@dataclass
class BlockStored(KVCacheEvent):
    """Blocks became cached: one hash per block, chained after ``parent_block_hash``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    def __hash__(self) -> int:
        # Hashable like vLLM's struct, so a KVEventAggregator can count equal events.
        return hash(_freeze(dataclasses.astuple(self)))


@dataclass
class BlockRemoved(KVCacheEvent):
    """Cached hashes were evicted from the prefix cache."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None

    def __hash__(self) -> int:
        return hash(_freeze(dataclasses.astuple(self)))


@dataclass
class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset."""

    def __hash__(self) -> int:
        return hash(AllBlocksCleared)


@dataclass
class EventBatch:
    """Events taken at time ``ts`` (seconds), as one publisher message."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


@dataclass
class KVEventBatch(EventBatch):
    """A batch of KV-cache events (``take_events`` results), vLLM's message type."""

    events: list[KVCacheEvent]


EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}

EVENT_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("event_locality", "locality", ("BlockStored", "BlockRemoved")),
    ("event_ownership", "ownership", ("BlockStored", "BlockRemoved")),
    ("event_session_id", "session_id", ("BlockStored",)),
    ("event_lookahead_tokens", "lookahead_token_ids", ("BlockStored",)),
)
"""The fields later releases added to 0.25.1's event classes, in vLLM's order: (the
profile switch that adds it, the field, the classes that gain it)."""


def release_fields(profile: Any, name: str) -> tuple[str, ...]:
    """The fields event class ``name`` carries beyond 0.25.1's under ``profile``
    (a ``kvcache.profile.Profile``: its ``EVENT_FIELDS`` switches)."""
    return tuple(
        f for switch, f, names in EVENT_FIELDS if name in names and getattr(profile, switch)
    )


_CLASSES: dict[tuple[str, tuple[str, ...]], type[Any]] = {}


def event_class(name: str, fields: tuple[str, ...] = ()) -> type[Any]:
    """Event class ``name`` of a release: 0.25.1's fields, then ``fields`` (later
    releases', ``release_fields``), each None by default. One class per field set
    (equal events of one release compare equal), named ``name`` like vLLM's, so the
    wire format, converters and the kit know it by that name; it pickles by name and
    field set.

    Raises:
        ValueError: ``name`` is not an event class, or a field is not a later one.
    """
    key = (name, fields)
    if key in _CLASSES:
        return _CLASSES[key]
    base = EVENT_TYPES.get(name)
    known = {f for _, f, names in EVENT_FIELDS if name in names}
    if base is None or not known.issuperset(fields) or len(set(fields)) != len(fields):
        raise ValueError(f"event_class: name={name!r}, fields={fields!r}: the fields must "
                         f"be distinct, from {sorted(known)}")
    if not fields:
        return base

    def reduce(self: Any) -> tuple[Any, ...]:
        return _remade, (name, fields, dataclasses.astuple(self))

    cls = dataclasses.make_dataclass(
        name, [(f, Any, None) for f in fields], bases=(base,),
        namespace={"__hash__": base.__hash__, "__reduce__": reduce,
                   "__module__": __name__, "__doc__": base.__doc__},
    )  # fmt: skip
    _CLASSES[key] = cls
    return cls


def _remade(name: str, fields: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    """An event of ``event_class(name, fields)`` from its field values (unpickling; the
    class itself is made, not importable, so a holder keeps its field set instead)."""
    return event_class(name, fields)(*values)


LookaheadBlockStored = event_class("BlockStored", ("lookahead_token_ids",))
"""0.25.1's ``BlockStored`` plus vLLM 0.33.0's ``lookahead_token_ids``: what a pool
hashing with lookahead tokens (which only kvcache offers before 0.33.0) queues, so
that a consumer can rebuild each hash (``(extra_keys[i], *lookahead_token_ids[i])``)."""


def _freeze(value: Any) -> Any:
    """``value`` with lists turned into tuples, all the way down (for hashing)."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


# ---------------------------------------------------------------- wire format


def to_wire(value: Any) -> Any:
    """The plain msgpack value of an event, a batch, or a list of either.

    Events become ``{"type": CLASS_NAME, ...fields}`` (fields equal to their
    default omitted), batches ``[ts, events, data_parallel_rank]`` (msgspec
    omits no default of an array-like struct); anything else is returned as it is.

    Raises:
        TypeError: for a dataclass that is neither a kvcache event nor a batch.
    """
    if isinstance(value, EventBatch):
        return [value.ts, [to_wire(e) for e in value.events], value.data_parallel_rank]
    if isinstance(value, KVCacheEvent):
        wire: dict[str, Any] = {"type": type(value).__name__}
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if field.default is not dataclasses.MISSING and item == field.default:
                continue
            wire[field.name] = item
        return wire
    if isinstance(value, list):
        return [to_wire(v) for v in value]
    if dataclasses.is_dataclass(value):
        raise TypeError(f"to_wire: {type(value).__name__} is not a kvcache event or batch")
    return value


def encode(value: Any) -> bytes:
    """MessagePack bytes of an event, a batch or a list of them, as vLLM's publisher
    encodes the same objects (decodable with ``msgspec.msgpack.Decoder(KVEventBatch)``
    of vLLM)."""
    wire = to_wire(value)
    try:
        import msgspec
    except ImportError:
        return packb(wire)
    data: bytes = msgspec.msgpack.encode(wire)
    return data


def packb(value: Any) -> bytes:
    """MessagePack encoding of a plain value, byte for byte as msgspec writes it:
    the shortest int / str / bin / array / map form, floats as float64, tuples
    as arrays.

    Raises:
        OverflowError: for an int outside [-2**63, 2**64 - 1].
        TypeError: for a value msgpack has no form for.
    """
    out = bytearray()
    _pack(value, out)
    return bytes(out)


def _pack_length(n: int, out: bytearray, fix_base: int | None, fix_max: int,
                 codes: tuple[int, int, int]) -> None:
    """Header of a sized item: fix form when ``n <= fix_max``, else 8/16/32-bit forms
    (``codes``; 0 where the 8-bit form does not exist)."""
    if fix_base is not None and n <= fix_max:
        out.append(fix_base | n)
    elif n < 0x100 and codes[0]:
        out += struct.pack(">BB", codes[0], n)
    elif n < 0x10000:
        out += struct.pack(">BH", codes[1], n)
    else:
        out += struct.pack(">BI", codes[2], n)


def _pack(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xC0)
    elif value is True or value is False:
        out.append(0xC3 if value else 0xC2)
    elif isinstance(value, int):
        _pack_int(value, out)
    elif isinstance(value, float):
        out += struct.pack(">Bd", 0xCB, value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _pack_length(len(data), out, 0xA0, 31, (0xD9, 0xDA, 0xDB))
        out += data
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        _pack_length(len(data), out, None, -1, (0xC4, 0xC5, 0xC6))
        out += data
    elif isinstance(value, list | tuple):
        _pack_length(len(value), out, 0x90, 15, (0, 0xDC, 0xDD))
        for item in value:
            _pack(item, out)
    elif isinstance(value, dict):
        _pack_length(len(value), out, 0x80, 15, (0, 0xDE, 0xDF))
        for key, item in value.items():
            _pack(key, out)
            _pack(item, out)
    else:
        raise TypeError(f"packb: cannot encode {type(value).__name__}: {value!r}")


def _pack_int(value: int, out: bytearray) -> None:
    if 0 <= value < 0x80:
        out.append(value)
    elif -32 <= value < 0:
        out += struct.pack(">b", value)
    elif value >= 0:
        for code, fmt, limit in ((0xCC, ">BB", 8), (0xCD, ">BH", 16), (0xCE, ">BI", 32),
                                 (0xCF, ">BQ", 64)):
            if value < 1 << limit:
                out += struct.pack(fmt, code, value)
                return
        raise OverflowError(f"packb: int {value} is above 2**64 - 1")
    else:
        for code, fmt, limit in ((0xD0, ">Bb", 7), (0xD1, ">Bh", 15), (0xD2, ">Bi", 31),
                                 (0xD3, ">Bq", 63)):
            if value >= -(1 << limit):
                out += struct.pack(fmt, code, value)
                return
        raise OverflowError(f"packb: int {value} is below -2**63")


# ---------------------------------------------------------------- vLLM's classes

def built_from_vllm(obj: object) -> bool:
    """Whether ``obj`` is one of vLLM's own objects (its class lives in the ``vllm``
    package): a manager built from vLLM's ``KVCacheConfig`` emits vLLM's event
    classes, so vLLM's publisher and subscribers take its events unchanged."""
    return type(obj).__module__.partition(".")[0] == "vllm"


def in_vocabulary(events: list[KVCacheEvent], vllm_classes: bool) -> list[Any]:
    """``events`` as vLLM's msgspec structs when ``vllm_classes`` (``to_vllm``), else
    the same list: each pool emits the vocabulary it was built with."""
    return to_vllm(events) if vllm_classes else events


def to_vllm(value: Any) -> Any:
    """vLLM's own msgspec objects for a kvcache event, batch, or list of them
    (what vLLM's publisher, aggregator and subscribers take). Needs vLLM.

    Raises:
        TypeError: for anything else.
    """
    from vllm.distributed import kv_events as vllm_events

    if isinstance(value, list):
        return [to_vllm(v) for v in value]
    if getattr(type(value), "__struct_fields__", None) is not None:
        return value  # already one of vLLM's
    if isinstance(value, EventBatch):
        cls = vllm_events.KVEventBatch if isinstance(value, KVEventBatch) else None
        if cls is None:
            raise TypeError("to_vllm: only a KVEventBatch has a vLLM counterpart")
        return cls(ts=value.ts, events=[to_vllm(e) for e in value.events],
                   data_parallel_rank=value.data_parallel_rank)
    if isinstance(value, KVCacheEvent):
        vllm_cls = getattr(vllm_events, type(value).__name__)
        return vllm_cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    raise TypeError(f"to_vllm: {type(value).__name__} is not a kvcache event or batch")


def from_vllm(value: Any) -> Any:
    """kvcache's event or batch for one of vLLM's (or a list of them).

    Raises:
        TypeError: for an object whose class name is not an event or KVEventBatch.
    """
    if isinstance(value, list):
        return [from_vllm(v) for v in value]
    name = type(value).__name__
    fields = getattr(type(value), "__struct_fields__", None)
    if name == "KVEventBatch" and fields is not None:
        return KVEventBatch(ts=value.ts, events=[from_vllm(e) for e in value.events],
                            data_parallel_rank=value.data_parallel_rank)
    if name in EVENT_TYPES and fields is not None:
        base = {f.name for f in dataclasses.fields(EVENT_TYPES[name])}
        cls = event_class(name, tuple(f for f in fields if f not in base))
        return cls(**{f: getattr(value, f) for f in fields})
    raise TypeError(f"from_vllm: {name} is not one of vLLM's KV events or KVEventBatch")
