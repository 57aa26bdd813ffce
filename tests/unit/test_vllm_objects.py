"""kvcache's core accepts vLLM 0.25.1's own objects, and vLLM is the judge.

* Spec kinds: every spec class of vLLM's ``kv_cache_interface`` gets the kind,
  sliding window and manager vLLM itself gives it (or, for kinds issue 14 models,
  a clear ``NotImplementedError``); subclasses of either family are recognised.
* Lockstep: a ``kvcache.KVCacheManager`` built from vLLM's ``KVCacheConfig``,
  specs (torch dtypes) and ``SamplingParams``-built ``Request`` objects returns
  the same hits, block ids and frees as one built from kvcache's own objects and
  as vLLM's own manager.
* ``KVCacheSpec.merge`` agrees with vLLM's (results and which inputs fail).
* ``take_events`` warns on vLLM's ``logger`` for an out-of-range group index.
* ``BlockPool.cache_partial_block``: kvcache against the spec oracle (no vLLM
  needed), and against vLLM's own pool when vLLM is installed.
* A hash function returning ints (the builtin ``hash()``, as vLLM's own tests
  use) hashes requests on both builds, as vLLM's code lets it.

Tests that need vLLM use the ``vllm_reference`` fixture: they skip locally without
vLLM and fail under CI.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest

import kvcache as K
import spec as S
from kvcache.block_pool import PartialBlockError
from kvcache.kit.trace import canon
from kvcache.kv_cache_interface import (
    KVCacheSpecKind,
    KVCacheSpecMergeError,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
    is_spec_kind,
)
from kvcache.single_type_kv_cache_manager import get_manager_class_for_kv_cache_spec

needs_vllm = pytest.mark.usefixtures("vllm_reference")

# ---------------------------------------------------------------- vLLM's spec classes


def _vllm_specs() -> dict[str, Any]:
    """One instance of every spec class of vLLM 0.25.1's ``kv_cache_interface``."""
    import torch
    from vllm.v1 import kv_cache_interface as V

    attn: dict[str, Any] = dict(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    full = V.FullAttentionSpec(**attn)
    swa = V.SlidingWindowSpec(**attn, sliding_window=8)
    return {
        "FullAttentionSpec": full,
        "FullAttentionSpec+window": V.FullAttentionSpec(**attn, sliding_window=8),
        "TQFullAttentionSpec": V.TQFullAttentionSpec(**attn, tq_slot_size=4),
        "MLAAttentionSpec": V.MLAAttentionSpec(**attn),
        "HiddenStateCacheSpec": V.HiddenStateCacheSpec(**attn),
        "RSWASpec": V.RSWASpec(**attn, rswa_window=8),
        "SinkFullAttentionSpec": V.SinkFullAttentionSpec(**attn, sink_len=4),
        "SlidingWindowSpec": swa,
        "SlidingWindowMLASpec": V.SlidingWindowMLASpec(**attn, sliding_window=8),
        "ChunkedLocalAttentionSpec": V.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=8),
        "MambaSpec": V.MambaSpec(block_size=4, shapes=((2, 3),), dtypes=(torch.float32,)),
        "EncoderOnlyAttentionSpec": V.EncoderOnlyAttentionSpec(**attn),
        "CrossAttentionSpec": V.CrossAttentionSpec(**attn),
        "UniformTypeKVCacheSpecs(full)": V.UniformTypeKVCacheSpecs(
            block_size=4, kv_cache_specs={"a": full, "b": full}
        ),
        "UniformTypeKVCacheSpecs(mixed)": V.UniformTypeKVCacheSpecs(
            block_size=4, kv_cache_specs={"a": full, "b": swa}
        ),
    }


VLLM_SPEC_IDS = [
    "FullAttentionSpec", "FullAttentionSpec+window", "TQFullAttentionSpec", "MLAAttentionSpec",
    "HiddenStateCacheSpec", "RSWASpec", "SinkFullAttentionSpec", "SlidingWindowSpec",
    "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec", "MambaSpec",
    "EncoderOnlyAttentionSpec", "CrossAttentionSpec", "UniformTypeKVCacheSpecs(full)",
    "UniformTypeKVCacheSpecs(mixed)",
]  # fmt: skip


@needs_vllm
@pytest.mark.parametrize("name", VLLM_SPEC_IDS)
def test_vllm_spec_kind_and_window_match_vllm(name: str) -> None:
    """kvcache labels each vLLM spec exactly as vLLM's own helpers do."""
    from vllm.v1 import kv_cache_interface as V

    vllm_spec = _vllm_specs()[name]
    assert get_kv_cache_spec_kind(vllm_spec).value == V.get_kv_cache_spec_kind(vllm_spec).value
    assert get_kv_cache_spec_sliding_window(vllm_spec) == V.get_kv_cache_spec_sliding_window(
        vllm_spec
    )


@needs_vllm
def test_vllm_spec_kinds_are_not_unknown() -> None:
    """The issue's symptom: no single-kind vLLM spec reads as UNKNOWN."""
    specs = _vllm_specs()
    unknown = [
        n for n in VLLM_SPEC_IDS
        if n != "UniformTypeKVCacheSpecs(mixed)"
        and get_kv_cache_spec_kind(specs[n]) is KVCacheSpecKind.UNKNOWN
    ]  # fmt: skip
    assert unknown == []
    assert get_kv_cache_spec_kind(specs["MLAAttentionSpec"]) is KVCacheSpecKind.MLA_ATTENTION
    assert (
        get_kv_cache_spec_kind(specs["SlidingWindowMLASpec"]) is KVCacheSpecKind.SLIDING_WINDOW_MLA
    )


@needs_vllm
@pytest.mark.parametrize("name", VLLM_SPEC_IDS)
def test_vllm_spec_gets_the_manager_vllm_registers(name: str) -> None:
    """Same manager kind as vLLM's registry; kinds issue 14 models raise a clear error."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    vllm_spec = _vllm_specs()[name]
    vllm_cls = KVCacheSpecRegistry.get_manager_class(vllm_spec)
    if vllm_cls is None:
        with pytest.raises(NotImplementedError, match=type(vllm_spec).__name__) as err:
            get_manager_class_for_kv_cache_spec(vllm_spec)
        if vllm_cls is not None:
            assert "issue 14" in str(err.value)
        else:
            assert "registers none" in str(err.value)
        return
    assert get_manager_class_for_kv_cache_spec(vllm_spec).__name__ == vllm_cls.__name__


@needs_vllm
def test_subclasses_of_both_families_are_recognised() -> None:
    """A user's subclass (of kvcache's or vLLM's class) keeps its base's kind and manager."""
    import torch
    from vllm.v1 import kv_cache_interface as V

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyVllmWindow(V.SlidingWindowSpec):
        tag: str = "mine"

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyFull(K.FullAttentionSpec):
        tag: str = "mine"

    window = MyVllmWindow(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=8
    )
    full = MyFull(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    assert get_kv_cache_spec_kind(window) is KVCacheSpecKind.SLIDING_WINDOW
    assert get_kv_cache_spec_sliding_window(window) == 8
    assert get_manager_class_for_kv_cache_spec(window) is K.SlidingWindowManager
    assert get_kv_cache_spec_kind(full) is KVCacheSpecKind.FULL_ATTENTION
    assert get_manager_class_for_kv_cache_spec(full) is K.FullAttentionManager
    assert is_spec_kind(window, "AttentionSpec") and not is_spec_kind(window, "FullAttentionSpec")

    class Stranger(K.KVCacheSpec):
        pass

    with pytest.raises(NotImplementedError, match="Stranger is not supported"):
        get_manager_class_for_kv_cache_spec(Stranger(block_size=4))


@needs_vllm
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8", "float8_e4m3fn"])
def test_torch_dtypes_give_vllms_page_sizes(dtype: str) -> None:
    """kvcache's specs take torch dtypes (or their names) and size pages as vLLM does."""
    import torch
    from vllm.v1 import kv_cache_interface as V

    torch_dtype = getattr(torch, dtype)
    attn: dict[str, Any] = dict(block_size=16, num_kv_heads=4, head_size=64)
    for ours_dtype in (torch_dtype, dtype, str(torch_dtype)):
        for kind in ("FullAttentionSpec", "CrossAttentionSpec"):
            ours = getattr(K, kind)(**attn, dtype=ours_dtype)
            theirs = getattr(V, kind)(**attn, dtype=torch_dtype)
            assert ours.page_size_bytes == theirs.page_size_bytes
        ours_swa = K.SlidingWindowSpec(**attn, dtype=ours_dtype, sliding_window=64)
        theirs_swa = V.SlidingWindowSpec(**attn, dtype=torch_dtype, sliding_window=64)
        assert ours_swa.page_size_bytes == theirs_swa.page_size_bytes


@needs_vllm
def test_register_all_kvcache_specs_fills_vllms_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcache's registration hook maps vLLM's spec classes to kvcache's managers with
    vLLM's grouping bases (so vLLM's grouping helpers work), and keeps vLLM's own."""
    from vllm.v1 import kv_cache_spec_registry as registry

    from kvcache.single_type_kv_cache_manager import register_all_kvcache_specs

    monkeypatch.setattr(registry, "_REGISTRY_KVCACHESPEC_LIST", {})
    register_all_kvcache_specs(None)
    specs = _vllm_specs()
    for name in VLLM_SPEC_IDS:
        spec = specs[name]
        entry = registry.KVCacheSpecRegistry.get_manager_class(spec)
        if name.startswith(("EncoderOnly", "Uniform")):
            assert entry is None  # vLLM registers no manager for these either
            continue
        assert entry is not None and entry.__module__ == "kvcache.single_type_kv_cache_manager"
        base = registry.KVCacheSpecRegistry.get_uniform_type_base_spec(spec)
        assert base is not None and base.__module__ == "vllm.v1.kv_cache_interface"
        assert isinstance(spec, base)
    mla, full = specs["MLAAttentionSpec"], specs["FullAttentionSpec"]
    assert mla.is_uniform_with_collection({"a": mla, "b": full})
    register_all_kvcache_specs(None)  # a second call changes nothing and does not fail


# ---------------------------------------------------------------- lockstep with vLLM objects

BLOCK = 4
HashFn = Callable[[Any], bytes]


def _layout(lib: Any, kinds: tuple[str, ...], dtype: Any) -> Any:
    """A KVCacheConfig of ``lib`` (kvcache or vLLM's kv_cache_interface), one group per kind."""
    attn: dict[str, Any] = dict(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=dtype)
    make = {
        "full": lambda: lib.FullAttentionSpec(**attn),
        "mla": lambda: lib.MLAAttentionSpec(**attn),
        "swa": lambda: lib.SlidingWindowSpec(**attn, sliding_window=2 * BLOCK),
        "swa_mla": lambda: lib.SlidingWindowMLASpec(**attn, sliding_window=2 * BLOCK),
    }
    groups = [lib.KVCacheGroupSpec([f"layer.{i}"], make[k]()) for i, k in enumerate(kinds)]
    return lib.KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=groups)


class _Objects:
    """How one side builds its config and requests."""

    def __init__(self, family: str, kinds: tuple[str, ...]) -> None:
        self.family = family
        if family == "kvcache":
            self.config = _layout(K, kinds, "float16")
            self.hasher = K.get_request_block_hasher(BLOCK, K.sha256)
        else:
            import torch
            from vllm.utils.hashing import sha256
            from vllm.v1 import kv_cache_interface as V
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            init_none_hash(sha256)
            self.config = _layout(V, kinds, torch.float16)
            self.hasher = get_request_block_hasher(BLOCK, sha256)

    def request(self, request_id: str, tokens: list[int]) -> Any:
        if self.family == "kvcache":
            return K.Request(request_id, tokens, block_hasher=self.hasher)
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(
            request_id, tokens, SamplingParams(max_tokens=8), None, block_hasher=self.hasher
        )


def _drive(manager: Any, objects: _Objects) -> list[Any]:
    """A scheduler-like script: shared prefixes, decode steps, frees, a reused prefix."""
    log: list[Any] = []
    prompts = {
        "a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
        "b": [1, 2, 3, 4, 5, 6, 7, 8, 20, 21],
        "c": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    }
    requests = {}
    for rid in ("a", "b"):
        req = requests[rid] = objects.request(rid, prompts[rid])
        hit, n = manager.get_computed_blocks(req)
        log.append(("hit", rid, n, hit.get_block_ids()))
        new = manager.allocate_slots(req, req.num_tokens - n, n, hit)
        log.append(("alloc", rid, None if new is None else new.get_block_ids()))
        req.num_computed_tokens = req.num_tokens
    for step in range(6):  # decode: one token per running request
        for rid in ("a", "b"):
            req = requests[rid]
            req.append_output_token_ids(100 + step)
            new = manager.allocate_slots(req, 1)
            log.append(("decode", rid, step, None if new is None else new.get_block_ids()))
            req.num_computed_tokens += 1
    log.append(("blocks", manager.get_block_ids("a"), manager.get_block_ids("b")))
    log.append(("common", list(manager.get_num_common_prefix_blocks("a"))))
    manager.free(requests["a"])
    log.append(("free_a", manager.block_pool.get_num_free_blocks(), manager.usage))
    req = objects.request("c", prompts["c"])
    hit, n = manager.get_computed_blocks(req)
    log.append(("hit", "c", n, hit.get_block_ids()))
    new = manager.allocate_slots(req, req.num_tokens - n, n, hit)
    log.append(("alloc", "c", None if new is None else new.get_block_ids()))
    log.append(("new_ids", sorted(manager.take_new_block_ids())))
    for rid in ("b",):
        manager.free(requests[rid])
    manager.free(req)
    log.append(("end", manager.block_pool.get_num_free_blocks()))
    return log


LAYOUTS = [("full",), ("mla",), ("full", "swa"), ("full", "swa_mla"), ("mla", "swa")]


@needs_vllm
@pytest.mark.parametrize("kinds", LAYOUTS, ids=["+".join(k) for k in LAYOUTS])
def test_kvcache_manager_on_vllm_objects_matches(kinds: tuple[str, ...]) -> None:
    """kvcache on vLLM's objects == kvcache on its own objects == vLLM's own manager."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    def make(cls: Any, objects: _Objects) -> Any:
        return cls(
            objects.config, max_model_len=64, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
            max_num_batched_tokens=64, enable_caching=True,
        )  # fmt: skip

    on_vllm_objects = _drive(
        make(K.KVCacheManager, _Objects("vllm", kinds)), _Objects("vllm", kinds)
    )
    on_own_objects = _drive(
        make(K.KVCacheManager, _Objects("kvcache", kinds)), _Objects("kvcache", kinds)
    )
    vllm_itself = _drive(make(VllmManager, _Objects("vllm", kinds)), _Objects("vllm", kinds))
    assert on_vllm_objects == vllm_itself
    assert on_own_objects == vllm_itself
    hits = [entry for entry in vllm_itself if entry[0] == "hit"]
    assert hits[1][2] == 8 and hits[2][2] > 0  # the script really hits the cache


# ---------------------------------------------------------------- merge


def _merge_outcome(spec_list: list[Any]) -> Any:
    """The merged spec's fields, or the exception class family raised."""
    try:
        merged = spec_list[0].merge(spec_list)
    except (AssertionError, ValueError) as exc:
        return "assert" if isinstance(exc, AssertionError) else "value"
    return {f.name: getattr(merged, f.name) for f in dataclasses.fields(merged)}


@needs_vllm
@pytest.mark.parametrize(
    "case",
    ["same", "heads", "full+swa", "swa+full", "windows", "one_window", "chunk+window",
     "causal_mix", "swa_same", "swa_differ", "empty_kinds"],
)  # fmt: skip
def test_merge_matches_vllm(case: str) -> None:
    """Same merged fields as vLLM's merge, and failures where vLLM fails (catchable as
    AssertionError where vLLM asserts)."""
    import torch
    from vllm.v1 import kv_cache_interface as V

    def build(lib: Any, dtype: Any) -> list[Any]:
        def full(**kw: Any) -> Any:
            return lib.FullAttentionSpec(
                block_size=16, num_kv_heads=kw.pop("heads", 4), head_size=8, dtype=dtype, **kw
            )

        def swa(window: int = 4) -> Any:
            return lib.SlidingWindowSpec(
                block_size=16, num_kv_heads=4, head_size=8, dtype=dtype, sliding_window=window
            )

        return {
            "same": lambda: [full(), full()],
            "heads": lambda: [full(), full(heads=2)],
            "full+swa": lambda: [full(), swa()],
            "swa+full": lambda: [swa(), full()],
            "windows": lambda: [full(), full(sliding_window=2), full(sliding_window=3)],
            "one_window": lambda: [full(sliding_window=2), full()],
            "chunk+window": lambda: [full(sliding_window=2), full(attention_chunk_size=8)],
            "causal_mix": lambda: [full(), full(non_causal=True)],
            "swa_same": lambda: [swa(), swa()],
            "swa_differ": lambda: [swa(4), swa(8)],
            "empty_kinds": lambda: [full(head_size_v=4), full(head_size_v=4)],
        }[case]()

    ours = _merge_outcome(build(K, "float32"))
    theirs = _merge_outcome(build(V, torch.float32))
    if isinstance(theirs, dict):
        assert isinstance(ours, dict)
        theirs["dtype"] = str(theirs["dtype"]).removeprefix("torch.")
        ours["kv_quant_mode"] = int(ours["kv_quant_mode"])
        theirs["kv_quant_mode"] = int(theirs["kv_quant_mode"])
        assert ours == theirs
    else:
        assert ours == theirs


def test_merge_error_is_both_value_and_assertion_error() -> None:
    """kvcache's merge failure is a ValueError and an AssertionError, naming the field."""
    a = K.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype="float16")
    b = dataclasses.replace(a, num_kv_heads=2)
    with pytest.raises(KVCacheSpecMergeError, match="num_kv_heads") as err:
        K.FullAttentionSpec.merge([a, b])
    assert isinstance(err.value, ValueError) and isinstance(err.value, AssertionError)
    merged = K.FullAttentionSpec.merge([a, dataclasses.replace(a, sliding_window=32)])
    assert merged.sliding_window == 32 and merged is not a
    with pytest.raises(KVCacheSpecMergeError, match="empty"):
        K.KVCacheSpec.merge([])


# ---------------------------------------------------------------- take_events warning


def test_take_events_warns_on_unknown_group_index(caplog: pytest.LogCaptureFixture) -> None:
    """An event naming no group comes back unlabelled, with vLLM's warning text."""
    spec = K.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    config = K.KVCacheConfig(num_blocks=5, kv_cache_groups=[K.KVCacheGroupSpec(["l"], spec)])
    manager = K.KVCacheManager(
        config, max_model_len=64, scheduler_block_size=4, hash_block_size=4,
        enable_kv_cache_events=True,
    )  # fmt: skip
    event = K.BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=[0, 1, 2, 3], block_size=4,
        lora_id=None, medium=None, lora_name=None, group_idx=1,
    )  # fmt: skip
    manager.block_pool.kv_event_queue.append(event)
    with caplog.at_level(logging.WARNING, logger="kvcache.kv_cache_manager"):
        assert manager.take_events() == [event]
    assert event.kv_cache_spec_kind is None
    assert [r.getMessage() for r in caplog.records] == ["Group index `1` not in KV cache metadata"]


# ---------------------------------------------------------------- cache_partial_block

HASH_BLOCK = 2
GROUP_BLOCK = 6


class _PoolSide:
    """One pool (kvcache's, the spec's or vLLM's) with its request type."""

    def __init__(self, kind: str, num_blocks: int, events: bool) -> None:
        self.kind = kind
        if kind == "vllm":
            from vllm.utils.hashing import sha256
            from vllm.v1.core.block_pool import BlockPool
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            init_none_hash(sha256)
            self.hasher = get_request_block_hasher(HASH_BLOCK, sha256)
        else:
            BlockPool = K.BlockPool if kind == "kvcache" else S.BlockPool  # type: ignore[assignment]
            self.hasher = K.get_request_block_hasher(HASH_BLOCK, K.sha256)
        self.pool = BlockPool(
            num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=HASH_BLOCK,
            enable_kv_cache_events=events,
        )  # fmt: skip

    def request(self, request_id: str, tokens: list[int]) -> Any:
        if self.kind != "vllm":
            return K.Request(request_id, tokens, block_hasher=self.hasher)
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(request_id, tokens, SamplingParams(max_tokens=4), None,
                       block_hasher=self.hasher)  # fmt: skip

    def ids(self, blocks: Any) -> Any:
        if blocks is None:
            return None
        return [b if isinstance(b, int) else b.block_id for b in blocks]

    def state(self) -> Any:
        pool = self.pool
        if self.kind == "spec":
            cached = {k: list(v) for k, v in pool.cached.items()}
            secondary = {b: sorted(ks) for b, ks in pool.cached_block_hashes_by_block.items()}
            return canon({"cached": cached, "secondary": secondary, "hash": dict(pool.block_hash)})
        if self.kind == "vllm":
            cached = {
                k: ([v.block_id] if hasattr(v, "block_id") else list(v))
                for k, v in pool.cached_block_hash_to_block._cache.items()
            }
        else:
            cached = {
                k: [b.block_id for b in bs] for k, bs in pool.cached_block_hash_to_block.items()
            }
        secondary = {b: sorted(ks) for b, ks in pool.cached_block_hashes_by_block.items()}
        hashes = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
        return canon({"cached": cached, "secondary": secondary, "hash": hashes})


def _partial_script(side: _PoolSide) -> list[Any]:
    """Partial entries: a tail, its replacement by a longer one, a duplicate on a
    second block, a hit from another request, promotion to a full hash, eviction,
    freeing and reuse, reset; the state and events after each step."""
    pool = side.pool
    log: list[Any] = []

    def call(name: str, *args: Any, **kwargs: Any) -> None:
        try:
            result = getattr(pool, name)(*args, **kwargs)
        except (AssertionError, ValueError):
            result = "error"
        if name == "get_new_blocks" or name == "get_cached_block":
            result = side.ids(result)
        log.append((name, canon(result), side.state(), canon(pool.take_events())))

    req = side.request("r", [0, 0, 1, 1, 2, 2, 3, 3])
    blocks = pool.get_new_blocks(3)
    b0, b1, b2 = blocks
    call("cache_full_blocks", req, blocks, 0, 1, GROUP_BLOCK, 0)
    call("cache_partial_block", req, b1, 8, 0, GROUP_BLOCK)  # the tail at 8 tokens
    call("cache_partial_block", req, b1, 8, 0, GROUP_BLOCK)  # again: nothing changes
    call("cache_partial_block", req, b0, 2, 0, GROUP_BLOCK)  # a secondary key on b0
    call("cache_partial_block", req, b2, 2, 0, GROUP_BLOCK)  # same key, another block
    req.append_output_token_ids([4, 4])
    call("cache_partial_block", req, b1, 10, 0, GROUP_BLOCK)  # replaces the 8-token entry
    other = side.request("o", [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 9])
    call("get_cached_block", other.block_hashes[4], [0])
    call("get_cached_block", other.block_hashes[3], [0])
    req.append_output_token_ids([5, 5])
    call("cache_full_blocks", req, blocks, 1, 2, GROUP_BLOCK, 0)  # promotes b1
    call("cache_partial_block", req, pool.null_block, 8, 0, GROUP_BLOCK)
    for bad in ((req, b2, 3, 0, GROUP_BLOCK), (req, b2, 12, 0, GROUP_BLOCK),
                (req, b2, 2, 0, HASH_BLOCK), (req, b2, 40, 0, GROUP_BLOCK)):  # fmt: skip
        call("cache_partial_block", *bad)
    call("evict_blocks", {b0.block_id if not isinstance(b0, int) else b0})
    call("free_blocks", [b2, b1, b0])
    reused = pool.get_new_blocks(3)  # the front of the free queue: evicts what it reuses
    log.append(("get_new_blocks", side.ids(reused), side.state(), canon(pool.take_events())))
    call("cache_partial_block", req, reused[1], 4, 1, GROUP_BLOCK)  # another group
    call("cache_partial_block", req, reused[1], 2, 1, GROUP_BLOCK)  # shorter: a second key
    call("reset_prefix_cache")  # refused: blocks are held
    call("free_blocks", reused)
    call("reset_prefix_cache")
    return log


@pytest.mark.parametrize("events", [False, True])
def test_cache_partial_block_kvcache_matches_spec(events: bool) -> None:
    """kvcache's partial-block entries equal the oracle's, step by step."""
    kv = _PoolSide("kvcache", 5, events)
    oracle = _PoolSide("spec", 5, events)
    kv_log, spec_log = _partial_script(kv), _partial_script(oracle)
    for ours, theirs in zip(kv_log, spec_log, strict=True):
        assert ours == theirs
    kv.pool.check_invariants()
    oracle.pool.check_invariants()
    assert any(entry[1] == "error" for entry in kv_log)
    assert any(entry[2]["secondary"] for entry in kv_log)  # a secondary key was made


@needs_vllm
@pytest.mark.parametrize("events", [False, True])
def test_cache_partial_block_matches_vllm(events: bool) -> None:
    """kvcache's ``cache_partial_block`` equals vLLM 0.25.1's, step by step."""
    kv_log = _partial_script(_PoolSide("kvcache", 5, events))
    vllm_log = _partial_script(_PoolSide("vllm", 5, events))
    for ours, theirs in zip(kv_log, vllm_log, strict=True):
        assert ours == theirs


def test_cache_partial_block_rejects_bad_sizes_unchanged() -> None:
    """A bad boundary raises PartialBlockError (a ValueError and AssertionError) and
    leaves the pool as it was."""
    side = _PoolSide("kvcache", 3, True)
    req = side.request("r", [0, 0, 1, 1])
    block = side.pool.get_new_blocks(1)[0]
    before = side.state()
    for num_tokens, block_size in ((3, 4), (4, 4), (2, 2), (6, 4)):
        with pytest.raises(PartialBlockError):
            side.pool.cache_partial_block(req, block, num_tokens, 0, block_size)
    assert side.state() == before and side.pool.take_events() == []
    side.pool.check_invariants()


# ---------------------------------------------------------------- hash functions


@pytest.mark.parametrize("caching_hash_fn", [hash, K.sha256], ids=["builtin-hash", "sha256"])
def test_request_hashes_chain_whatever_the_hash_function_returns(
    caching_hash_fn: Callable[[Any], Any],
) -> None:
    """The compiled build holds hashing values unchecked (``HashValue``): an int
    hash (vLLM's own tests hash with ``hash()``) passes there as in vLLM."""
    none_hash = K.kv_cache_utils.NONE_HASH
    first = caching_hash_fn((none_hash, (0, 1, 2), None))
    second = caching_hash_fn((first, (3, 4, 5), None))
    assert K.hash_block_tokens(caching_hash_fn, None, [0, 1, 2]) == first
    assert K.hash_block_tokens(caching_hash_fn, first, (3, 4, 5)) == second
    request = K.Request(
        "a", list(range(7)), block_hasher=K.get_request_block_hasher(3, caching_hash_fn)
    )
    assert request.block_hashes == [first, second]
    request.append_output_token_ids([7, 8])
    assert request.block_hashes == [first, second, caching_hash_fn((second, (6, 7, 8), None))]
    assert all(type(h) is type(first) for h in request.block_hashes)
