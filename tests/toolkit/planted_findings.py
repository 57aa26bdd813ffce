"""Planted subjects for census findings: kvcache's manager, reporting one or two bugs.

Both wrap kvcache's manager through the small protocol (``planted_levels._Wrapped``)
and change only what they report:

* ``ShortHits`` (one bug): a prefix-cache hit is reported one block short (the
  last hit block dropped, ``num_computed_tokens`` cut to match).
* ``ShortHitsAndRefusals`` (two bugs): that, and ``allocate_slots`` refusing
  (``None``) a request whose id ends in ``3`` once it asks for new slots while it
  already holds blocks, though the manager did allocate them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcache.kit.protocol import PROTOCOL
from toolkit.planted_levels import _table, _Wrapped


class ShortHits(_Wrapped):
    """kvcache reporting every prefix-cache hit one block short."""

    PROTOCOL = PROTOCOL
    FEATURES = ("full",)

    def report(self, op: str, args: Mapping[str, Any], result: Any) -> Any:
        if op == "get_computed_blocks":
            table = _table(result["block_ids"])
            assert table is not None
            if table[0]:
                hit = len(table[0]) - 1
                block_size = result["num_computed_tokens"] // len(table[0])
                return {"block_ids": {"tuple": [group[:hit] for group in table]},
                        "num_computed_tokens": hit * block_size}
        return result


class ShortHitsAndRefusals(ShortHits):
    """``ShortHits``, and refusing a held request's growth when its id ends in 3."""

    def __init__(self, config: Mapping[str, Any], hash_seed: str) -> None:
        super().__init__(config, hash_seed)
        self.holding: set[str] = set()

    def report(self, op: str, args: Mapping[str, Any], result: Any) -> Any:
        rid = str(args.get("request_id", ""))
        if op in ("free", "pop_blocks_for_free"):
            self.holding.discard(rid)
        if op == "allocate_slots" and result is not None:
            if rid in self.holding and rid.endswith("3"):
                return None  # the planted bug: a refusal the manager did not make
            self.holding.add(rid)
        return super().report(op, args, result)
