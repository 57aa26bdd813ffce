"""kvcache's MLA-style, marker and uniform-type spec classes equal vLLM 0.25.1's.

Each case builds the same spec in both packages (kvcache's with dtype names,
vLLM's with torch dtypes) and compares every dataclass field, the page size
(quantisation scales, fp8 DeepSeek layouts, alignment padding), the storage
block size, the event kind and window, ``merge`` (result or failure), the
uniformity helpers and the worker-side memory bound. vLLM is the judge; the
tests skip locally without vLLM and fail under CI (``vllm_reference``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

import kvcache.kv_cache_interface as K
import kvcache.kv_cache_utils as KU
from kvcache.single_type_kv_cache_manager import get_manager_class_for_kv_cache_spec

pytestmark = pytest.mark.usefixtures("vllm_reference")

# (class name, keyword arguments with dtype names): the cases both packages build.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("MLAAttentionSpec", dict(block_size=16, num_kv_heads=1, head_size=576, dtype="float32")),
    ("MLAAttentionSpec", dict(block_size=16, num_kv_heads=1, head_size=576, dtype="float16",
                              alignment=1000)),
    ("MLAAttentionSpec", dict(block_size=16, num_kv_heads=1, head_size=576, dtype="float16",
                              alignment=16, page_size_padded=40000)),
    ("MLAAttentionSpec", dict(block_size=64, num_kv_heads=1, head_size=512, dtype="uint8",
                              compress_ratio=4, cache_dtype_str="fp8_ds_mla",
                              model_version="deepseek_v4", alignment=576)),
    ("MLAAttentionSpec", dict(block_size=64, num_kv_heads=1, head_size=576, dtype="uint8",
                              cache_dtype_str="fp8_ds_mla")),
    ("MLAAttentionSpec", dict(block_size=16, num_kv_heads=2, head_size=64, dtype="int8",
                              kv_quant_mode=4)),
    ("MLAAttentionSpec", dict(block_size=16, num_kv_heads=2, head_size=64, dtype="uint8",
                              kv_quant_mode=5)),
    ("HiddenStateCacheSpec", dict(block_size=16, num_kv_heads=1, head_size=100,
                                  dtype="bfloat16", alignment=512)),
    ("SlidingWindowMLASpec", dict(block_size=16, num_kv_heads=1, head_size=576,
                                  dtype="float16", sliding_window=128, alignment=1000)),
    ("SlidingWindowMLASpec", dict(block_size=64, num_kv_heads=1, head_size=512, dtype="uint8",
                                  sliding_window=128, compress_ratio=4,
                                  cache_dtype_str="fp8_ds_mla", model_version="deepseek_v4")),
    ("TQFullAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=100,
                                 dtype="bfloat16", tq_slot_size=52)),
    ("TQFullAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=100,
                                 dtype="bfloat16")),
    ("EncoderOnlyAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=100,
                                      dtype="bfloat16", kv_quant_mode=2)),
    ("FullAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=64, dtype="uint8",
                               kv_quant_mode=5)),
    ("FullAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=64, head_size_v=32,
                               dtype="uint8", kv_quant_mode=4)),
    ("FullAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=64, dtype="int8",
                               kv_quant_mode=3)),
    ("SlidingWindowSpec", dict(block_size=16, num_kv_heads=4, head_size=64, dtype="uint8",
                               sliding_window=8, kv_quant_mode=4)),
    ("SlidingWindowSpec", dict(block_size=16, num_kv_heads=4, head_size=64, dtype="uint8",
                               sliding_window=8, kv_quant_mode=5)),
    ("ChunkedLocalAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=64,
                                       dtype="uint8", attention_chunk_size=8, kv_quant_mode=5)),
]
CASE_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]


def vllm_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The same arguments for vLLM: a torch dtype and a ``KVQuantMode`` member."""
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    out = dict(kwargs, dtype=getattr(torch, kwargs["dtype"]))
    if "kv_quant_mode" in out:
        out["kv_quant_mode"] = KVQuantMode(out["kv_quant_mode"])
    return out


def both(name: str, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from vllm.v1 import kv_cache_interface as V

    return getattr(K, name)(**kwargs), getattr(V, name)(**vllm_kwargs(kwargs))


def fields_of(spec: Any) -> dict[str, Any]:
    """Every dataclass field, dtypes and quant modes as plain names / ints."""
    out = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name == "dtype":
            value = str(value).removeprefix("torch.")
        elif f.name == "kv_quant_mode":
            value = int(value)
        out[f.name] = value
    return out


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=CASE_IDS)
def test_fields_page_size_and_kind_equal_vllms(name: str, kwargs: dict[str, Any]) -> None:
    from vllm.v1 import kv_cache_interface as V

    ours, theirs = both(name, kwargs)
    assert fields_of(ours) == fields_of(theirs)
    assert ours.page_size_bytes == theirs.page_size_bytes
    assert ours.real_page_size_bytes == theirs.real_page_size_bytes
    assert ours.storage_block_size == theirs.storage_block_size
    assert K.get_kv_cache_spec_kind(ours).value == V.get_kv_cache_spec_kind(theirs).value
    assert K.get_kv_cache_spec_sliding_window(ours) == V.get_kv_cache_spec_sliding_window(theirs)
    resized_ours, resized_theirs = (s.copy_with_new_block_size(32) for s in (ours, theirs))
    assert fields_of(resized_ours) == fields_of(resized_theirs)
    assert resized_ours.page_size_bytes == resized_theirs.page_size_bytes


def test_alignment_padding_is_what_vllm_pads() -> None:
    spec = K.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16",
                              alignment=1000)
    assert spec.real_page_size_bytes == 16 * 576 * 2
    assert spec.page_size_padded == spec.page_size_bytes == 19000
    aligned = K.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16",
                                 alignment=16 * 576 * 2)
    assert aligned.page_size_padded is None
    with pytest.raises(ValueError, match="alignment"):
        K.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16",
                           alignment=0)
    with pytest.raises(ValueError, match="compress_ratio"):
        K.SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16",
                               sliding_window=4, compress_ratio=0)


def test_unsupported_model_version_fails_in_both() -> None:
    ours, theirs = both("SlidingWindowMLASpec", dict(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=4,
        model_version="deepseek_v3"))
    with pytest.raises(ValueError, match="model_version"):
        _ = ours.page_size_bytes
    with pytest.raises(AssertionError):
        _ = theirs.page_size_bytes


MLA = dict(block_size=16, num_kv_heads=1, head_size=576, dtype="float16")
SWA_MLA = dict(MLA, sliding_window=64)
MERGES: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = [
    ("mla-equal", [("MLAAttentionSpec", MLA), ("MLAAttentionSpec", MLA)]),
    ("mla-drops-window-and-alignment", [
        ("MLAAttentionSpec", dict(MLA, sliding_window=8, alignment=1000, head_size_v=4)),
        ("MLAAttentionSpec", dict(MLA, non_causal=True)),
    ]),
    ("mla-other-dtype-str", [("MLAAttentionSpec", MLA),
                             ("MLAAttentionSpec", dict(MLA, cache_dtype_str="fp8"))]),
    ("mla-other-ratio", [("MLAAttentionSpec", MLA),
                         ("MLAAttentionSpec", dict(MLA, compress_ratio=2))]),
    ("mla-with-full", [("MLAAttentionSpec", MLA), ("FullAttentionSpec", MLA)]),
    ("hidden-state", [("HiddenStateCacheSpec", MLA), ("HiddenStateCacheSpec", MLA)]),
    ("swa-mla-equal", [("SlidingWindowMLASpec", dict(SWA_MLA, kv_quant_mode=1)),
                       ("SlidingWindowMLASpec", dict(SWA_MLA, kv_quant_mode=1))]),
    ("swa-mla-other-window", [("SlidingWindowMLASpec", SWA_MLA),
                              ("SlidingWindowMLASpec", dict(SWA_MLA, sliding_window=32))]),
    ("swa-mla-with-swa", [("SlidingWindowMLASpec", SWA_MLA), ("SlidingWindowSpec", SWA_MLA)]),
    ("tq-equal", [("TQFullAttentionSpec", dict(MLA, tq_slot_size=8, sliding_window=4)),
                  ("TQFullAttentionSpec", dict(MLA, tq_slot_size=8))]),
    ("tq-other-slot", [("TQFullAttentionSpec", dict(MLA, tq_slot_size=8)),
                       ("TQFullAttentionSpec", dict(MLA, tq_slot_size=4))]),
    ("full-with-mla", [("FullAttentionSpec", MLA), ("MLAAttentionSpec", MLA)]),
]


@pytest.mark.parametrize(("case", "layers"), MERGES, ids=[m[0] for m in MERGES])
def test_merge_equals_vllms(case: str, layers: list[tuple[str, dict[str, Any]]]) -> None:
    pairs = [both(name, kwargs) for name, kwargs in layers]
    ours = [p[0] for p in pairs]
    theirs = [p[1] for p in pairs]
    try:
        expected = type(theirs[0]).merge(theirs)
    except AssertionError:
        with pytest.raises(AssertionError):
            type(ours[0]).merge(ours)
        with pytest.raises(ValueError):  # kvcache's merge error is a ValueError too
            type(ours[0]).merge(ours)
        return
    merged = type(ours[0]).merge(ours)
    assert type(merged).__name__ == type(expected).__name__
    assert fields_of(merged) == fields_of(expected)
    assert merged.page_size_bytes == expected.page_size_bytes


def _layers(lib: Any, dtype: Any) -> dict[str, dict[str, Any]]:
    """Per-layer spec dicts to test the uniformity helpers on, built by ``lib``."""
    attn = dict(block_size=16, num_kv_heads=1, dtype=dtype)
    return {
        "mla-two-sizes": {
            "a": lib.MLAAttentionSpec(**attn, head_size=576),
            "b": lib.MLAAttentionSpec(**attn, head_size=1024),
        },
        "mla-and-full": {
            "a": lib.MLAAttentionSpec(**attn, head_size=64),
            "b": lib.FullAttentionSpec(**attn, head_size=32),
        },
        "mla-and-swa-mla": {
            "a": lib.MLAAttentionSpec(**attn, head_size=64),
            "b": lib.SlidingWindowMLASpec(**attn, head_size=64, sliding_window=8),
        },
        "swa-mla-two-sizes": {
            "a": lib.SlidingWindowMLASpec(**attn, head_size=64, sliding_window=8),
            "b": lib.SlidingWindowMLASpec(**attn, head_size=128, sliding_window=8),
        },
        "swa-and-swa-mla": {
            "a": lib.SlidingWindowSpec(**attn, head_size=32, sliding_window=8),
            "b": lib.SlidingWindowMLASpec(**attn, head_size=64, sliding_window=8),
        },
        "swa-mla-two-windows": {
            "a": lib.SlidingWindowMLASpec(**attn, head_size=64, sliding_window=8),
            "b": lib.SlidingWindowMLASpec(**attn, head_size=64, sliding_window=16),
        },
        "tq-and-full": {
            "a": lib.TQFullAttentionSpec(**attn, head_size=64, tq_slot_size=40),
            "b": lib.FullAttentionSpec(**attn, head_size=20),
        },
        "same-mla": {
            "a": lib.MLAAttentionSpec(**attn, head_size=64),
            "b": lib.MLAAttentionSpec(**attn, head_size=64),
        },
        "two-block-sizes": {
            "a": lib.MLAAttentionSpec(**attn, head_size=64),
            "b": lib.MLAAttentionSpec(**dict(attn, block_size=32), head_size=64),
        },
    }


def test_uniformity_helpers_equal_vllms() -> None:
    import torch
    from vllm.v1 import kv_cache_interface as V
    from vllm.v1.core import kv_cache_utils as VU

    ours_all, theirs_all = _layers(K, "float16"), _layers(V, torch.float16)
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=1000),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
    )
    for case, ours in ours_all.items():
        theirs = theirs_all[case]
        assert K.UniformTypeKVCacheSpecs.is_uniform_type(ours) == (
            V.UniformTypeKVCacheSpecs.is_uniform_type(theirs)), case
        assert KU.is_kv_cache_spec_uniform(ours) == VU.is_kv_cache_spec_uniform(theirs), case
        assert KU.is_kv_cache_page_size_uniform(ours) == (
            VU.is_kv_cache_page_size_uniform(theirs)), case
        first_ours, first_theirs = next(iter(ours.values())), next(iter(theirs.values()))
        if first_ours.block_size == 16:
            assert first_ours.is_uniform_with_collection(ours) == (
                first_theirs.is_uniform_with_collection(theirs)), case
        uniform_ours = K.UniformTypeKVCacheSpecs.from_specs(ours)
        uniform_theirs = V.UniformTypeKVCacheSpecs.from_specs(theirs)
        assert (uniform_ours is None) == (uniform_theirs is None), case
        if uniform_ours is None or uniform_theirs is None:
            continue
        assert uniform_ours.block_size == uniform_theirs.block_size
        assert uniform_ours.page_size_bytes == uniform_theirs.page_size_bytes
        assert sorted(uniform_ours.get_page_sizes()) == sorted(uniform_theirs.get_page_sizes())
        assert uniform_ours.get_num_layer_tuples() == uniform_theirs.get_num_layer_tuples()
        assert uniform_ours.max_memory_usage_bytes(config) == (
            uniform_theirs.max_memory_usage_bytes(config)), case
        assert uniform_ours.max_memory_usage_pages(config) == (
            uniform_theirs.max_memory_usage_pages(config)), case
        assert K.get_kv_cache_spec_kind(uniform_ours).value == (
            V.get_kv_cache_spec_kind(uniform_theirs).value), case
        assert K.get_kv_cache_spec_sliding_window(uniform_ours) == (
            V.get_kv_cache_spec_sliding_window(uniform_theirs)), case
    assert KU.is_kv_cache_spec_uniform({}) and VU.is_kv_cache_spec_uniform({})
    assert KU.is_kv_cache_type_attention_free({}) and not KU.is_kv_cache_type_attention_free(
        ours_all["same-mla"])
    assert KU.get_uniform_page_size(ours_all["same-mla"].values()) == (
        VU.get_uniform_page_size(theirs_all["same-mla"].values()))
    with pytest.raises(AssertionError):
        VU.get_uniform_page_size(theirs_all["mla-two-sizes"].values())
    with pytest.raises(ValueError, match="one page size"):
        KU.get_uniform_page_size(ours_all["mla-two-sizes"].values())


def test_encoder_only_keeps_no_kv_cache() -> None:
    ours, theirs = both("EncoderOnlyAttentionSpec", dict(block_size=4, num_kv_heads=1,
                                                         head_size=8, dtype="float16"))
    assert ours.max_memory_usage_bytes(None) == theirs.max_memory_usage_bytes(None) == 0


@pytest.mark.parametrize("name", ["MLAAttentionSpec", "HiddenStateCacheSpec",
                                  "TQFullAttentionSpec", "SlidingWindowMLASpec",
                                  "EncoderOnlyAttentionSpec", "UniformTypeKVCacheSpecs"])
def test_kvcache_classes_get_the_manager_vllm_registers(name: str) -> None:
    """kvcache's own class gets the manager vLLM registers for vLLM's (none: a clear error)."""
    from vllm.v1 import kv_cache_interface as V
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    attn: dict[str, Any] = dict(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    if name == "SlidingWindowMLASpec":
        attn["sliding_window"] = 8
    if name == "UniformTypeKVCacheSpecs":
        ours: Any = K.UniformTypeKVCacheSpecs(4, {"a": K.MLAAttentionSpec(**attn)})
        theirs: Any = V.UniformTypeKVCacheSpecs(4, {"a": V.MLAAttentionSpec(**vllm_kwargs(attn))})
    else:
        ours, theirs = both(name, attn)
    vllm_manager = KVCacheSpecRegistry.get_manager_class(theirs)
    if vllm_manager is None:
        with pytest.raises(NotImplementedError, match="registers none"):
            get_manager_class_for_kv_cache_spec(ours)
    else:
        assert get_manager_class_for_kv_cache_spec(ours).__name__ == vllm_manager.__name__
