"""A trace read back from JSON hashes its requests as the run that recorded it did.

vLLM's pickle-based block hashes (sha256, xxhash) write a repeated object as a
back-reference, so a block holding two multimodal items with equal identifiers
hashes differently when the identifiers are one str object (as the driver
makes them) than when they are two (as ``json`` reads them). The adapters
intern identifiers, so a trace recorded on vLLM replays on vLLM itself.
"""

from __future__ import annotations

import json

import pytest

from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import resolve_adapter

ARGS = {"request_id": "r", "prompt_token_ids": [2, 2, 1, 1, 2, 0, 0],
        "mm_features": [["img-1", 1, 3], ["img-1", 4, 2]]}


@pytest.mark.parametrize("impl", ["kvcache", "spec"])
def test_json_read_identifiers_hash_like_shared_ones(impl: str) -> None:
    adapter = resolve_adapter(impl)
    config = ManagerConfig.full_attention(num_blocks=8, block_size=3, max_model_len=21)
    adapter.init_hashes(config, "0")
    from_json = json.loads(json.dumps(ARGS))
    first, second = (f[0] for f in from_json["mm_features"])
    assert first == second and first is not second  # what json gives
    recorded = adapter.build_request(config, ARGS).block_hashes
    assert len(recorded) == 2
    assert adapter.build_request(config, from_json).block_hashes == recorded
