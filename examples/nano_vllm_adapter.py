"""nano-vllm's own BlockManager on trial: ``make nano-vllm`` (docs/protocol.md)."""

import os
import sys
from typing import Any

from kvcache.kit.protocol import PROTOCOL

# The engine modules at NANO_VLLM_SRC alone: the package __init__ imports its model runner.
_package = sys.modules.setdefault("nanovllm", type(sys)("nanovllm"))
_package.__path__ = [os.path.join(os.environ.get("NANO_VLLM_SRC", "build/nano-vllm"), "nanovllm")]
from nanovllm.engine import block_manager, sequence  # type: ignore  # noqa: E402


class NanoVllmSubject:
    """nano-vllm's scheduler's calls to its BlockManager, behind the protocol's seven."""

    PROTOCOL, FEATURES = PROTOCOL, ("full",)

    def __init__(self, config: Any, hash_seed: str) -> None:
        self.block_size = int(config["groups"][0]["block_size"])  # less vLLM's null block:
        self.manager = block_manager.BlockManager(config["num_blocks"] - 1, self.block_size)
        self.seqs: dict[str, Any] = {}

    def add_request(self, args: Any) -> None:
        seq = self.seqs[args["request_id"]] = sequence.Sequence(list(args["prompt_token_ids"]))
        seq.block_size = self.block_size

    def get_computed_blocks(self, args: Any) -> dict[str, Any]:
        cached = self.manager.can_allocate(self.seqs[args["request_id"]])  # -1: no room
        return {"block_ids": [[]], "num_computed_tokens": max(cached, 0) * self.block_size}

    def allocate_slots(self, args: Any) -> list[list[int]] | None:
        before = len((seq := self.seqs[args["request_id"]]).block_table)
        if not before:  # admission: the whole prompt at once, as nano's scheduler does
            if (cached := self.manager.can_allocate(seq)) == -1:
                return None
            self.manager.allocate(seq, cached)
        elif len(seq) > before * self.block_size:  # a decode token past the last block
            if not self.manager.can_append(seq):
                return None
            self.manager.may_append(seq)
        return [seq.block_table[before:]]

    def free(self, args: Any) -> None:
        self.manager.deallocate(self.seqs[args["request_id"]])

    def update_request(self, args: Any) -> None:
        seq = self.seqs[args["request_id"]]
        if "num_computed_tokens" in args and seq.block_table:  # the step ran: cache its blocks
            seq.num_scheduled_tokens = args["num_computed_tokens"] - seq.num_cached_tokens
            self.manager.hash_blocks(seq)
            seq.num_cached_tokens, seq.num_scheduled_tokens = args["num_computed_tokens"], 0

    def append_output_token_ids(self, args: Any) -> None:
        for token in t if isinstance(t := args["token_ids"], list) else [t]:
            self.seqs[args["request_id"]].append_token(token)

    def get_num_free_blocks(self, args: Any) -> int:
        return len(self.manager.free_block_ids)
