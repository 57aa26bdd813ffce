"""With fine-grained hits (vLLM 0.33.0, ``mamba_fine_grained_hits``), every group caches
a request's whole computed length, the unaligned tail past the last scheduler-block
boundary included: an EAGLE group whose block is smaller than the scheduler block
must not be rounded down to that boundary again.

Geometry: full attention hashed and blocked at 2 tokens beside a Mamba 'align' group
of 8-token blocks (so the scheduler block is 8, and fine-grained hits turn on); a
22-token prompt ends 6 tokens past the boundary at 16. Under 0.25.1 (no fine-grained
hits) the full-attention group caches up to 16, and with EAGLE one block past it (18).

vLLM 0.33.0's own test of this rule spies on the managers' ``cache_blocks`` by
assigning to an instance attribute, which compiled managers refuse
(``upstream_data/known_failing_compiled-0.33.0.toml``); this one reads what was
cached, so it holds on both builds (it is in ``make verify``'s compiled pass).
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    sha256,
)
from kvcache import vllm_0_33 as v33

HBS = 2  # hash block = full-attention block
MAMBA = 8  # Mamba block = scheduler block
PROMPT = 22  # 2 * MAMBA + 3 * HBS: 6 tokens past the last scheduler-block boundary


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    kcu.init_none_hash(sha256)


def kv_cache_config() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=HBS, num_kv_heads=1, head_size=1, dtype="float32")
    mamba = MambaSpec(block_size=MAMBA, shapes=((1,),), dtypes=("float32",),
                      mamba_cache_mode="align")  # fmt: skip
    groups = [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["mamba"], mamba)]
    return KVCacheConfig(num_blocks=40, kv_cache_tensors=[], kv_cache_groups=groups)


def manager_and_request(release: str, use_eagle: bool) -> tuple[Any, Request]:
    if release == "0.33.0":
        manager: Any = v33.KVCacheManager(
            kv_cache_config(), max_model_len=1024, scheduler_block_size=MAMBA,
            hash_block_size=HBS, use_eagle=use_eagle,
        )  # fmt: skip
        hasher = v33.get_request_block_hasher(HBS, sha256)
    else:
        manager = KVCacheManager(kv_cache_config(), 1024, MAMBA, HBS, use_eagle=use_eagle)
        hasher = kcu.get_request_block_hasher(HBS, sha256)
    return manager, Request("r", list(range(PROMPT)), block_hasher=hasher)


def expected_full_tokens(release: str, use_eagle: bool) -> int:
    """Tokens the full-attention group caches for the prompt, by the rule stated above."""
    if release == "0.33.0":
        return PROMPT
    aligned = PROMPT // MAMBA * MAMBA
    return aligned + HBS if use_eagle else aligned


@pytest.mark.parametrize("use_eagle", [False, True])
@pytest.mark.parametrize("release", ["0.33.0", "0.25.1"])
def test_every_group_caches_the_unaligned_tail(release: str, use_eagle: bool) -> None:
    manager, request = manager_and_request(release, use_eagle)
    coordinator = manager.coordinator
    full, mamba = coordinator.single_type_managers
    assert coordinator.enable_partial_hash_hits is (release == "0.33.0")
    assert full.use_eagle is use_eagle and full.block_size < coordinator.scheduler_block_size

    blocks, num_computed = manager.get_computed_blocks(request)[:2]
    assert num_computed == 0
    assert manager.allocate_slots(request, PROMPT, num_computed, blocks) is not None

    full_tokens = expected_full_tokens(release, use_eagle)
    assert full.num_cached_block[request.request_id] == full_tokens // HBS
    assert mamba.num_cached_block[request.request_id] == PROMPT // MAMBA
    # The pool holds exactly the full-attention blocks of those tokens under their hashes.
    pool = coordinator.block_pool
    cached = [pool.get_cached_block(h, [0]) is not None for h in request.block_hashes]
    assert cached == [i < full_tokens // HBS for i in range(PROMPT // HBS)]
