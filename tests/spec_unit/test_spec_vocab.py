"""spec's own vocabulary (``spec/vocab.py``) against vLLM 0.25.1's and kvcache's.

Block hashes are compared byte for byte on drawn requests: LoRA, cache salt,
multimodal items (the prompt's partial tail block is hashed only once outputs
fill it, and then sees the last item only), prompt embeddings, outputs appended
in chunks, all four hash algorithms. The vLLM half runs where the reference is
installed; the kvcache half runs everywhere (it is kvcache-vs-spec).
"""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

import kvcache
from spec import vocab

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ALGOS = sorted(vocab.HASH_FUNCTIONS)
SEED = "0"


@st.composite
def requests(draw: st.DrawFn, embeds: bool) -> dict[str, Any]:
    """A request's description: prompt, keys, output chunks, hash block size."""
    prompt = draw(st.lists(st.integers(0, 2), min_size=1, max_size=14))
    mm: list[tuple[str, int, int]] = []
    offset = draw(st.integers(0, len(prompt)))
    while offset < len(prompt) and len(mm) < 3 and draw(st.booleans()):
        length = draw(st.integers(1, len(prompt) - offset))
        mm.append((draw(st.sampled_from(["img-a", "img-b"])), offset, length))
        offset += length + draw(st.integers(0, 2))  # adjacent items too
    return dict(
        prompt=prompt,
        mm=mm,
        lora=draw(st.sampled_from([None, ("lora-a", 1)])),
        salt=draw(st.sampled_from([None, "", "salt"])),
        outputs=draw(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), max_size=3)),
        block_size=draw(st.integers(1, 4)),
        algo=draw(st.sampled_from(ALGOS)),
        embeds=embeds and draw(st.booleans()),
        embeds_dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])),
    )


# The prompt's partial tail block [4, 8) holds two items; it is hashed once outputs
# fill it, and that later hashing sees the last item only.
TAIL_CASE: dict[str, Any] = dict(
    prompt=[0, 1, 2, 0, 1, 2], mm=[("img-a", 4, 1), ("img-b", 5, 1)], lora=("lora-a", 1),
    salt="salt", outputs=[[0, 0]], block_size=4, algo="sha256", embeds=False,
    embeds_dtype="bfloat16")


def prompt_embeds(desc: dict[str, Any]) -> Any:
    import torch

    generator = torch.Generator().manual_seed(len(desc["prompt"]))
    embeds = torch.randn(len(desc["prompt"]), 3, generator=generator)
    return embeds.to(getattr(torch, desc["embeds_dtype"]))


@pytest.fixture(scope="module")
def seeded() -> Any:
    """PYTHONHASHSEED=SEED while the module's tests run (both NONE_HASHes read it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", SEED)
        yield


def spec_hashes(request: Any, desc: dict[str, Any]) -> list[bytes]:
    fn = vocab.get_hash_fn(desc["algo"])
    return vocab.request_block_hashes(request, desc["block_size"], fn, vocab.none_hash(fn, SEED))


# ---------------------------------------------------------------- against vLLM


def vllm_request(desc: dict[str, Any], request_id: str = "r") -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = getattr(hashing, desc["algo"])
    kv_cache_utils.init_none_hash(fn)  # reads PYTHONHASHSEED (set by the test)
    return Request(
        request_id, list(desc["prompt"]), SamplingParams(max_tokens=16), None,
        prompt_embeds=prompt_embeds(desc) if desc["embeds"] else None,
        mm_features=[MultiModalFeatureSpec(data=None, modality="image", identifier=i,
                                           mm_position=PlaceholderRange(offset=o, length=n))
                     for i, o, n in desc["mm"]],
        lora_request=None if desc["lora"] is None else LoRARequest(*desc["lora"], lora_path="/x"),
        cache_salt=desc["salt"],
        block_hasher=kv_cache_utils.get_request_block_hasher(desc["block_size"], fn))


@pytest.mark.skipif(not HAS_VLLM, reason="the vLLM 0.25.1 reference is not installed")
@settings(max_examples=100, deadline=None)
@given(desc=requests(embeds=True))
@example(desc=TAIL_CASE)
@example(desc={**TAIL_CASE, "embeds": True, "algo": "xxhash_cbor"})
def test_block_hashes_equal_vllms(desc: dict[str, Any], seeded: None) -> None:
    from vllm.v1.core import kv_cache_utils

    request = vllm_request(desc)
    for chunk in desc["outputs"]:
        request.append_output_token_ids(chunk)
    assert spec_hashes(request, desc) == request.block_hashes
    size = desc["block_size"]
    for start in range(0, request.num_tokens - size + 1, size):  # as events carry them
        vllm_keys, _ = kv_cache_utils.generate_block_hash_extra_keys(
            request, start, start + size, 0)
        assert vocab.block_extra_keys(request, start, start + size) == vllm_keys
    coarse = kv_cache_utils.BlockHashListWithBlockSize(request.block_hashes, size, 2 * size)
    assert vocab.coarsen(request.block_hashes, size, 2 * size) == list(coarse)
    assert vocab.external_hash(request.block_hashes[0]) == kv_cache_utils.maybe_convert_block_hash(
        request.block_hashes[0]) if request.block_hashes else True


@pytest.mark.skipif(not HAS_VLLM, reason="the vLLM 0.25.1 reference is not installed")
def test_kinds_and_admission_caps_equal_vllms() -> None:
    import torch
    from vllm.v1 import kv_cache_interface as v

    heads: dict[str, Any] = dict(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    layer_specs = [
        v.FullAttentionSpec(**heads), v.MLAAttentionSpec(**heads),
        v.SlidingWindowSpec(**heads, sliding_window=5),
        v.SlidingWindowMLASpec(**heads, sliding_window=9),
        v.ChunkedLocalAttentionSpec(**heads, attention_chunk_size=8),
        v.CrossAttentionSpec(**heads), v.EncoderOnlyAttentionSpec(**heads),
        v.MambaSpec(block_size=4, shapes=((2,),), dtypes=(torch.float16,)),
    ]
    for layer in layer_specs:
        assert vocab.event_kind(layer) == v.get_kv_cache_spec_kind(layer).value, layer
        assert vocab.event_sliding_window(layer) == v.get_kv_cache_spec_sliding_window(layer)
        for budget, max_len in [(1, 64), (7, 64), (64, 10), (3, 3)]:
            expected = (layer.max_admission_blocks_per_request(budget, max_len)
                        if hasattr(layer, "max_admission_blocks_per_request") else None)
            assert vocab.admission_cap(layer, budget, max_len) == expected, (layer, budget)


# ---------------------------------------------------------------- against kvcache

KVCACHE_TAKES_EMBEDS = "prompt_embeds" in inspect.signature(kvcache.Request).parameters


@settings(max_examples=150, deadline=None)
@given(desc=requests(embeds=KVCACHE_TAKES_EMBEDS))
@example(desc=TAIL_CASE)
def test_block_hashes_equal_kvcaches(desc: dict[str, Any], seeded: None) -> None:
    fn = kvcache.get_hash_fn_by_name(desc["algo"])
    kvcache.init_none_hash(fn)
    try:
        extra = {"prompt_embeds": prompt_embeds(desc)} if desc["embeds"] else {}
        request = kvcache.Request(
            "r", list(desc["prompt"]),
            mm_features=[kvcache.MultiModalFeatureSpec(i, kvcache.PlaceholderRange(o, n))
                         for i, o, n in desc["mm"]],
            lora_request=None if desc["lora"] is None else kvcache.LoRARequest(*desc["lora"]),
            cache_salt=desc["salt"],
            block_hasher=kvcache.get_request_block_hasher(desc["block_size"], fn), **extra)
        for chunk in desc["outputs"]:
            request.append_output_token_ids(chunk)
        assert spec_hashes(request, desc) == request.block_hashes
    finally:
        kvcache.init_none_hash(kvcache.sha256)


def test_tail_block_hashed_later_sees_the_last_item_only() -> None:
    """TAIL_CASE's chain, spelled out: block 1's keys hold img-b but not img-a."""
    request = kvcache.Request("r", TAIL_CASE["prompt"], lora_request=kvcache.LoRARequest(
        "lora-a", 1), cache_salt="salt", mm_features=[
        kvcache.MultiModalFeatureSpec(i, kvcache.PlaceholderRange(o, n))
        for i, o, n in TAIL_CASE["mm"]])
    request.append_output_token_ids([0, 0])
    first = vocab.sha256(SEED)
    block0 = vocab.sha256((first, (0, 1, 2, 0), ("lora-a", "salt")))
    block1 = vocab.sha256((block0, (1, 2, 0, 0), ("lora-a", ("img-b", 1))))
    assert vocab.request_block_hashes(request, 4, vocab.sha256, first) == [block0, block1]
    # Events regenerate the keys scanning from the first item: both items.
    assert vocab.block_extra_keys(request, 4, 8) == ("lora-a", ("img-a", 0), ("img-b", 1))


def test_none_hash_follows_the_seed() -> None:
    fn = vocab.sha256
    assert vocab.none_hash(fn, "0") == fn("0") != vocab.none_hash(fn, "1")
    assert vocab.none_hash(fn, None) != vocab.none_hash(fn, None)  # random without a seed
    with pytest.raises(ValueError, match="caching_hash_algo"):
        vocab.get_hash_fn("md5")


@pytest.mark.skipif(not HAS_VLLM, reason="the vLLM 0.25.1 reference is not installed")
def test_spec_runs_on_vllms_objects_in_lockstep_with_vllm(seeded: None) -> None:
    """spec's manager fed vLLM's own config and requests (full attention + sliding
    window, 2- and 4-token blocks, salted and multimodal requests) agrees with vLLM's
    manager: hits, new blocks, abstract state (hence pool keys), events, stats."""
    import torch
    from vllm.v1 import kv_cache_interface as v
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    import spec
    from kvcache.kit.trace import canon
    from kvcache.kit.vllm_side import abstract_state

    heads: dict[str, Any] = dict(num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = v.KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=[
        v.KVCacheGroupSpec(["l0"], v.FullAttentionSpec(block_size=2, **heads)),
        v.KVCacheGroupSpec(["l1"], v.SlidingWindowSpec(block_size=4, sliding_window=3, **heads)),
    ])
    kwargs: dict[str, Any] = dict(max_model_len=32, scheduler_block_size=4, hash_block_size=2,
                                  log_stats=True, enable_kv_cache_events=True)
    managers = (spec.KVCacheManager(config, **kwargs), VllmManager(config, **kwargs))
    prompts = [[0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 0, 1, 2, 2]]
    for n, prompt in enumerate(prompts):
        desc = dict(prompt=prompt, mm=[("img-a", 3, 2)] if n != 2 else [], lora=None,
                    salt="salt" if n == 2 else None, block_size=2, algo="sha256", embeds=False)
        request = vllm_request(desc, f"r{n}")
        results = []
        for manager in managers:
            hits, num_hits = manager.get_computed_blocks(request)
            new = manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits)
            results.append((hits.get_block_ids(), num_hits, canon(new.get_block_ids()),
                            canon(manager.take_events()), canon(manager.make_prefix_cache_stats())))
        assert results[0] == results[1], f"request {n}"
        assert canon(managers[0].abstract_state()) == canon(abstract_state(managers[1]))
        assert n != 1 or results[0][1] > 0  # r1 hits r0 (same tokens and image); r2 is salted


@pytest.mark.parametrize("setting", [None, "1", "0", "00", "2"])
def test_event_hashes_read_the_setting_as_kvcache_does(setting: str | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is read as an integer (vLLM's
    ``bool(int(...))``): any 0 reports the bytes, anything else the low 64 bits."""
    if setting is None:
        monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", setting)
    block_hash = bytes(range(32))
    reported = vocab.external_hash(block_hash)
    assert reported == kvcache.kv_cache_utils.maybe_convert_block_hash(block_hash)  # type: ignore[arg-type]
    assert isinstance(reported, bytes) is (setting in ("0", "00"))


def test_dcp_sharding_is_read_as_kvcache_reads_it() -> None:
    """A spec's own ``dcp_sharded`` field decides; a uniform-type spec follows its
    first layer; else attention is sharded and Mamba is not."""
    from kvcache.kv_cache_interface import is_dcp_sharded

    attention = kvcache.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                          dtype="float16")
    mamba = kvcache.MambaSpec(block_size=4)

    flagged = SimpleNamespace(dcp_sharded=False)
    uniform = SimpleNamespace(kv_cache_specs={"m": mamba, "a": attention})
    for layer, sharded in ((attention, True), (mamba, False), (flagged, False),
                           (uniform, False)):
        assert vocab.is_dcp_sharded(layer) is is_dcp_sharded(layer) is sharded
