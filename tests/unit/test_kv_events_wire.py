"""kvcache's KV events on the wire are vLLM 0.25.1's: same bytes, same decoded fields.

vLLM's publisher sends a ``KVEventBatch`` packed by ``msgspec.msgpack.Encoder``
and KV-aware routers decode it against vLLM's struct schema (tagged events,
array-like batch, defaults omitted). ``kvcache.kv_events.encode`` must give
those bytes for kvcache's own dataclass events, with or without msgspec, and
``to_vllm`` / ``from_vllm`` must carry a batch across to vLLM's classes and back.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import kvcache as K
from kvcache import kv_events as E

BS = 4


def manager_events(
    monkeypatch: pytest.MonkeyPatch, int_hashes: bool, config_types: Any = K
) -> list[E.KVCacheEvent]:
    """Events of a small real run: stored blocks with LoRA / multimodal / salt extra
    keys, evictions, and a prefix-cache reset. ``config_types`` supplies the
    ``FullAttentionSpec`` / ``KVCacheConfig`` / ``KVCacheGroupSpec`` classes the
    manager is built from (kvcache's, or vLLM's ``kv_cache_interface``)."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if int_hashes else "0")
    T = config_types
    spec = T.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=_dtype(T))
    config = T.KVCacheConfig(5, [], [T.KVCacheGroupSpec(["layers.0"], spec)])
    manager = K.KVCacheManager(config, max_model_len=64, scheduler_block_size=BS,
                               hash_block_size=BS, enable_kv_cache_events=True)
    hasher = K.get_request_block_hasher(BS, K.sha256)
    feature = K.MultiModalFeatureSpec("img-0", K.PlaceholderRange(offset=2, length=3))
    requests = [
        K.Request("a", list(range(9)), block_hasher=hasher, mm_features=[feature],
                  lora_request=K.LoRARequest("lora-a", 3), cache_salt="salt"),
        K.Request("b", [7] * 12, block_hasher=hasher),
    ]
    for request in requests:
        hits, num_hits = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits)
        manager.free(request)
    assert manager.reset_prefix_cache()
    events = manager.take_events()
    kinds = {type(e).__name__ for e in events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
    return events


def _dtype(config_types: Any) -> Any:
    """The spec's dtype in that vocabulary: a string for kvcache, torch's for vLLM."""
    if config_types is K:
        return "float16"
    import torch

    return torch.float16


# ---------------------------------------------------------------- without vLLM

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False)
    | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=20) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5), inner, max_size=20),
    max_leaves=40,
)


@settings(max_examples=100, deadline=None)
@given(value=msgpack_values)
def test_packb_writes_msgspecs_bytes(value: Any) -> None:
    msgspec = pytest.importorskip("msgspec")
    assert E.packb(value) == msgspec.msgpack.encode(value)


@pytest.mark.parametrize("n", [0, 31, 32, 255, 256, 65535, 65536])
def test_packb_size_boundaries(n: int) -> None:
    msgspec = pytest.importorskip("msgspec")
    for value in ("x" * n, b"x" * n, [0] * n, {str(i): 0 for i in range(n)}):
        assert E.packb(value) == msgspec.msgpack.encode(value), (type(value), n)


def test_packb_rejects_what_msgpack_cannot_hold() -> None:
    with pytest.raises(OverflowError, match="above 2\\*\\*64 - 1"):
        E.packb(2**64)
    with pytest.raises(OverflowError, match="below -2\\*\\*63"):
        E.packb(-(2**63) - 1)
    with pytest.raises(TypeError, match="cannot encode set"):
        E.packb({1})


def test_event_wire_value_is_tagged_with_defaults_omitted() -> None:
    stored = E.BlockStored([1, 2], None, [5] * 8, 4, None, "GPU", None, group_idx=0)
    assert E.to_wire(stored) == {
        "type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
        "token_ids": [5] * 8, "block_size": 4, "lora_id": None, "medium": "GPU",
        "lora_name": None, "group_idx": 0,
    }
    batch = E.KVEventBatch(ts=1.5, events=[E.AllBlocksCleared()])
    assert E.to_wire(batch) == [1.5, [{"type": "AllBlocksCleared"}], None]
    batch.data_parallel_rank = 2
    assert E.to_wire(batch) == [1.5, [{"type": "AllBlocksCleared"}], 2]
    with pytest.raises(TypeError, match="not a kvcache event"):
        E.to_wire(K.PlaceholderRange(0, 1))


def test_encode_without_msgspec_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("msgspec")
    batch = E.KVEventBatch(ts=3.0, events=manager_events(monkeypatch, int_hashes=False))
    with_msgspec = E.encode(batch)
    monkeypatch.setitem(__import__("sys").modules, "msgspec", None)  # import now fails
    assert E.encode(batch) == with_msgspec


def test_events_hash_like_values() -> None:
    a = E.BlockStored([1], None, [1, 2], 2, None, "GPU", None, extra_keys=[("x", (1,))])
    b = dataclasses.replace(a, token_ids=[1, 2])
    assert a == b and hash(a) == hash(b) and len({a, b, E.AllBlocksCleared()}) == 2


# ---------------------------------------------------------------- against vLLM


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
@pytest.mark.parametrize("rank", [None, 1])
def test_batch_bytes_and_fields_equal_vllms(
    vllm_reference: ModuleType, monkeypatch: pytest.MonkeyPatch, int_hashes: bool,
    rank: int | None,
) -> None:
    import msgspec
    from vllm.distributed import kv_events as vllm_events

    events = manager_events(monkeypatch, int_hashes)
    batch = E.KVEventBatch(ts=12.25, events=events, data_parallel_rank=rank)
    theirs = E.to_vllm(batch)
    assert type(theirs) is vllm_events.KVEventBatch
    assert [type(e) for e in theirs.events] == [
        getattr(vllm_events, type(e).__name__) for e in events
    ]
    vllm_bytes = msgspec.msgpack.Encoder().encode(theirs)  # what vLLM's publisher sends
    assert E.encode(batch) == vllm_bytes
    assert E.packb(E.to_wire(batch)) == vllm_bytes
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)  # what a subscriber runs
    decoded = decoder.decode(E.encode(batch))
    assert decoded == decoder.decode(vllm_bytes)
    assert (decoded.ts, decoded.data_parallel_rank) == (12.25, rank)
    for ours, got in zip(events, decoded.events, strict=True):
        assert type(got).__name__ == type(ours).__name__
        for field in dataclasses.fields(ours):
            expected = getattr(ours, field.name)
            if field.name == "extra_keys" and expected is not None:
                # msgpack has no tuples: an item's (identifier, offset) comes back a list
                expected = [None if k is None else tuple(
                    list(x) if isinstance(x, tuple) else x for x in k) for k in expected]
            assert getattr(got, field.name) == expected, field.name


def test_round_trip_through_vllms_classes(
    vllm_reference: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import msgspec
    from vllm.distributed import kv_events as vllm_events

    events = manager_events(monkeypatch, int_hashes=True)
    batch = E.KVEventBatch(ts=1.0, events=events)
    assert E.from_vllm(E.to_vllm(batch)) == batch
    assert E.from_vllm(E.to_vllm(events)) == events
    aggregator = vllm_events.KVEventAggregator(num_workers=2)
    aggregator.add_events(events)
    aggregator.add_events(E.from_vllm(E.to_vllm(events)))
    assert sorted(map(repr, aggregator.get_common_events())) == sorted(map(repr, events))
    # vLLM's decoder output comes back as kvcache's events with the same wire bytes.
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(E.encode(batch))
    assert E.encode(E.from_vllm(decoded)) == E.encode(batch)
    with pytest.raises(TypeError, match="not one of vLLM's KV events"):
        E.from_vllm(object())
    with pytest.raises(TypeError, match="not a kvcache event"):
        E.to_vllm(object())


def test_dataclass_events_in_vllms_batch_need_the_conversion(
    vllm_reference: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported failure: kvcache's dataclasses put straight into vLLM's batch
    encode as untagged maps, which vLLM's subscriber rejects; converted, they decode."""
    import msgspec
    from vllm.distributed import kv_events as vllm_events

    events = manager_events(monkeypatch, int_hashes=True)
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    raw = msgspec.msgpack.Encoder().encode(vllm_events.KVEventBatch(ts=0.0, events=events))
    with pytest.raises(msgspec.ValidationError, match="missing required field `type`"):
        decoder.decode(raw)
    converted = vllm_events.KVEventBatch(ts=0.0, events=E.to_vllm(events))
    assert len(decoder.decode(msgspec.msgpack.Encoder().encode(converted)).events) == len(events)


def test_manager_from_vllms_objects_emits_vllms_events(
    vllm_reference: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager built from vLLM's config emits vLLM's event structs by itself (no
    switch, no call), while one built from kvcache's in the same process keeps
    kvcache's dataclasses: each manager its own vocabulary."""
    from vllm.distributed import kv_events as vllm_events
    from vllm.v1 import kv_cache_interface as vllm_interface

    expected = manager_events(monkeypatch, int_hashes=True)
    got = manager_events(monkeypatch, int_hashes=True, config_types=vllm_interface)
    again = manager_events(monkeypatch, int_hashes=True)  # after the vLLM-built one
    assert [type(e) for e in got] == [getattr(vllm_events, type(e).__name__) for e in expected]
    assert E.from_vllm(got) == expected  # labels (kv_cache_spec_kind) included
    assert any(getattr(e, "kv_cache_spec_kind", None) for e in got)
    assert [type(e) for e in again] == [type(e) for e in expected]
    assert type(expected[0]) is E.BlockStored
    assert E.built_from_vllm(vllm_interface.KVCacheConfig(1, [], []))
    assert not E.built_from_vllm(K.KVCacheConfig(1, [], []))
