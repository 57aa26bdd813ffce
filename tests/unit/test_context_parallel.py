"""Decode / prefill context parallelism (``dcp_world_size``, ``pcp_world_size``).

Each rank stores a share of every block, so to the manager a block spans
``block_size * dcp * pcp`` tokens: hits, hashes and allocations are in those
units (the ``full-dcp`` conformance family checks random sequences against
vLLM). Here: the configurations vLLM 0.25.1 refuses are refused by kvcache at
the same call (an error that is both vLLM's ``AssertionError`` and a
``ValueError``), the spec refuses what it does not model, and configurations
vLLM accepts without prefix caching give vLLM's block tables.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache as K
import spec as S
from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.sides import make_side

pytestmark = pytest.mark.usefixtures("vllm_reference")


def both_managers(
    kinds: tuple[str, ...], caching: bool, dcp: int, pcp: int = 1, hash_block_size: int = 8
) -> list[tuple[str, Any]]:
    """(name, builder) for kvcache's and vLLM's manager of the same layout."""
    import torch
    from vllm.v1 import kv_cache_interface as V
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    def config(lib: Any, dtype: Any) -> Any:
        attn = dict(block_size=4, num_kv_heads=1, head_size=8, dtype=dtype)
        make = {"full": lambda: lib.FullAttentionSpec(**attn),
                "swa": lambda: lib.SlidingWindowSpec(**attn, sliding_window=4),
                "mla": lambda: lib.MLAAttentionSpec(**attn)}
        groups = [lib.KVCacheGroupSpec([f"l{i}"], make[k]()) for i, k in enumerate(kinds)]
        return lib.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)

    kwargs = dict(max_model_len=64, scheduler_block_size=8, hash_block_size=hash_block_size,
                  enable_caching=caching, dcp_world_size=dcp, pcp_world_size=pcp)
    return [
        ("kvcache", lambda: K.KVCacheManager(config(K, "float16"), **kwargs)),
        ("vllm", lambda: VllmManager(config(V, torch.float16), **kwargs)),
    ]


@pytest.mark.parametrize(("dcp", "pcp"), [(2, 1), (1, 2)])
def test_hybrid_with_caching_is_refused_as_vllm_refuses_it(dcp: int, pcp: int) -> None:
    for name, build in both_managers(("full", "swa"), True, dcp, pcp, hash_block_size=4):
        with pytest.raises(AssertionError):
            build()
        if name == "kvcache":
            with pytest.raises(K.ContextParallelError, match="context parallelism"):
                build()
    # The spec does not model it either (a clear NotImplementedError).
    full = K.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    swa = K.SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16",
                              sliding_window=4)
    cfg = K.KVCacheConfig(16, [], [K.KVCacheGroupSpec(["a"], full), K.KVCacheGroupSpec(["b"], swa)])
    with pytest.raises(NotImplementedError, match="context parallelism"):
        S.KVCacheManager(cfg, 64, 8, 4, dcp_world_size=dcp, pcp_world_size=pcp)


def test_sliding_window_lookup_is_refused_where_vllm_asserts() -> None:
    for name, build in both_managers(("swa",), True, 2):
        manager = build()  # building is fine; the lookup asserts in vLLM
        request = request_for(name, list(range(20)))
        with pytest.raises(AssertionError):
            manager.get_computed_blocks(request)
        if name == "kvcache":
            with pytest.raises(ValueError, match="dcp_world_size=2"):
                manager.get_computed_blocks(request)


def test_hash_block_size_must_be_the_scaled_block_size() -> None:
    for _name, build in both_managers(("full",), True, 2, hash_block_size=4):
        with pytest.raises(AssertionError if _name == "vllm" else ValueError):
            build()


def request_for(impl: str, tokens: list[int]) -> Any:
    if impl == "kvcache":
        return K.Request("r", tokens, block_hasher=K.get_request_block_hasher(8, K.sha256))
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from kvcache.kit.vllm_side import build_request

    init_none_hash(sha256)
    return build_request({"request_id": "r", "prompt_token_ids": tokens}, 8, sha256)


def test_world_sizes_are_validated() -> None:
    # (The compiled build type-checks the int annotation itself: a TypeError for 1.5.)
    for bad in (0, -1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match=r"dcp_world_size|int object"):
            both_managers(("full",), True, bad)[0][1]()  # type: ignore[arg-type]
        with pytest.raises((ValueError, TypeError), match=r"pcp_world_size|int object"):
            both_managers(("full",), True, 1, bad)[0][1]()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dcp_world_size"):
        ManagerConfig.full_attention(8, 2, 32, dcp_world_size=0)


@pytest.mark.parametrize("kinds", [("full", "swa"), ("full", "mla"), ("swa",)])
def test_without_caching_blocks_span_the_scaled_size(kinds: tuple[str, ...]) -> None:
    """vLLM accepts any layout with dcp > 1 when caching is off: every group's
    block holds ``block_size * dcp`` tokens; kvcache and the spec agree with it."""
    groups = tuple(
        GroupConfig({"swa": "sliding_window"}.get(k, k), 2, num_kv_heads=i + 1,
                    sliding_window=4 if k == "swa" else None)
        for i, k in enumerate(kinds)
    )
    config = ManagerConfig(num_blocks=24, groups=groups, max_model_len=64, enable_caching=False,
                           dcp_world_size=2, scheduler_block_size_override=4,
                           hash_block_size_override=4)
    sides = [make_side(name, config) for name in ("vllm", "kvcache", "spec")]
    results = []
    for side in sides:
        side.call("add_request", {"request_id": "a", "prompt_token_ids": list(range(10))})
        first = side.call("allocate_slots", {"request_id": "a", "num_new_tokens": 10})
        side.call("update_request", {"request_id": "a", "num_computed_tokens": 10})
        second = side.call("allocate_slots", {"request_id": "a", "num_new_tokens": 7,
                                              "num_new_computed_tokens": 0})
        results.append((first, second, side.state()))
    assert results[0] == results[1] == results[2]
    assert len(results[0][0]["tuple"][0]) == 3  # ceil(10 / (2 * 2)) blocks in the first group
