"""Prompt embeddings enter the block hashes, exactly as in vLLM 0.25.1.

Two prompts with equal token ids (or none at all) but different embeddings
hold different KV, so the second must not be served the first one's blocks.
vLLM adds a SHA-256 digest of each block's embedding rows to that block's
extra keys; kvcache must produce the same hash bytes for the same request,
whichever ``Request`` class (kvcache's or vLLM's) carries it. Before the fix
kvcache ignored ``prompt_embeds`` and reported a false 8-token hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import kvcache as K
import kvcache.kv_cache_utils as kcu
from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import resolve_adapter

torch = pytest.importorskip("torch")

BS = 4
HASH_NAMES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def embeds(style: float, num_tokens: int = 10, dtype: Any = None) -> Any:
    """Rows ``[position, style]``: equal positions, different styles differ."""
    rows = [[float(i), style] for i in range(num_tokens)]
    return torch.tensor(rows, dtype=dtype or torch.float32)


def full_attention_config(lib: Any, dtype: Any = "float16", num_blocks: int = 16) -> Any:
    spec = lib.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=dtype)
    return lib.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                             kv_cache_groups=[lib.KVCacheGroupSpec(["layers.0"], spec)])


def num_hit_tokens(manager: Any, first: Any, second: Any) -> int:
    """Admit and compute ``first`` whole, free it (its blocks stay cached), then
    look ``second`` up: the number of tokens the cache claims to hold for it."""
    hits, num_hits = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, first.num_tokens - num_hits, num_hits, hits) is not None
    first.num_computed_tokens = first.num_tokens
    manager.free(first)
    return int(manager.get_computed_blocks(second)[1])


def kvcache_request(rid: str, tokens: list[int] | None, prompt_embeds: Any, **kw: Any) -> Any:
    hasher = K.get_request_block_hasher(BS, K.sha256)
    return K.Request(rid, tokens, block_hasher=hasher, prompt_embeds=prompt_embeds, **kw)


# ---------------------------------------------------------------- kvcache alone


@pytest.mark.parametrize("tokens", [list(range(10)), None], ids=["with-token-ids", "embeds-only"])
def test_different_embeddings_do_not_hit_on_kvcache(tokens: list[int] | None) -> None:
    manager = K.KVCacheManager(full_attention_config(K), max_model_len=64,
                               scheduler_block_size=BS, hash_block_size=BS)
    a = kvcache_request("a", tokens, embeds(0.0))
    b = kvcache_request("b", tokens, embeds(0.5))
    assert num_hit_tokens(manager, a, b) == 0
    # Control: the same embeddings do hit (the two full blocks; the last token is recomputed).
    c = kvcache_request("c", tokens, embeds(0.0))
    assert manager.get_computed_blocks(c)[1] == 8


def test_every_block_gets_the_digest_of_its_rows() -> None:
    e = embeds(0.5)
    request = kvcache_request("a", list(range(10)), e)
    request.append_output_token_ids([7, 7, 7, 7, 7, 7])  # blocks 2 (rows 8..9) and 3 (none)
    assert len(request.block_hashes) == 4
    for i, block_hash in enumerate(request.block_hashes):
        start, end = i * BS, (i + 1) * BS
        rows = e[start:end]
        digest = hashlib.sha256(rows.numpy().tobytes()).digest()
        parent = request.block_hashes[i - 1] if i else None
        tokens = request.all_token_ids[start:end]
        assert block_hash == K.hash_block_tokens(K.sha256, parent, tokens, (digest,))


def test_embeds_only_prompt_reads_as_zero_tokens() -> None:
    request = kvcache_request("a", None, embeds(0.0, num_tokens=5))
    assert request.prompt_token_ids is None
    assert request.num_prompt_tokens == request.num_tokens == 5
    assert list(request.all_token_ids) == [0] * 5
    assert len(request.block_hashes) == 1


def test_digest_is_memoised_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original: Callable[[Any], memoryview] = kcu.tensor_data

    def counting(tensor: Any) -> memoryview:
        calls.append(len(tensor))
        return original(tensor)

    monkeypatch.setattr(kcu, "tensor_data", counting)
    request = kvcache_request("a", None, embeds(0.0))
    assert calls == [4, 4]
    first = kcu.generate_block_hash_extra_keys(request, 0, 4, 0)
    assert kcu.generate_block_hash_extra_keys(request, 0, 4, 0) == first
    assert calls == [4, 4]  # served from request._prompt_embeds_per_block_hashes


def test_digest_follows_dtype_and_ignores_strides() -> None:
    e = embeds(0.5)
    transposed_copy = e.t().contiguous().t()  # same values, column-major strides
    assert not transposed_copy.is_contiguous()
    same = kvcache_request("b", None, transposed_copy)
    assert same.block_hashes == kvcache_request("a", None, e).block_hashes
    half = kvcache_request("c", None, e.to(torch.bfloat16))
    assert half.block_hashes[0] != same.block_hashes[0]


def test_bad_prompt_embeds_are_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids has 3 tokens but prompt_embeds has 10"):
        kvcache_request("a", [1, 2, 3], embeds(0.0))
    with pytest.raises(ValueError, match="prompt_token_ids=None and prompt_embeds=None"):
        K.Request("a", None)
    with pytest.raises(TypeError, match="prompt_embeds must be a tensor"):
        K.Request("a", None, prompt_embeds=3.0)


# ---------------------------------------------------------------- spec, via the kit


def test_different_embeddings_do_not_hit_on_spec() -> None:
    adapter = resolve_adapter("spec")
    config = ManagerConfig.full_attention(num_blocks=16, block_size=BS, max_model_len=64)
    adapter.init_hashes(config, "0")
    manager = adapter.build_manager(config)

    def request(rid: str, style: float) -> Any:
        rows = [[float(i), style] for i in range(10)]
        args = {"request_id": rid, "prompt_token_ids": None, "prompt_embeds": rows}
        return adapter.build_request(config, args)

    assert num_hit_tokens(manager, request("a", 0.0), request("b", 0.5)) == 0
    assert manager.get_computed_blocks(request("c", 0.0))[1] == 8


# ---------------------------------------------------------------- against vLLM


def seed_hashes(vllm_reference: ModuleType, name: str) -> None:
    """Seed vLLM's and kvcache's ``NONE_HASH`` for hash function ``name`` alike."""
    from vllm.v1.core import kv_cache_utils as vllm_utils

    with pytest.MonkeyPatch().context() as m:
        m.setenv("PYTHONHASHSEED", "0")
        vllm_utils.init_none_hash(vllm_reference.vllm_hash_fn(name))
        K.init_none_hash(K.get_hash_fn_by_name(name))


def vllm_request(vllm_reference: ModuleType, name: str, hasher: Any = "vllm", **kw: Any) -> Any:
    """vLLM's ``Request`` for kvcache-vocabulary keywords, hashed by vLLM's hasher
    (``hasher="vllm"``), by the given one, or not at all (None)."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core import kv_cache_utils as vllm_utils
    from vllm.v1.request import Request as VllmRequest

    if "lora_request" in kw:
        lora = kw["lora_request"]
        kw["lora_request"] = LoRARequest(lora.lora_name, lora.lora_int_id, "/x")
    if "mm_features" in kw:
        kw["mm_features"] = [
            MultiModalFeatureSpec(data=None, modality="image", identifier=f.identifier,
                                  mm_position=PlaceholderRange(f.mm_position.offset,
                                                               f.mm_position.length))
            for f in kw["mm_features"]
        ]
    if hasher == "vllm":
        hasher = vllm_utils.get_request_block_hasher(BS, vllm_reference.vllm_hash_fn(name))
    return VllmRequest("v", sampling_params=SamplingParams(max_tokens=8), pooling_params=None,
                       block_hasher=hasher, **kw)


MIXES: dict[str, dict[str, Any]] = {
    "embeds": {},
    "lora": {"lora_request": K.LoRARequest("lora-a", 1)},
    "salt": {"cache_salt": "salt-x"},
    "mm": {"mm_features": [K.MultiModalFeatureSpec(
        identifier="img-0", mm_position=K.PlaceholderRange(offset=3, length=4))]},
    "all": {"lora_request": K.LoRARequest("lora-b", 2), "cache_salt": "salt-y",
            "mm_features": [K.MultiModalFeatureSpec(
                identifier="img-1", mm_position=K.PlaceholderRange(offset=1, length=6))]},
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("name", HASH_NAMES)
def test_block_hashes_are_byte_identical_to_vllm(
    vllm_reference: ModuleType, name: str, mix: str
) -> None:
    seed_hashes(vllm_reference, name)
    kvcache_hasher = K.get_request_block_hasher(BS, K.get_hash_fn_by_name(name))
    for tokens, dtype in ((list(range(10)), torch.float32), (None, torch.bfloat16)):
        kw = dict(MIXES[mix], prompt_token_ids=tokens, prompt_embeds=embeds(0.5, dtype=dtype))
        theirs = vllm_request(vllm_reference, name, **kw)
        ours = K.Request("k", block_hasher=kvcache_hasher, **kw)
        for request in (theirs, ours):
            request.append_output_token_ids([1, 2, 3, 4, 5, 6])
        assert len(ours.block_hashes) == 4
        assert [bytes(h) for h in ours.block_hashes] == [bytes(h) for h in theirs.block_hashes]
        # kvcache's hasher on vLLM's Request gives the same bytes too.
        unhashed = vllm_request(vllm_reference, name, hasher=None, **kw)
        assert kvcache_hasher(unhashed) == ours.block_hashes[:2]


def test_vllm_request_on_kvcache_manager_gets_no_false_hit(vllm_reference: ModuleType) -> None:
    """The reported case: vLLM's Request, each implementation's own hasher and manager
    (kvcache claimed 8 cached tokens before the fix)."""
    import vllm.v1.kv_cache_interface as vllm_interface
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    seed_hashes(vllm_reference, "sha256")
    found = {}
    for label, factory, config, hasher in (
        ("vllm", VllmKVCacheManager, full_attention_config(vllm_interface, torch.float16),
         "vllm"),
        ("kvcache", K.KVCacheManager, full_attention_config(K),
         K.get_request_block_hasher(BS, K.sha256)),
    ):
        manager = factory(config, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS)
        a, b = (
            vllm_request(vllm_reference, "sha256", hasher=hasher,
                         prompt_token_ids=list(range(10)), prompt_embeds=embeds(style))
            for style in (0.0, 0.5)
        )
        found[label] = num_hit_tokens(manager, a, b)
    assert found == {"vllm": 0, "kvcache": 0}
