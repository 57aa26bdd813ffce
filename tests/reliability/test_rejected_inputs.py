"""Bad input gets a ValueError naming the argument and value, and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import kvcache as K

BS = 4


def manager(**kwargs: Any) -> K.KVCacheManager:
    spec = K.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")
    config = K.KVCacheConfig(12, [], [K.KVCacheGroupSpec(["l0"], spec)])
    return K.KVCacheManager(
        config, max_model_len=32, scheduler_block_size=BS, hash_block_size=BS, **kwargs
    )


def request(rid: str, n: int = 9) -> K.Request:
    return K.Request(rid, list(range(n)), block_hasher=K.get_request_block_hasher(BS, K.sha256))


def populated() -> tuple[K.KVCacheManager, K.Request]:
    m = manager(enable_kv_cache_events=True)
    r = request("a")
    assert m.allocate_slots(r, 9) is not None
    r.num_computed_tokens = 9
    r.status = K.RequestStatus.RUNNING
    return m, r


CASES: list[tuple[str, str, Callable[[K.KVCacheManager, K.Request], object]]] = [
    ("zero tokens", "num_new_tokens", lambda m, r: m.allocate_slots(r, 0)),
    ("negative tokens", "num_new_tokens", lambda m, r: m.allocate_slots(r, -2)),
    (
        "negative lookahead",
        "num_lookahead_tokens",
        lambda m, r: m.allocate_slots(r, 1, num_lookahead_tokens=-1),
    ),
    (
        "negative external",
        "num_external_computed_tokens",
        lambda m, r: m.allocate_slots(r, 1, num_external_computed_tokens=-1),
    ),
    (
        "negative reserved",
        "reserved_blocks",
        lambda m, r: m.allocate_slots(r, 1, reserved_blocks=-1),
    ),
    (
        "negative encoder",
        "num_encoder_tokens",
        lambda m, r: m.allocate_slots(r, 1, num_encoder_tokens=-3),
    ),
    ("beyond max_model_len", "max_model_len", lambda m, r: m.allocate_slots(r, 24)),
    (
        "wrong group count",
        "new_computed_blocks",
        lambda m, r: m.allocate_slots(request("b"), 9, 0, K.KVCacheBlocks(((), ()))),
    ),
    (
        "duplicate request id",
        "duplicate request id",
        lambda m, r: m.allocate_slots(request("a"), 1),
    ),
    ("evict out of range", "block_ids", lambda m, r: m.evict_blocks({12})),
    ("evict negative", "block_ids", lambda m, r: m.evict_blocks({-1})),
    (
        "double free",
        "double free",
        lambda m, r: m.block_pool.free_blocks([m.block_pool.blocks[1]] * 2),
    ),
    (
        "free a free block",
        "double free",
        lambda m, r: m.block_pool.free_blocks([m.block_pool.blocks[9]]),
    ),
    (
        "free a foreign block",
        "not a block of this pool",
        lambda m, r: m.block_pool.free_blocks([K.KVCacheBlock(3)]),
    ),
    ("too many new blocks", "Cannot get", lambda m, r: m.block_pool.get_new_blocks(99)),
    ("negative new blocks", "Cannot get", lambda m, r: m.block_pool.get_new_blocks(-1)),
]


@pytest.mark.parametrize(("name", "needle", "call"), CASES, ids=[c[0] for c in CASES])
def test_bad_call_raises_value_error_and_changes_nothing(
    name: str, needle: str, call: Callable[[K.KVCacheManager, K.Request], object]
) -> None:
    m, r = populated()
    before = m.abstract_state()
    with pytest.raises(ValueError, match=needle):
        call(m, r)
    assert m.abstract_state() == before
    m.check_invariants()
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 11  # nothing leaked


CONFIG_CASES: list[tuple[str, str, Callable[[], object]]] = [
    ("zero blocks", "num_gpu_blocks", lambda: K.BlockPool(0, True, 4)),
    (
        "zero block size",
        "block_size",
        lambda: K.FullAttentionSpec(block_size=0, num_kv_heads=1, head_size=8, dtype="float16"),
    ),
    (
        "bad dtype",
        "dtype",
        lambda: (
            K.FullAttentionSpec(
                block_size=4, num_kv_heads=1, head_size=8, dtype="int3"
            ).page_size_bytes
        ),
    ),
    (
        "zero window",
        "sliding_window",
        lambda: K.SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=0
        ),
    ),
    ("bad mamba mode", "mamba_cache_mode", lambda: K.MambaSpec(block_size=4, mamba_cache_mode="x")),
    ("bad max_model_len", "max_model_len", lambda: manager(max_model_len=0)),
    ("negative watermark", "watermark", lambda: manager(watermark=-0.1)),
    (
        "retention without a window",
        "prefix_cache_retention_interval=4",
        lambda: manager(prefix_cache_retention_interval=4),
    ),
    (
        "hash size mismatch",
        "hash_block_size",
        lambda: K.KVCacheManager(
            K.KVCacheConfig(
                8,
                [],
                [
                    K.KVCacheGroupSpec(
                        ["l"],
                        K.FullAttentionSpec(
                            block_size=4, num_kv_heads=1, head_size=8, dtype="float16"
                        ),
                    )
                ],
            ),
            32,
            4,
            2,
        ),
    ),
    (
        "scheduler size",
        "scheduler_block_size",
        lambda: K.KVCacheManager(
            K.KVCacheConfig(
                8,
                [],
                [
                    K.KVCacheGroupSpec(
                        ["l"],
                        K.FullAttentionSpec(
                            block_size=4, num_kv_heads=1, head_size=8, dtype="float16"
                        ),
                    )
                ],
            ),
            32,
            6,
            2,
        ),
    ),
    ("unknown hash", "hash_fn_name", lambda: K.get_hash_fn_by_name("md5")),
    ("bad hasher size", "hash_block_size", lambda: K.get_request_block_hasher(0, K.sha256)),
    ("bad lora id", "lora_int_id", lambda: K.LoRARequest("x", 0)),
    ("non-str request id", "request_id", lambda: K.Request(7, [1])),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "needle", "call"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_is_rejected_with_a_named_argument(
    name: str, needle: str, call: Callable[[], object]
) -> None:
    with pytest.raises((ValueError, TypeError), match=needle):
        call()


def test_unsupported_features_say_so() -> None:
    with pytest.raises(ValueError, match="dcp_world_size"):
        manager(dcp_world_size=0)
    with pytest.raises((ValueError, TypeError), match=r"pcp_world_size|int object"):
        manager(pcp_world_size=1.5)  # the compiled build's own type check: TypeError
    cross = K.CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    full = K.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    cfg = K.KVCacheConfig(
        8, [], [K.KVCacheGroupSpec(["a"], full), K.KVCacheGroupSpec(["b"], cross)]
    )
    with pytest.raises(NotImplementedError, match="cross-attention"):
        K.KVCacheManager(cfg, 32, 4, 4)
