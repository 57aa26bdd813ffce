"""The per-group lookup (``find_longest_cache_hit_per_group``, behind vLLM 0.33.0's
``get_computed_blocks_for_connector``) under ``Profile("0.33.0")``: with fine-grained
hits each kind's hit ends on a hash-block boundary (not the scheduler block), and
an EAGLE kind other than Mamba looks one hash block further before dropping it.
kvcache's drop-in against the spec's 0.33 profile, with 0.25.1's numbers beside."""

from __future__ import annotations

from typing import Any

import pytest

import kvcache as K
import spec as S
from kvcache import vllm_0_33 as v33

HBS, MAMBA = 4, 16  # full attention hashed at 4 tokens, Mamba 'align' blocks of 16
PROMPT = list(range(25))  # its last hash boundary, 24, lies inside the second Mamba block


def kv_cache_config() -> K.KVCacheConfig:
    full = K.FullAttentionSpec(block_size=HBS, num_kv_heads=1, head_size=8, dtype="float16")
    mamba = K.MambaSpec(block_size=MAMBA, shapes=((1,),), dtypes=("float16",),
                        mamba_cache_mode="align")  # fmt: skip
    groups = [K.KVCacheGroupSpec(["full"], full), K.KVCacheGroupSpec(["mamba"], mamba)]
    return K.KVCacheConfig(num_blocks=40, kv_cache_tensors=[], kv_cache_groups=groups)


def per_group(release: str, use_eagle: bool, max_length: int) -> list[tuple[int, ...]]:
    """Per-group hit lengths of a repeat of ``PROMPT`` after a first request computed
    and freed it, on kvcache and on the spec (both under ``release``)."""
    kwargs: dict[str, Any] = dict(max_model_len=64, scheduler_block_size=MAMBA,
                                  hash_block_size=HBS, use_eagle=use_eagle)  # fmt: skip
    if release == "0.33.0":
        impl: Any = v33.KVCacheManager(kv_cache_config(), **kwargs)
        hasher = v33.get_request_block_hasher(HBS, K.sha256)
    else:
        impl = K.KVCacheManager(kv_cache_config(), **kwargs)
        hasher = K.get_request_block_hasher(HBS, K.sha256)
    oracle = S.KVCacheManager(kv_cache_config(), profile=release, **kwargs)
    lengths = []
    for m in (impl, oracle):
        first = K.Request("first", PROMPT, block_hasher=hasher)
        for n in (24, 1):
            assert m.allocate_slots(first, n) is not None
            first.num_computed_tokens += n
            m.new_step_starts()
        m.free(first)
        again = K.Request("again", PROMPT, block_hasher=hasher)
        hashes = again.block_hashes if m is impl else m.block_pool.block_hashes(again)
        layer = getattr(m, "coordinator", m)  # the spec has no coordinator layer
        blocks, hit = layer.find_longest_cache_hit_per_group(hashes, max_length)
        ids = [[getattr(b, "block_id", b) for b in group] for group in blocks]
        lengths.append((tuple(hit), tuple(len(g) for g in ids)))
    assert lengths[0] == lengths[1], lengths  # kvcache and the spec agree
    return [lengths[0][0], lengths[0][1]]


@pytest.mark.parametrize("max_length", [8, 12, 24])
def test_fine_grained_per_group_hits_end_on_hash_blocks(max_length: int) -> None:
    hits, blocks = per_group("0.33.0", False, max_length)
    assert hits[0] == max_length and blocks[0] == max_length // HBS  # not rounded to 16
    # Mamba keeps a state at the prompt's last hash boundary (24) only.
    assert hits[1] == (24 if max_length == 24 else 0)
    # 0.25.1 (no fine-grained hits): full attention's hit rounds down to the 16-token
    # scheduler block, Mamba (no partial entry) hits nothing.
    old_hits, _ = per_group("0.25.1", False, max_length)
    assert old_hits == ((max_length // MAMBA * MAMBA, 0))


def test_an_eagle_full_group_looks_one_hash_block_further() -> None:
    # 0.33.0: looks to 12, drops one hash block: 8. 0.25.1: no look-ahead, so the
    # drop leaves one block less than the aligned hit.
    hits, _ = per_group("0.33.0", True, 8)
    assert hits[0] == 8
    # Up to the prompt's last boundary: the drop leaves 20, and Mamba (which caches
    # one hash block less with EAGLE) nothing. vLLM 0.33.0 gives the same (measured).
    assert per_group("0.33.0", True, 24)[0] == (20, 0)
    old_hits, _ = per_group("0.25.1", True, MAMBA)
    assert old_hits[0] == 0  # 16 aligned to 16, less the dropped block, realigned: 0
