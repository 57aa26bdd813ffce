"""Facts the mutation run (docs/mutation.md) found unchecked, one test each.

The stateful machines compare kvcache with the spec, but the spec shares
kvcache's vocabulary modules (``kv_cache_interface``, ``request``, the hashes
and helpers of ``kv_cache_utils``, ``kv_events``, ``metrics``): a change there
changes both sides alike. Those facts, and public entry points the managers
never call themselves (vLLM API kept for schedulers and connectors), are
pinned here with literal expected values.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from typing import Any

import cbor2
import pytest
import xxhash as xx

import kvcache as K
import kvcache.kv_cache_manager
import kvcache.kv_cache_utils as kcu
from kvcache import _builds
from kvcache.block_pool import BlockHashToBlockMap
from kvcache.kv_cache_interface import get_dtype_size

BS = 4


def attn(cls: Any = K.FullAttentionSpec, **kwargs: Any) -> Any:
    return cls(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16", **kwargs)


def make_manager(
    *specs: Any, num_blocks: int = 16, cls: Any = None, **kwargs: Any
) -> K.KVCacheManager:
    groups = [K.KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs or [attn()])]
    config = K.KVCacheConfig(num_blocks, [], groups)
    kwargs.setdefault("max_model_len", 64)
    cls = cls or K.KVCacheManager
    return cls(config, scheduler_block_size=BS, hash_block_size=BS, **kwargs)  # type: ignore[no-any-return]


def make_request(rid: str, tokens: list[int], **kwargs: Any) -> K.Request:
    return K.Request(rid, tokens, block_hasher=K.get_request_block_hasher(BS, K.sha256), **kwargs)


def admit(m: K.KVCacheManager, r: K.Request) -> tuple[list[int], ...]:
    hits, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    r.status = K.RequestStatus.RUNNING
    return m.get_block_ids(r.request_id)


# ---------------------------------------------------------------- kv_cache_interface


@pytest.mark.parametrize(
    ("dtype", "size"),
    [("float16", 2), ("torch.bfloat16", 2), ("float32", 4), ("torch.float64", 8), ("int8", 1)],
)
def test_dtype_size_accepts_names_with_or_without_torch_prefix(dtype: str, size: int) -> None:
    assert get_dtype_size(dtype) == size


def test_dtype_size_rejects_unknown_names_naming_them() -> None:
    for bad in ("float12", "xtorch.float16", "TORCH.float16"):
        with pytest.raises(ValueError, match=f"dtype='{bad}'"):
            get_dtype_size(bad)


def test_page_sizes() -> None:
    spec = K.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert spec.head_size_v == 128
    assert spec.page_size_bytes == 16 * 8 * (128 + 128) * 2
    mla = K.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, head_size_v=512,
                              dtype="float16")
    assert mla.page_size_bytes == 16 * 1 * (576 + 512) * 2
    swa = K.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32",
                              sliding_window=128, head_size_v=32)
    assert swa.page_size_bytes == 16 * 2 * (64 + 32) * 4
    assert K.SlidingWindowSpec(block_size=2, num_kv_heads=2, head_size=4, dtype="int8",
                               sliding_window=8).page_size_bytes == 2 * 2 * 8 * 1
    padded = K.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16",
                                 page_size_padded=70000)
    assert padded.real_page_size_bytes == 65536 and padded.page_size_bytes == 70000
    exact = K.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16",
                                page_size_padded=65536)
    assert exact.page_size_bytes == 65536
    with pytest.raises(ValueError, match="page_size_padded=65535"):
        _ = K.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16",
                                page_size_padded=65535).page_size_bytes
    chunked = K.ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=2, head_size=8,
                                          dtype="float16", attention_chunk_size=8)
    assert chunked.page_size_bytes == 2 * 4 * 2 * 8 * 2
    mamba = K.MambaSpec(block_size=4, shapes=((2, 3), (5,)), dtypes=("float32", "float16"))
    assert mamba.page_size_bytes == 2 * 3 * 4 + 5 * 2
    assert K.MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float32",),
                       page_size_padded=100).page_size_bytes == 100
    assert K.MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float32",),
                       page_size_padded=10).page_size_bytes == 24
    with pytest.raises(NotImplementedError):
        _ = K.KVCacheSpec(block_size=4).page_size_bytes


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_positive_int_fields_are_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"block_size must be a positive int, got {bad!r}"):
        K.KVCacheSpec(block_size=bad)
    with pytest.raises(ValueError, match=f"sliding_window must be a positive int, got {bad!r}"):
        attn(K.SlidingWindowSpec, sliding_window=bad)
    message = f"attention_chunk_size must be a positive int, got {bad!r}"
    with pytest.raises(ValueError, match=message):
        attn(K.ChunkedLocalAttentionSpec, attention_chunk_size=bad)


def test_smallest_valid_values_are_accepted() -> None:
    assert K.KVCacheSpec(block_size=1).block_size == 1
    assert attn(K.SlidingWindowSpec, sliding_window=1).sliding_window == 1
    assert attn(K.ChunkedLocalAttentionSpec, attention_chunk_size=1).attention_chunk_size == 1
    assert K.MambaSpec(block_size=1, num_speculative_blocks=0).num_speculative_blocks == 0


def test_mamba_spec_validation() -> None:
    for mode in ("none", "all", "align"):
        assert K.MambaSpec(block_size=4, mamba_cache_mode=mode).mamba_cache_mode == mode
    message = "mamba_cache_mode must be 'none', 'all' or 'align', got 'x'"
    with pytest.raises(ValueError, match=message):
        K.MambaSpec(block_size=4, mamba_cache_mode="x")
    for bad in (-1, 1.0):
        message = f"num_speculative_blocks must be a non-negative int, got {bad!r}"
        with pytest.raises(ValueError, match=message):
            K.MambaSpec(block_size=4, num_speculative_blocks=bad)


def test_admission_caps() -> None:
    swa = attn(K.SlidingWindowSpec, sliding_window=9)
    # (9 - 1 + 16) tokens = 6 blocks of 4, plus one for a window starting mid-block
    assert swa.max_admission_blocks_per_request(16, 1000) == 7
    assert swa.max_admission_blocks_per_request(16, 10) == 4  # capped by max_model_len
    chunked = attn(K.ChunkedLocalAttentionSpec, attention_chunk_size=8)
    assert chunked.max_admission_blocks_per_request(9, 1000) == 5  # (8 + 9) / 4, rounded up
    assert chunked.max_admission_blocks_per_request(9, 6) == 2


def test_spec_kind_and_window_labels() -> None:
    mamba = K.MambaSpec(block_size=4)
    cases = [
        (attn(), "full_attention", None),
        (attn(K.ChunkedLocalAttentionSpec, attention_chunk_size=8), "chunked_local_attention",
         None),
        (attn(K.SlidingWindowSpec, sliding_window=8), "sliding_window", 8),
        (mamba, "mamba", None),
        (attn(K.CrossAttentionSpec), "cross_attention", None),
        (K.KVCacheSpec(block_size=4), "unknown", None),
    ]
    for spec, kind, window in cases:
        assert K.get_kv_cache_spec_kind(spec) == kind
        assert K.get_kv_cache_spec_sliding_window(spec) == window


def test_config_mamba_flags() -> None:
    plain = K.KVCacheConfig(4, [], [K.KVCacheGroupSpec(["a"], attn())])
    assert not plain.has_mamba_layers and not plain.needs_kv_cache_zeroing
    hybrid = K.KVCacheConfig(4, [], [K.KVCacheGroupSpec(["a"], attn()),
                                      K.KVCacheGroupSpec(["m"], K.MambaSpec(block_size=4))])
    assert hybrid.has_mamba_layers and hybrid.needs_kv_cache_zeroing


# ---------------------------------------------------------------- request


def test_request_status_is_finished() -> None:
    finished = {s for s in K.RequestStatus if K.RequestStatus.is_finished(s)}
    assert min(finished) == K.RequestStatus.FINISHED_STOPPED
    assert K.RequestStatus.PREEMPTED not in finished and K.RequestStatus.RUNNING not in finished
    assert len(finished) == 6
    r = make_request("a", [1, 2])
    assert not r.is_finished()
    r.status = K.RequestStatus.FINISHED_ABORTED
    assert r.is_finished()
    assert str(K.RequestStatus.RUNNING) == "RUNNING"


def test_request_fields_and_token_views() -> None:
    r = make_request("a", [1, 2, 3, 4, 5], arrival_time=3.5, priority=2, client_index=1)
    assert (r.arrival_time, r.priority, r.client_index) == (3.5, 2, 1)
    assert make_request("b", [1]).arrival_time == 0.0
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens) == (5, 5, 0)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(6)
    r.append_output_token_ids([7, 8, 9])
    assert list(r.output_token_ids) == [6, 7, 8, 9]
    assert list(r.all_token_ids) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert (r.num_tokens, r.num_output_tokens) == (9, 4)
    assert len(r.block_hashes) == 2  # the block completed by the outputs was hashed
    r.spec_token_ids = [1, 1]
    assert r.num_tokens_with_spec == 11
    assert repr(r) == "Request('a', num_tokens=9, status=WAITING, num_computed_tokens=0)"
    unhashed = K.Request("c", [1, 2, 3, 4])
    unhashed.append_output_token_ids(5)
    assert unhashed.block_hashes == []


def test_request_rejects_bad_ids_and_prompts() -> None:
    with pytest.raises(TypeError, match="request_id must be a str, got 7"):
        K.Request(7, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_token_ids=None"):
        K.Request("a", None)
    with pytest.raises(ValueError, match="lora_int_id must be > 0, got 0"):
        K.LoRARequest("l", 0)
    assert K.LoRARequest("l", 1).adapter_id == 1


def test_skip_reading_prefix_cache_from_params() -> None:
    class Params:
        skip_reading_prefix_cache = True

    assert not K.Request("a", [1]).skip_reading_prefix_cache
    assert K.Request("a", [1], sampling_params=Params()).skip_reading_prefix_cache
    assert K.Request("a", [1], pooling_params=Params()).skip_reading_prefix_cache
    assert not K.Request("a", [1], sampling_params=Params(),
                         skip_reading_prefix_cache=False).skip_reading_prefix_cache


# ---------------------------------------------------------------- kv_cache_utils


def test_hash_functions_by_name() -> None:
    data = (b"parent", (1, 2, 3), None)
    cbor = cbor2.dumps(data, canonical=True)
    pickled = pickle.dumps(data, protocol=5)
    assert K.get_hash_fn_by_name("sha256_cbor")(data) == hashlib.sha256(cbor).digest()
    assert K.get_hash_fn_by_name("xxhash")(data) == xx.xxh3_128_digest(pickled)
    assert K.get_hash_fn_by_name("xxhash_cbor")(data) == xx.xxh3_128_digest(cbor)
    assert K.get_hash_fn_by_name("sha256")(data) == hashlib.sha256(pickled).digest()
    with pytest.raises(ValueError, match=r"Unsupported hash function: hash_fn_name='x'"):
        K.get_hash_fn_by_name("x")
    # A name of the wrong type: the pure build names it in its ValueError; the
    # compiled build's signature refuses it before the body runs.
    with pytest.raises(TypeError if K.COMPILED else ValueError, match=r"str|\['x'\]"):
        K.get_hash_fn_by_name(["x"])  # type: ignore[arg-type]


def test_need_extra_keys() -> None:
    assert not kcu.need_extra_keys(make_request("a", [1]))
    assert kcu.need_extra_keys(make_request("a", [1], cache_salt=""))
    assert kcu.need_extra_keys(make_request("a", [1], lora_request=K.LoRARequest("l", 1)))
    mm = [K.MultiModalFeatureSpec("img", K.PlaceholderRange(0, 1))]
    assert kcu.need_extra_keys(make_request("a", [1], mm_features=mm))


def test_block_hash_bookkeeping() -> None:
    block = K.KVCacheBlock(3)
    key = kcu.make_block_hash_with_group_id(K.BlockHash(b"h"), 2)
    block.set_block_hash(key, num_tokens=4)
    assert block.block_hash == key and block.block_hash_num_tokens == 4
    with pytest.raises(AssertionError, match="block 3 already has a hash"):
        block.set_block_hash(key)
    block.reset_hash()
    assert block.block_hash is None and block.block_hash_num_tokens is None
    block.set_block_hash(key)
    assert block.block_hash == key


def test_free_queue_membership_and_append_n() -> None:
    blocks = [K.KVCacheBlock(i) for i in range(4)]
    queue = K.FreeKVCacheBlockQueue(blocks[:2])
    assert blocks[0] in queue and blocks[3] not in queue
    queue.append_n([blocks[3], blocks[2]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 2]
    assert queue.num_free_blocks == 4
    assert blocks[2] in queue
    queue.remove(blocks[2])
    assert blocks[2] not in queue
    assert [b.block_id for b in queue.popleft_n(3)] == [0, 1, 3]
    assert blocks[0] not in queue


# ---------------------------------------------------------------- block_pool


def test_hash_to_block_map_public_api() -> None:
    m = BlockHashToBlockMap()
    h = K.BlockHash(b"h")
    key0 = kcu.make_block_hash_with_group_id(h, 0)
    key1 = kcu.make_block_hash_with_group_id(h, 1)
    blocks = [K.KVCacheBlock(i) for i in range(4)]
    assert m.get_one_block(key0) is None and m.get_blocks(key0) == [] and len(m) == 0
    assert m.pop(key0, 1) is None
    m.insert(key0, blocks[1])
    m.insert(key0, blocks[2])
    m.insert(key0, blocks[3])
    m.insert(key1, blocks[0])
    assert len(m) == 2
    assert m.get_one_block(key0) is blocks[1] and m.get_one_block(key1) is blocks[0]
    assert m.get_blocks(key0) == blocks[1:] and m.get_blocks(key1) == [blocks[0]]
    assert m.contain(key0, 2) and not m.contain(key0, 0) and m.contain(key1, 0)
    assert m.pop(key0, 0) is None and m.pop(key1, 3) is None
    assert m.pop(key0, 2) is blocks[2]  # a younger duplicate leaves, the oldest stays
    assert m.get_blocks(key0) == [blocks[1], blocks[3]]
    assert m.pop(key0, 1) is blocks[1]  # the oldest leaves: the next one is promoted
    assert m.get_one_block(key0) is blocks[3] and m.get_blocks(key0) == [blocks[3]]
    assert m.pop(key0, 3) is blocks[3]
    assert m.get_one_block(key0) is None and len(m) == 1
    assert m.pop(kcu.make_block_hash_with_group_id(h, 5), 0) is None


SWA = attn(K.SlidingWindowSpec, sliding_window=5)


def test_get_cached_block_needs_every_group() -> None:
    m = make_manager(attn(), attn(), SWA, num_blocks=32)
    a = make_request("a", list(range(9)))
    ids = admit(m, a)
    pool = m.block_pool
    h0 = a.block_hashes[0]
    found = pool.get_cached_block(h0, [0, 1])
    assert found is not None and [b.block_id for b in found] == [ids[0][0], ids[1][0]]
    assert pool.get_cached_block(h0, [1]) == [found[1]]
    assert pool.get_cached_block(K.BlockHash(b"nope"), [0, 1]) is None
    assert pool.get_cached_block(h0, [0, 7]) is None


def test_two_groups_of_one_spec_hit_only_where_both_cached() -> None:
    """Two full-attention groups with equal specs search together (a hit needs
    the block cached in both); evicting one group's copy ends the hit there."""
    m = make_manager(attn(), attn(), SWA, num_blocks=32)
    a = make_request("a", list(range(13)))
    ids_a = admit(m, a)
    b = make_request("b", list(range(13)))
    hits, n = m.get_computed_blocks(b)
    assert n == 12 and hits.get_block_ids()[:2] == (ids_a[0][:3], ids_a[1][:3])
    m.free(a)
    m.evict_blocks({ids_a[1][1]})  # group 1's second block leaves the cache
    hits, n = m.get_computed_blocks(b)
    assert n == 4 and hits.get_block_ids()[:2] == ([ids_a[0][0]], [ids_a[1][0]])


def test_find_longest_cache_hit_per_group() -> None:
    m = make_manager(attn(), SWA, num_blocks=32)
    a = make_request("a", list(range(17)))
    ids = admit(m, a)
    coordinator = m.coordinator
    blocks, lengths = coordinator.find_longest_cache_hit_per_group(a.block_hashes, 16)
    assert lengths == (16, 16)
    assert [b.block_id for b in blocks[0]] == ids[0][:4]
    assert [b.block_id for b in blocks[1]] == [0, 0, 0, ids[1][3]]  # the window's last block
    blocks, lengths = coordinator.find_longest_cache_hit_per_group(a.block_hashes, 8)
    assert lengths == (8, 8) and [b.block_id for b in blocks[0]] == ids[0][:2]


def test_no_prefix_cache_coordinator_never_hits() -> None:
    m = make_manager(attn(), enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(m, a)
    blocks, n = m.coordinator.find_longest_cache_hit(a.block_hashes, 8)
    assert blocks == ([],) and n == 0
    two = make_manager(attn(), attn(), enable_caching=False)
    assert two.coordinator.find_longest_cache_hit(a.block_hashes, 8) == (([], []), 0)


def test_cross_attention_manager_refuses_caching() -> None:
    cross = attn(K.CrossAttentionSpec)
    m = make_manager(attn(), cross, enable_caching=False, max_model_len=64)
    manager = m.coordinator.single_type_managers[1]
    r = make_request("a", list(range(8)))
    assert manager.get_num_common_prefix_blocks("a") == 0
    with pytest.raises(ValueError, match="never cached"):
        manager.cache_blocks(r, 8)
    with pytest.raises(NotImplementedError, match="does not support caching"):
        type(manager).find_longest_cache_hit(r.block_hashes, 8, [1], m.block_pool, cross,
                                             False, BS)
    with pytest.raises(NotImplementedError):
        K.SingleTypeKVCacheManager.find_longest_cache_hit(r.block_hashes, 8, [0], m.block_pool,
                                                         attn(), False, BS)


# ---------------------------------------------------------------- kv_cache_manager


def test_kv_cache_blocks_helpers() -> None:
    b = [K.KVCacheBlock(i) for i in range(5)]
    b[1].set_block_hash(kcu.make_block_hash_with_group_id(K.BlockHash(b"x"), 0))
    one = K.KVCacheBlocks(([b[1], b[2]],))
    assert (one + K.KVCacheBlocks(([b[3]],))).get_block_ids() == ([1, 2, 3],)
    assert one.get_unhashed_block_ids() == [2]
    two = K.KVCacheBlocks(([b[1], b[2]], [b[3], b[4]]))
    assert (two + K.KVCacheBlocks(([b[0]], []))).get_block_ids() == ([1, 2, 0], [3, 4])
    with pytest.raises(ValueError, match="needs one group, got 2"):
        two.get_unhashed_block_ids()
    null = K.KVCacheBlock(0)
    null.is_null = True
    assert K.KVCacheBlocks(([null, b[1], b[2]], [b[4]])).get_unhashed_block_ids_all_groups() == [
        [2], [4]
    ]
    assert two.new_empty().get_block_ids() == ([], [])
    assert two.new_empty().get_block_ids(allow_none=True) is None
    assert K.KVCacheBlocks(([], [b[0]])).get_block_ids(allow_none=True) == ([], [0])


def checks_after_calls(m: K.KVCacheManager) -> bool:
    """Whether ``m`` runs its invariant checks after each call: corrupt the pool
    (a free block with a reference) and see whether the next call notices."""
    block = m.block_pool.blocks[-1]
    assert block.ref_cnt == 0
    block.ref_cnt = 3
    try:
        m.take_new_block_ids()
    except AssertionError as exc:
        assert "invariant broken after take_new_block_ids()" in str(exc)
        return True
    finally:
        block.ref_cnt = 0
    return False


@pytest.fixture
def self_checking() -> Any:
    """The manager module whose self-check mode the tests drive: kvcache's own under
    the pure build; under the compiled build, which refuses the mode (its instances'
    methods are fixed), the pure copy beside it (``kvcache._builds.pure_copy``)."""
    if not K.COMPILED:
        return kvcache.kv_cache_manager
    with pytest.raises(RuntimeError, match="needs the pure-Python build"):
        K.enable_self_check(make_manager())
    return _builds.pure_copy()["kv_cache_manager"]


def test_enable_self_check_names_the_call_that_broke_an_invariant(self_checking: Any) -> None:
    m = make_manager(cls=self_checking.KVCacheManager)
    assert not checks_after_calls(m)
    self_checking.enable_self_check(m)
    a = make_request("a", list(range(9)))
    admit(m, a)
    m.block_pool.blocks[5].ref_cnt = 3  # a free block with references: corrupt
    with pytest.raises(AssertionError, match=r"invariant broken after free\(\)"):
        m.free(a)
    m.block_pool.blocks[5].ref_cnt = 0
    m.take_events()
    m.block_pool.blocks[5].ref_cnt = 3
    with pytest.raises(AssertionError, match=r"invariant broken after free_blocks\(\)"):
        m.block_pool.free_blocks([])
    m.block_pool.blocks[5].ref_cnt = 0
    assert checks_after_calls(m)
    for name in ("get_computed_blocks", "allocate_slots", "evict_blocks", "new_step_starts"):
        assert getattr(m, name).__name__ == name


def test_self_check_env_turns_it_on(monkeypatch: pytest.MonkeyPatch, self_checking: Any) -> None:
    cls = self_checking.KVCacheManager
    for value, on in (("0", False), ("", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("KVCACHE_SELF_CHECK", value)
        assert checks_after_calls(make_manager(cls=cls)) == on, value
    monkeypatch.delenv("KVCACHE_SELF_CHECK")
    assert not checks_after_calls(make_manager(cls=cls))
    monkeypatch.setenv("KVCACHE_SELF_CHECK", "1")
    checked = make_manager(cls=cls)
    a = make_request("a", list(range(5)))
    admit(checked, a)
    checked.free(a)
    assert checked.block_pool.get_num_free_blocks() == 15


def test_free_queue_against_a_list() -> None:
    """Random queue operations against a plain list, the queue's abstract state."""
    rng = random.Random(0)
    for _ in range(30):
        blocks = [K.KVCacheBlock(i) for i in range(8)]
        initial = blocks[: rng.randint(0, 8)]
        queue = K.FreeKVCacheBlockQueue(initial)
        model = list(initial)
        for _ in range(25):
            outside = [b for b in blocks if b not in model]
            op = rng.choice(["popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"])
            if op == "popleft" and model:
                assert queue.popleft() is model.pop(0)
            elif op == "popleft_n":
                n = rng.randint(0, len(model))
                assert queue.popleft_n(n) == model[:n]
                del model[:n]
            elif op == "remove" and model:
                block = rng.choice(model)
                queue.remove(block)
                model.remove(block)
            elif op == "append" and outside:
                block = rng.choice(outside)
                queue.append(block)
                model.append(block)
            elif op in ("append_n", "prepend_n"):
                chosen = rng.sample(outside, rng.randint(0, len(outside)))
                getattr(queue, op)(chosen)
                model[:] = [*model, *chosen] if op == "append_n" else [*chosen, *model]
            assert queue.get_all_free_blocks() == model
            assert len(queue) == queue.num_free_blocks == len(model)
            assert all((b in queue) == (b in model) for b in blocks)
        for block in list(model):  # every link still leads both ways
            queue.remove(block)
        assert len(queue) == 0 and queue.get_all_free_blocks() == []


def test_free_queue_refusals() -> None:
    blocks = [K.KVCacheBlock(i) for i in range(3)]
    queue = K.FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(RuntimeError, match=r"remove\(\) called on a block not in the free queue"):
        queue.remove(blocks[2])
    with pytest.raises(ValueError, match="cannot pop n=3 blocks from 2 free blocks"):
        queue.popleft_n(3)
    with pytest.raises(ValueError, match="cannot pop n=-1 blocks"):
        queue.popleft_n(-1)
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    queue.prepend_n([])
    assert len(queue) == 0


def test_none_hash_follows_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("PYTHONHASHSEED", "7")
        K.init_none_hash(K.sha256)
        assert hashlib.sha256(pickle.dumps("7", protocol=5)).digest() == kcu.NONE_HASH
        monkeypatch.delenv("PYTHONHASHSEED")
        K.init_none_hash(K.sha256)
        first = kcu.NONE_HASH
        K.init_none_hash(K.sha256)
        assert len(first) == 32 and first != kcu.NONE_HASH  # random bytes per process
    finally:
        monkeypatch.undo()
        K.init_none_hash(K.sha256)


def test_allocation_beyond_max_model_len_names_the_counts() -> None:
    m = make_manager(max_model_len=16)
    r = make_request("a", list(range(10)))
    r.num_computed_tokens = 3
    with pytest.raises(ValueError, match=r"request 'a' would reach 23 tokens \(num_computed_tokens"
                                         r"=3 \+ new hits 0 \+ external 0 \+ num_new_tokens 20\), "
                                         r"beyond max_model_len=16"):
        m.allocate_slots(r, 20)


def test_hit_searches_default_to_one_rank() -> None:
    """``find_longest_cache_hit`` without the context-parallel sizes means one rank."""
    chunk = attn(K.ChunkedLocalAttentionSpec, attention_chunk_size=8)
    m = make_manager(attn(), chunk, num_blocks=32)
    a = make_request("a", list(range(13)))
    ids = admit(m, a)
    manager_cls = type(m.coordinator.single_type_managers[1])
    hit = manager_cls.find_longest_cache_hit(
        a.block_hashes, 12, [1], m.block_pool, chunk, False, BS
    )
    assert [b.block_id for b in hit[0]] == [0, 0, ids[1][2]]
    for eagle, alignment in ((True, BS), (False, 2 * BS)):
        with pytest.raises(NotImplementedError, match="neither EAGLE nor groups of other block"):
            manager_cls.find_longest_cache_hit(a.block_hashes, 12, [1], m.block_pool, chunk,
                                               eagle, alignment)


def test_hash_list_view_indexes_like_a_list() -> None:
    fine = [K.BlockHash(bytes([i])) for i in range(7)]
    view = K.BlockHashListWithBlockSize(fine, 2, 6)  # a coarse block is 3 fine ones
    coarse = [fine[2], fine[5]]
    assert len(view) == 2 and list(view) == coarse
    for i in range(-3, 3):
        if -2 <= i < 2:
            assert view[i] == coarse[i]
        else:
            with pytest.raises(IndexError, match=f"block index {i + 2 if i < 0 else i} out of"):
                view[i]
    assert view[:] == coarse and view[1:] == coarse[1:] and view[::-1] == coarse[::-1]
    with pytest.raises(TypeError, match="Invalid index type"):
        view["0"]  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="target_block_size=5 is not a multiple of "
                                         "hash_block_size=2"):
        K.BlockHashListWithBlockSize(fine, 2, 5)


# ---------------------------------------------------------------- second round


def message(call: Any) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("no exception")


def test_exact_messages_of_refusals() -> None:
    """Refusals at the public boundary, word for word (tests elsewhere search
    them for the argument's name and value)."""
    two = K.KVCacheConfig(8, [], [K.KVCacheGroupSpec(["a"], attn()),
                                  K.KVCacheGroupSpec(["b"], K.FullAttentionSpec(
                                      block_size=BS, num_kv_heads=2, head_size=8,
                                      dtype="float16"))])
    m = make_manager(attn(), attn(K.CrossAttentionSpec), enable_caching=False)
    cross = m.coordinator.single_type_managers[1]
    r = make_request("a", list(range(8)))
    view = K.BlockHashListWithBlockSize([], 1, 2)
    chunk = attn(K.ChunkedLocalAttentionSpec, attention_chunk_size=8)
    cases = [
        (lambda: K.UnitaryKVCacheCoordinator(two, 64, 64, False, True, False, 1, 1, BS, BS),
         "ValueError: UnitaryKVCacheCoordinator needs exactly one KV-cache group, got 2"),
        (lambda: cross.cache_blocks(r, 8),
         "ValueError: cross-attention blocks are never cached (prefix caching must be off)"),
        (lambda: type(cross).find_longest_cache_hit([], 8, [1], m.block_pool, attn(), False, BS),
         "NotImplementedError: CrossAttentionManager does not support caching"),
        (lambda: K.ChunkedLocalAttentionManager.find_longest_cache_hit(
            [], 8, [0], m.block_pool, chunk, True, BS),
         "NotImplementedError: chunked local attention supports neither EAGLE nor groups of "
         "other block sizes"),
        (lambda: make_manager(prefix_cache_retention_interval=4),
         "ValueError: prefix_cache_retention_interval=4 is set but no KV-cache group is "
         "sliding-window or Mamba, the only kinds whose cached blocks it thins out; unset it"),
        (lambda: make_manager(SWA, prefix_cache_retention_interval=6),
         "ValueError: prefix_cache_retention_interval=6 must be non-negative and a multiple "
         "of scheduler_block_size=4"),
        (lambda: view["0"], "TypeError: Invalid index type: <class 'str'>"),
        (lambda: K.KVCacheBlocks(([], [])).get_unhashed_block_ids(),
         "ValueError: get_unhashed_block_ids needs one group, got 2"),
        (lambda: K.MambaSpec(block_size=4, num_speculative_blocks=-1),
         "ValueError: num_speculative_blocks must be a non-negative int, got -1"),
    ]
    for call, expected in cases:
        assert message(call) == expected


def swa_cached_positions(m: K.KVCacheManager, r: K.Request, group: int) -> list[int]:
    """Positions of ``r``'s blocks in ``group`` whose hash is in the prefix cache."""
    return [i for i, h in enumerate(r.block_hashes)
            if m.block_pool.get_cached_block(h, [group]) is not None]


def test_retention_interval_reaches_the_sliding_window_cache() -> None:
    # Window 5 of 4-token blocks: a hit needs 1 block. Dense caching keeps all 4;
    # interval 8 keeps every 2nd block's tail and the replay tail (16 -> block 3);
    # interval 0 only the replay tail.
    for interval, expected in ((None, [0, 1, 2, 3]), (8, [1, 3]), (0, [3])):
        m = make_manager(attn(), SWA, num_blocks=32)
        m.coordinator.retention_interval = interval
        r = make_request("a", list(range(17)))
        admit(m, r)
        assert swa_cached_positions(m, r, 1) == expected, interval
        assert swa_cached_positions(m, r, 0) == [0, 1, 2, 3]  # full attention: all


def test_retention_interval_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "8")
    assert make_manager(attn(), SWA).coordinator.retention_interval == 8
    # An explicit value wins, None included (dense caching).
    m = make_manager(attn(), SWA, prefix_cache_retention_interval=None)
    assert m.coordinator.retention_interval is None
    monkeypatch.setenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "-4")
    with pytest.raises(ValueError, match="VLLM_PREFIX_CACHE_RETENTION_INTERVAL=-4 must be non-"):
        make_manager(attn(), SWA)
    monkeypatch.setenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "eight")
    with pytest.raises(ValueError, match="VLLM_PREFIX_CACHE_RETENTION_INTERVAL='eight' is not"):
        make_manager(attn(), SWA)
    monkeypatch.delenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL")
    assert make_manager(attn(), SWA).coordinator.retention_interval is None
    for bad in ("8", True):  # (a float: TypeError on the compiled build, as its annotation says)
        with pytest.raises(ValueError, match=f"prefix_cache_retention_interval={bad!r}: expected"):
            make_manager(attn(), SWA, prefix_cache_retention_interval=bad)


def test_coordinator_records_its_setup() -> None:
    m = make_manager()
    assert (m.coordinator.dcp_world_size, m.coordinator.pcp_world_size) == (1, 1)
    assert m.coordinator.single_type_managers[0].use_eagle is False
    eagle = K.KVCacheConfig(16, [], [K.KVCacheGroupSpec(["a"], attn(), is_eagle_group=True)])
    me = K.KVCacheManager(eagle, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS)
    assert me.coordinator.single_type_managers[0].use_eagle is True


def test_sliding_window_spec_defaults_v_head_size_to_k() -> None:
    assert SWA.head_size_v == SWA.head_size == 8
    assert attn(K.SlidingWindowSpec, sliding_window=2, head_size_v=4).head_size_v == 4


def test_kv_cache_blocks_add_stops_at_the_shorter_operand_like_vllm() -> None:
    b = [K.KVCacheBlock(i) for i in range(3)]
    assert (K.KVCacheBlocks(([b[0]],)) + K.KVCacheBlocks(([b[1]], [b[2]]))).get_block_ids() == (
        [0, 1],
    )


def test_cbor_hashes_are_canonical() -> None:
    data = {"b": 1, "a": 1.5}
    cbor = cbor2.dumps(data, canonical=True)
    assert cbor != cbor2.dumps(data)
    assert K.get_hash_fn_by_name("sha256_cbor")(data) == hashlib.sha256(cbor).digest()
    assert K.get_hash_fn_by_name("xxhash_cbor")(data) == xx.xxh3_128_digest(cbor)


def test_find_longest_cache_hit_per_group_drops_the_eagle_block() -> None:
    m = make_manager(attn(), SWA, num_blocks=32, use_eagle=True)
    a = make_request("a", list(range(17)))
    admit(m, a)
    _, lengths = m.coordinator.find_longest_cache_hit_per_group(a.block_hashes, 16)
    assert lengths[0] == 12


def test_running_request_caps_lookahead_at_max_model_len() -> None:
    m = make_manager(max_model_len=16, num_blocks=16)
    r = make_request("a", list(range(12)))
    admit(m, r)
    new = m.allocate_slots(r, 2, num_lookahead_tokens=8)
    assert new is not None and len(new.get_block_ids()[0]) == 1  # 16 tokens: 4 blocks


def test_running_request_refused_when_reserved_blocks_exceed_the_free_ones() -> None:
    """A running request that needs no new block is still refused when the blocks
    reserved for others exceed the free ones."""
    m = make_manager(num_blocks=8, max_model_len=64)
    r = make_request("a", list(range(8)))
    admit(m, r)
    assert m.allocate_slots(r, 1, num_lookahead_tokens=8) is not None  # holds 5 blocks
    r.num_computed_tokens += 1
    free = m.block_pool.get_num_free_blocks()
    assert m.allocate_slots(r, 1, reserved_blocks=free + 1) is None
    assert m.allocate_slots(r, 1, reserved_blocks=free) is not None


def test_prefix_cache_stats_record() -> None:
    stats = K.PrefixCacheStats()
    stats.record(10, 4, preempted=False)
    stats.record(6, 2, preempted=False)
    stats.record(8, 8, preempted=True)
    stats.record(3, 1, preempted=True)
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 6)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (2, 11, 9)
    assert stats.reset is False


def pool_with_traffic() -> tuple[K.KVCacheManager, list[K.KVCacheBlock]]:
    """Two requests sharing a cached prefix (blocks 1-2 held twice), one freed
    request's blocks cached in the free queue; returns the free blocks, front first."""
    m = make_manager(num_blocks=12)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(m, a)
    admit(m, b)
    c = make_request("c", [7] * 9)
    admit(m, c)
    m.free(c)
    m.check_invariants()
    return m, m.block_pool.free_block_queue.get_all_free_blocks()


def link(prev: K.KVCacheBlock, block: K.KVCacheBlock, nxt: K.KVCacheBlock) -> None:
    prev.next_free_block, block.prev_free_block = block, prev
    block.next_free_block, nxt.prev_free_block = nxt, block


def corrupted(corrupt: Any) -> str:
    m, free = pool_with_traffic()
    corrupt(m, m.block_pool, m.block_pool.free_block_queue, free)
    return message(m.check_invariants)


def test_check_invariants_names_each_broken_invariant() -> None:
    def duplicate(m: Any, pool: Any, queue: Any, free: Any) -> None:
        link(free[-1], K.KVCacheBlock(free[0].block_id), queue.fake_free_list_tail)
        queue.num_free_blocks += 1

    def null_in_queue(m: Any, pool: Any, queue: Any, free: Any) -> None:
        link(free[-1], pool.null_block, queue.fake_free_list_tail)
        queue.num_free_blocks += 1

    def stray_link(m: Any, pool: Any, queue: Any, free: Any) -> None:
        pool.blocks[1].prev_free_block = free[0]

    def shared_undercount(m: Any, pool: Any, queue: Any, free: Any) -> None:
        pool.blocks[1].ref_cnt = 1  # held by both requests

    cases = [
        (lambda m, pool, queue, free: setattr(free[1], "next_free_block", None),
         "AssertionError: free queue list is cut"),
        (lambda m, pool, queue, free: setattr(free[2], "prev_free_block", free[0]),
         "AssertionError: block {}: broken back link"),
        (lambda m, pool, queue, free: setattr(queue.fake_free_list_tail, "prev_free_block",
                                              free[0]),
         "AssertionError: free queue tail link broken"),
        (lambda m, pool, queue, free: setattr(queue, "num_free_blocks", len(free) + 1),
         "AssertionError: free queue counts {n1} blocks but links {n}"),
        (duplicate, "AssertionError: free queue holds a block twice"),
        (null_in_queue, "AssertionError: null block in the free queue"),
        (lambda m, pool, queue, free: setattr(pool.blocks[1], "ref_cnt", 0),
         "AssertionError: block 1: ref_cnt=0, in free queue=False"),
        (stray_link, "AssertionError: block 1 is in use but still linked into the free queue"),
        (shared_undercount, "AssertionError: block 1: ref_cnt=1, held 2x"),
    ]
    _, free = pool_with_traffic()
    for corrupt, expected in cases:
        expected = expected.replace("{}", str(free[2].block_id))
        expected = expected.replace("{n1}", str(len(free) + 1)).replace("{n}", str(len(free)))
        assert corrupted(corrupt) == expected


def test_retention_interval_reaches_running_hybrid_requests() -> None:
    m = make_manager(attn(), SWA, num_blocks=32)
    r = make_request("a", list(range(9)))
    admit(m, r)
    assert swa_cached_positions(m, r, 1) == [0, 1]  # dense so far
    m.coordinator.retention_interval = 0
    r.append_output_token_ids(list(range(8)))
    assert m.allocate_slots(r, 8) is not None
    # Decode blocks are past the prompt's replay tail (block 1): none is cached.
    assert swa_cached_positions(m, r, 1) == [0, 1]
    assert swa_cached_positions(m, r, 0) == [0, 1, 2, 3]


def test_event_hashes_are_the_low_64_bits_unless_bytes_are_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = K.BlockHash(bytes(range(1, 25)))  # 24 bytes: the top 16 are cut off
    expected = int.from_bytes(bytes(range(17, 25)), "big")
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert kcu.maybe_convert_block_hash(h) == expected
    assert kcu.maybe_convert_block_hash(K.BlockHash(b"\xff" * 8)) == (1 << 64) - 1
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    assert kcu.maybe_convert_block_hash(h) == expected
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert kcu.maybe_convert_block_hash(h) == h


def test_pool_keys_append_the_group_id_big_endian() -> None:
    key = kcu.make_block_hash_with_group_id(K.BlockHash(b"ab"), 258)
    assert key == b"ab\x00\x00\x01\x02"
    assert kcu.get_group_id(key) == 258 and kcu.get_block_hash(key) == b"ab"


def test_hashes_extended_after_outputs_equal_a_fresh_request_of_the_same_tokens() -> None:
    """The hasher chains new blocks onto the request's last hash, so a request whose
    outputs completed blocks hashes like a new prompt holding the same tokens
    (that is what lets a follow-up turn hit them)."""
    mm = [K.MultiModalFeatureSpec("img", K.PlaceholderRange(2, 7))]
    for kwargs in ({}, {"mm_features": mm}, {"cache_salt": "s"}):
        grown = make_request("a", [0, 1, 2, 3, 4], **kwargs)
        grown.append_output_token_ids([5, 6])
        grown.append_output_token_ids([7, 8, 9, 10, 11, 12])
        fresh = make_request("b", list(range(13)), **kwargs)
        assert len(grown.block_hashes) == 3
        assert grown.block_hashes == fresh.block_hashes, kwargs
