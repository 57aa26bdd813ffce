"""Request hashing byte-identical to vLLM 0.25.1's for every hash function and extra
key, a request's hashes made at once and as its tokens grow (issue 28: the hasher
slices each block's tokens from one tuple per call)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcache.kit.adapters import vllm_available
from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.sides import resolve_adapter

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM 0.25.1 is not installed")

EXTRA: dict[str, dict[str, Any]] = {
    "none": {},
    "lora": {"lora": ["adapter-a", 1]},
    "salt": {"cache_salt": "salt-1"},
    "mm": {"mm_features": [["img-0", 3, 20], ["img-1", 40, 9], ["img-2", 70, 30]]},
    "all": {
        "lora": ["adapter-a", 1],
        "cache_salt": "salt-1",
        "mm_features": [["img-0", 3, 20], ["img-1", 40, 9]],
    },
}


def _config(hash_fn: str, block_size: int) -> ManagerConfig:
    return ManagerConfig(
        num_blocks=64,
        groups=(GroupConfig(kind="full", block_size=block_size),),
        max_model_len=4096,
        hash_fn=hash_fn,
    )


@pytest.mark.parametrize("extra", sorted(EXTRA))
@pytest.mark.parametrize("hash_fn", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_hashes_equal_vllms_at_once_and_as_tokens_grow(
    hash_fn: str, extra: str, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(hash_fn, block_size)
    prompt = [(i * 7919) % 70_000 for i in range(101)]  # one-, two- and four-byte ints
    hashes = []
    for name in ("kvcache", "vllm"):
        adapter = resolve_adapter(name)
        chain = adapter.chain_module()
        assert chain is not None
        for attr in ("NONE_HASH", "_none_hash_seed"):  # the process's chain, for later tests
            if hasattr(chain, attr):
                monkeypatch.setattr(chain, attr, getattr(chain, attr))
        adapter.init_hashes(config, "0")
        args = {"request_id": "r", "prompt_token_ids": prompt, "max_tokens": 64, **EXTRA[extra]}
        request = adapter.build_request(config, args)
        seen = [list(request.block_hashes)]
        for step, chunk in enumerate((1, 2, 5, 16, 1, 33)):
            request.append_output_token_ids([(step * 131 + j) % 70_000 for j in range(chunk)])
            seen.append(list(request.block_hashes))
        hashes.append(seen)
    assert hashes[0] == hashes[1]
    assert len(hashes[0][-1]) == (101 + 58) // block_size
