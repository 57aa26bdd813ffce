"""A side hashes with its trace's chain and leaves the process's ``NONE_HASH`` alone.

The parent of every first block is a module global (``NONE_HASH``, in kvcache as
in vLLM). A side installs its trace's value (``hash_fn`` of the trace's
``PYTHONHASHSEED``) only while it runs a call, so sides of different hash
functions interleave, and code hashing in the same process after the kit (the
stateful machines, a user's own requests) sees the chain it set up.
"""

from __future__ import annotations

import pytest

from kvcache import kv_cache_utils as kcu
from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import chain_seed, make_side
from kvcache.kit.trace import canon

PROMPT = {"prompt_token_ids": [1, 2, 3, 4, 5]}


def chain(hash_fn: str, seed: str, tokens: list[int], block_size: int) -> list[bytes]:
    """The block hashes of ``tokens`` chained from ``hash_fn(seed)``, written out."""
    fn = kcu.get_hash_fn_by_name(hash_fn)
    hashes, parent = [], fn(seed)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = fn((parent, tuple(tokens[start : start + block_size]), None))
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("impl", ["kvcache", "spec", "vllm"])
def test_sides_of_two_hash_functions_interleave(impl: str, request: pytest.FixtureRequest) -> None:
    if impl == "vllm":
        request.getfixturevalue("vllm_reference")  # skips (fails in CI) without vLLM
    xx = make_side(impl, ManagerConfig.full_attention(8, 2, 8, hash_fn="xxhash"), "5")
    module = xx.chain_module
    assert module is not None
    before = chain_seed(module)
    sha = make_side(impl, ManagerConfig.full_attention(8, 2, 8), "0")
    assert chain_seed(module) is before, "building a side changed the process's chain"
    for side, hash_fn, seed in [(xx, "xxhash", "5"), (sha, "sha256", "0")] * 2:
        hashes = side.call("add_request", {**PROMPT, "request_id": f"r{len(side.requests)}"})
        assert hashes == canon(chain(hash_fn, seed, [1, 2, 3, 4, 5], 2)), (impl, hash_fn)
        assert chain_seed(module) is before, f"{impl}: a call left its chain behind"
    # a later append (outside any call of the side) hashes with the side's chain too
    with xx.hashing():
        xx.requests["r0"].append_output_token_ids(6)
    assert list(xx.requests["r0"].block_hashes) == chain("xxhash", "5", [1, 2, 3, 4, 5, 6], 2)
    assert chain_seed(module) is before
