"""Planted subjects for the conformance levels, plugged in through the small protocol.

Each wraps kvcache's manager (through the kit's own ``Side``, which speaks the
trace's vocabulary) and changes only what it reports:

* ``Renamed`` reports every block id under another name, ``id -> num_blocks - 1 - id``,
  consistently (and takes ids in ``evict_blocks`` back the same way): the same
  manager under another numbering. Equal at ``sharing``, different at ``exact``.
* ``WrongSharing`` reports, for a request's newly allocated blocks, the newest block
  of the request allocated just before it in place of its own first new block, when
  that request still holds blocks: two requests appear to share a block they do not.
  Hits and free counts are untouched: equal at ``hits``, different at ``sharing``.
* ``CoreOnly`` has only the protocol's core calls and declares full attention alone:
  it runs only because the driver draws nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcache.kit.config import ManagerConfig
from kvcache.kit.protocol import CORE_OPS, PROTOCOL
from kvcache.kit.sides import Side, resolve_adapter


def _kvcache_side(config: Mapping[str, Any], hash_seed: str) -> Side:
    return Side(resolve_adapter("kvcache"), ManagerConfig.from_record(config), hash_seed)


def _table(value: Any) -> list[list[Any]] | None:
    if isinstance(value, dict) and set(value) == {"tuple"}:
        return [list(group) for group in value["tuple"]]
    return None


class _Wrapped:
    """Forwards every call to a kvcache side; ``report`` may rewrite results."""

    def __init__(self, config: Mapping[str, Any], hash_seed: str) -> None:
        self.side = _kvcache_side(config, hash_seed)
        self.num_blocks = int(config["num_blocks"])

    def __getattr__(self, op: str) -> Any:
        if op.startswith("_") or op in ("abstract_state", "check_invariants"):
            raise AttributeError(op)

        def call(args: Mapping[str, Any]) -> Any:
            if op == "get_num_free_blocks":
                return self.side.num_free_blocks()
            return self.report(op, args, self.side.call(op, self.take(op, args)))

        return call

    def take(self, op: str, args: Mapping[str, Any]) -> Mapping[str, Any]:
        return args

    def report(self, op: str, args: Mapping[str, Any], result: Any) -> Any:
        return result


class Renamed(_Wrapped):
    """kvcache under another block numbering, consistently."""

    PROTOCOL = PROTOCOL

    def rename(self, block: Any) -> Any:
        if isinstance(block, int) and 0 <= block < self.num_blocks:
            return self.num_blocks - 1 - block
        return block

    def take(self, op: str, args: Mapping[str, Any]) -> Mapping[str, Any]:
        if op == "evict_blocks":
            return {**args, "block_ids": [self.rename(b) for b in args["block_ids"]]}
        return args

    def report(self, op: str, args: Mapping[str, Any], result: Any) -> Any:
        if op.startswith("get_computed_blocks"):
            table = _table(result["block_ids"])
            assert table is not None
            return {**result, "block_ids": [[self.rename(b) for b in g] for g in table]}
        table = _table(result)
        if table is not None and op != "get_num_common_prefix_blocks":
            return [[self.rename(b) for b in group] for group in table]
        if op == "pop_blocks_for_free":
            return [self.rename(b) for b in result]
        return result


class WrongSharing(_Wrapped):
    """kvcache reporting a block of the previously allocated request as shared."""

    PROTOCOL = PROTOCOL

    def __init__(self, config: Mapping[str, Any], hash_seed: str) -> None:
        super().__init__(config, hash_seed)
        self.last: tuple[str, int] | None = None  # (request id, its newest block)

    def report(self, op: str, args: Mapping[str, Any], result: Any) -> Any:
        if op in ("free", "pop_blocks_for_free") and self.last and self.last[0] == args[
                "request_id"]:
            self.last = None
        table = _table(result) if op == "allocate_slots" else None
        if table is None or not table[0]:
            return result
        mine = table[0][-1]
        if self.last is not None and self.last[0] != args["request_id"]:
            table[0][0] = self.last[1]  # the planted bug: another request's block
        self.last = (str(args["request_id"]), mine)
        return table


class CoreOnly:
    """Only the protocol's core calls (``CORE_OPS``), full attention alone declared."""

    PROTOCOL = PROTOCOL
    FEATURES = ("full",)

    def __init__(self, config: Mapping[str, Any], hash_seed: str) -> None:
        self.side = _kvcache_side(config, hash_seed)
        for op in CORE_OPS[:-1]:
            setattr(self, op, lambda args, op=op: self.side.call(op, args))

    def get_num_free_blocks(self, args: Mapping[str, Any]) -> int:
        return self.side.num_free_blocks()
