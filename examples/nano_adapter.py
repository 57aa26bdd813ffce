"""examples/nano_blocks.py on trial through the kit's small protocol (docs/protocol.md).

    python -m kvcache fuzz --impl examples.nano_adapter:NanoSubject --compare hits

It declares full attention alone (no LoRA, salt, EAGLE, eviction, events, ... drawn).
The one vLLM convention it mirrors: its pool is one block smaller (vLLM's null block).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from examples.nano_blocks import BlockManager, Sequence
from kvcache.kit.protocol import PROTOCOL


class NanoSubject:
    """The block manager behind the protocol's seven calls."""

    PROTOCOL = PROTOCOL
    FEATURES = ("full",)

    def __init__(self, config: Mapping[str, Any], hash_seed: str) -> None:
        self.block_size = int(config["groups"][0]["block_size"])
        self.manager = BlockManager(int(config["num_blocks"]) - 1, self.block_size)
        self.seqs: dict[str, Sequence] = {}
        self.computed: dict[str, int] = {}

    def add_request(self, args: Mapping[str, Any]) -> None:
        self.seqs[args["request_id"]] = Sequence(list(args["prompt_token_ids"]), self.block_size)
        self.computed[args["request_id"]] = 0

    def get_computed_blocks(self, args: Mapping[str, Any]) -> dict[str, Any]:
        hits = self.manager.lookup(self.seqs[args["request_id"]])
        return {"block_ids": [hits], "num_computed_tokens": len(hits) * self.block_size}

    def allocate_slots(self, args: Mapping[str, Any]) -> list[list[int]] | None:
        rid = args["request_id"]
        seq, before = self.seqs[rid], len(self.seqs[rid].block_table)
        if not seq.block_table:
            if not self.manager.can_allocate(seq):
                return None
            self.manager.allocate(seq)
        need = self.computed[rid] + args.get("num_new_computed_tokens", 0) + args["num_new_tokens"]
        return [seq.block_table[before:]] if self.manager.grow(seq, need) else None

    def free(self, args: Mapping[str, Any]) -> None:
        self.manager.deallocate(self.seqs[args["request_id"]])

    def update_request(self, args: Mapping[str, Any]) -> None:
        if "num_computed_tokens" in args:
            self.computed[args["request_id"]] = args["num_computed_tokens"]

    def append_output_token_ids(self, args: Mapping[str, Any]) -> None:
        tokens = args["token_ids"]
        self.seqs[args["request_id"]].token_ids += [tokens] if isinstance(tokens, int) else tokens

    def get_num_free_blocks(self, args: Mapping[str, Any]) -> int:
        return len(self.manager.free_block_ids)
