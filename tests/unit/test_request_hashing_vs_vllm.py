"""Request hashing byte-identical to vLLM 0.25.1's for every hash function and extra
key, a request's hashes made at once and as its tokens grow (issue 28: the hasher
slices each block's tokens from one tuple per call)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcache.kit.adapters import vllm_available
from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.sides import Adapter, chain_seed, resolve_adapter, set_chain_seed

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
    hash_fn: str, extra: str, block_size: int
) -> None:
    config = _config(hash_fn, block_size)
    prompt = [(i * 7919) % 70_000 for i in range(101)]  # one-, two- and four-byte ints
    hashes = []
    adapters = [resolve_adapter(name) for name in ("kvcache", "vllm")]
    chains = [a.chain_module() for a in adapters]
    saved = [chain_seed(c) for c in chains if c is not None]  # for the tests after this one
    try:
        for adapter in adapters:
            hashes.append(_grown(adapter, config, prompt, EXTRA[extra]))
    finally:
        for chain, seed in zip([c for c in chains if c is not None], saved, strict=True):
            set_chain_seed(chain, seed)
    assert hashes[0] == hashes[1]
    assert len(hashes[0][-1]) == (101 + 58) // block_size


def _grown(
    adapter: Adapter, config: ManagerConfig, prompt: list[int], extra: dict[str, Any]
) -> list[list[Any]]:
    """The request's hashes when built, then after each of six appends."""
    adapter.init_hashes(config, "0")
    args = {"request_id": "r", "prompt_token_ids": prompt, "max_tokens": 64, **extra}
    request = adapter.build_request(config, args)
    seen = [list(request.block_hashes)]
    for step, chunk in enumerate((1, 2, 5, 16, 1, 33)):
        request.append_output_token_ids([(step * 131 + j) % 70_000 for j in range(chunk)])
        seen.append(list(request.block_hashes))
    return seen
