"""Hand-written scenarios for the spec's Mamba prefill checkpoints (vLLM 0.33.0).

A Mamba 'align' group whose layer has ``num_prefill_checkpoint_blocks`` reserves one
more block for a prefill chunk that can leave the state at a reusable position
inside it (``mamba_prefill_checkpoints``). The expected tables follow 0.33.0's rules
(``docs/profiles.md``); ``python -m kvcache.kit.conformance --release 0.33.0 --subject spec-0.33``
holds the spec to the real vLLM 0.33.0 on the checkpoint families.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcache.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from kvcache.kv_cache_utils import get_request_block_hasher, sha256
from kvcache.request import Request
from spec import KVCacheManager, pure

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
NULL = 0


def mamba(blocks: int, alignment: int | None, block_size: int = 4) -> Any:
    """An 'align' Mamba layer spec with the checkpoint fields (kvcache's class: the
    spec reads layer specs as data)."""
    return MambaSpec(block_size=block_size, shapes=((2,),), dtypes=("float16",),
               mamba_cache_mode="align", num_prefill_checkpoint_blocks=blocks,
               prefill_checkpoint_alignment=alignment)


def manager(mamba_spec: Any, release: str = "0.33.0", **kwargs: Any) -> KVCacheManager:
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4, **ATTN)),
              KVCacheGroupSpec(["mamba"], mamba_spec)]
    return KVCacheManager(KVCacheConfig(20, [], groups), 64, 4, 4, profile=release, **kwargs)


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, block_hasher=get_request_block_hasher(4, sha256))


def test_exportable_positions() -> None:
    # Chunk [0, 13), 4-token blocks and hash blocks: the checkpoint at 12 is in column 2.
    assert pure.mamba_checkpoint_exportable(0, 13, 12, 4, 4, 1)
    assert not pure.mamba_checkpoint_exportable(0, 13, 12, 4, 4, None)  # no alignment
    assert not pure.mamba_checkpoint_exportable(0, 13, 12, 4, 4, 8)  # 12 is no multiple of 8
    assert not pure.mamba_checkpoint_exportable(2, 13, 12, 4, 4, 1)  # start off a hash block
    assert pure.mamba_checkpoint_exportable(0, 8, 4, 4, 4, 1)  # column 0, after the start's -1
    # 2-token hash blocks: [2, 8) starts in column 0, which its checkpoint would share.
    assert not pure.mamba_checkpoint_exportable(2, 8, 4, 2, 4, 1)
    assert pure.mamba_checkpoint_exportable(2, 12, 8, 2, 4, 2)
    assert not pure.mamba_checkpoint_exportable(0, 13, 2, 4, 4, 1)  # under a hash block in
    assert not pure.mamba_checkpoint_exportable(0, 12, 12, 4, 4, 1)  # not inside the chunk


def test_a_checkpoint_block_makes_a_one_chunk_prompt_reusable() -> None:
    """One chunk of 13 tokens: without checkpoint blocks only the running state (after
    13 tokens, in column 3) is kept, so the same prompt later hits nothing; with one the
    state after 12 tokens stays in column 2, keyed there, and the prompt hits 12."""
    prompt = list(range(13))
    for blocks, mamba_table, hit in ((0, [NULL, NULL, NULL, 5], 0), (1, [NULL, NULL, 5, 6], 12)):
        m = manager(mamba(blocks, 1))
        a = request("a", prompt)
        new = m.allocate_slots(a, 13)
        assert new is not None
        assert m.get_block_ids("a")[1] == mamba_table
        m.check_invariants()
        _, num_hit_tokens = m.get_computed_blocks(request("b", [*prompt, 99]))
        assert num_hit_tokens == hit, blocks
        m.free(a)
        m.check_invariants()


def test_an_unaligned_position_takes_no_checkpoint() -> None:
    """The layer exports states only every 8 tokens from the chunk's start: 12 is not
    one, so the chunk reserves nothing beyond its running state."""
    m = manager(mamba(1, 8))
    m.allocate_slots(request("a", list(range(13))), 13)
    assert m.get_block_ids("a")[1] == [NULL, NULL, NULL, 5]


def test_latest_only_retention_waits_for_the_prefill_end() -> None:
    """Retention 0 keeps only the latest state: a chunk short of the prefill's end
    reserves no checkpoint; the chunk reaching it does."""
    m = manager(mamba(1, 1), prefix_cache_retention_interval=0)
    a = request("a", list(range(21)))
    m.allocate_slots(a, 12)  # [0, 12): short of the prompt's 21 tokens
    assert m.get_block_ids("a")[1] == [NULL, NULL, 4]
    a.num_computed_tokens = 12
    m.allocate_slots(a, 9)  # [12, 21): the checkpoint at 20 in column 4, the state in 5
    table = m.get_block_ids("a")[1]
    assert len(table) == 6 and table[4] != NULL and table[5] != NULL, table
    m.check_invariants()


def test_release_0_25_1_refuses_checkpoint_fields() -> None:
    with pytest.raises(ValueError, match="num_prefill_checkpoint_blocks=1"):
        manager(mamba(1, None), release="0.25.1")
    manager(mamba(0, None), release="0.25.1")  # the defaults: as 0.25.1's MambaSpec
