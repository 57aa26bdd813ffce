"""vLLM 0.33.0's lookup for a KV connector that takes divergent hybrid hits
(``get_computed_blocks_for_connector``), on kvcache's drop-in (``kvcache.vllm_0_33``)
and on the spec under its 0.33.0 profile, driven through the kit's sides.

A full-attention group and a Mamba 'align' group (blocks of 4 tokens, hashed at 4):
request ``a`` computes a 13-token prompt in chunks of 4, 4, 4 and 1 and is freed,
leaving full-attention blocks 1, 3, 5 and Mamba states in blocks 4 (8 tokens) and 6
(12 tokens) cached. Request ``b`` repeats the prompt. The expected values below are
what vLLM 0.33.0 returned on the same calls (run once through the kit's ``vllm`` side
with ``.venv-0.33``): evicting the Mamba state at 12 leaves the full-attention hit
deeper (diverged, the scheduler then looks up again), evicting the full-attention
tail leaves the Mamba state deeper (the lookup falls back to ``get_computed_blocks``).
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.sides import Side, make_side

IMPLS = ["kvcache-0.33", "spec-0.33"]
PROMPT = list(range(13))
HYBRID = (GroupConfig("full", 4), GroupConfig("mamba", 4, mamba_cache_mode="align"))


@pytest.fixture(autouse=True)
def keep_none_hash() -> Any:
    """The sides set kvcache's process-wide NONE_HASH; put it back for later tests."""
    saved = kcu.NONE_HASH
    yield
    kcu.NONE_HASH = saved


def ids(*groups: list[int]) -> dict[str, Any]:
    """Canonical block ids, one list per group."""
    return {"tuple": list(groups)}


def cached_side(impl: str, groups: tuple[GroupConfig, ...] = HYBRID, **b_fields: Any) -> Side:
    """A side after ``a`` computed and freed ``PROMPT``, with ``b`` (the same prompt,
    ``b_fields`` added) waiting."""
    side = make_side(impl, ManagerConfig(num_blocks=24, groups=groups, max_model_len=64))
    side.call("add_request", {"request_id": "a", "prompt_token_ids": PROMPT, "max_tokens": 4})
    side.call("get_computed_blocks", {"request_id": "a"})
    done = 0
    for n in (4, 4, 4, 1):
        which = "last" if done == 0 else "none"
        side.call("allocate_slots", {"request_id": "a", "num_new_tokens": n,
                                     "new_computed_blocks": which})  # fmt: skip
        done += n
        side.call("update_request", {"request_id": "a", "status": "RUNNING",
                                     "num_computed_tokens": done})  # fmt: skip
    side.call("update_request", {"request_id": "a", "status": "FINISHED_ABORTED"})
    side.call("free", {"request_id": "a"})
    side.call("take_events", {})
    side.call("add_request", {"request_id": "b", "prompt_token_ids": PROMPT, "max_tokens": 4,
                              **b_fields})  # fmt: skip
    return side


def connector(side: Side) -> dict[str, Any]:
    result: dict[str, Any] = side.call("get_computed_blocks_for_connector", {"request_id": "b"})
    return result


def plain(side: Side) -> dict[str, Any]:
    result: dict[str, Any] = side.call("get_computed_blocks", {"request_id": "b"})
    return result


def hit(blocks: dict[str, Any], n: int, diverged: bool) -> dict[str, Any]:
    return {"block_ids": blocks, "num_computed_tokens": n, "shared_prefix_boundary": 0,
            "hit_diverged": diverged}  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_every_group_cached_is_not_diverged(impl: str) -> None:
    side = cached_side(impl)
    assert connector(side) == hit(ids([1, 3, 5], [0, 0, 6]), 12, False)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_evicted_mamba_state_diverges_and_the_fallback_agrees_lower(impl: str) -> None:
    side = cached_side(impl)
    side.call("evict_blocks", {"block_ids": [6]})  # the Mamba state at 12 tokens
    # Full attention's own hit (12), each group with its own hit blocks (Mamba: 8).
    assert connector(side) == hit(ids([1, 3, 5], [0, 4]), 12, True)
    # The scheduler's fallback without external tokens: the length both groups have.
    assert plain(side) == {"block_ids": ids([1, 3], [0, 4]), "num_computed_tokens": 8}


@pytest.mark.parametrize("impl", IMPLS)
def test_an_evicted_full_attention_tail_falls_back_to_the_common_hit(impl: str) -> None:
    side = cached_side(impl)
    side.call("evict_blocks", {"block_ids": [5]})  # full attention's third block
    # Mamba (12) hit deeper than full attention (8): get_computed_blocks' answer.
    assert connector(side) == hit(ids([1, 3], [0, 4]), 8, False)
    assert plain(side) == {"block_ids": ids([1, 3], [0, 4]), "num_computed_tokens": 8}


@pytest.mark.parametrize("impl", IMPLS)
def test_the_lookup_records_nothing(impl: str) -> None:
    side = cached_side(impl, kv_cache_report_mode="full")
    side.call("evict_blocks", {"block_ids": [6]})
    side.call("take_events", {})
    assert side.call("make_prefix_cache_stats", {})["fields"]["requests"] == 1  # a's
    assert connector(side)["hit_diverged"] is True
    # No stats (the scheduler records the admitted hit) and, unlike get_computed_blocks
    # in the "full" report mode, no events for the hit blocks.
    assert side.call("make_prefix_cache_stats", {})["fields"]["requests"] == 0
    assert side.call("take_events", {}) == []
    plain(side)  # one event per group for its hit blocks
    assert [e["type"] for e in side.call("take_events", {})] == ["BlockStored"] * 2


@pytest.mark.parametrize("impl", IMPLS)
def test_no_lookup_for_a_request_that_skips_the_cache(impl: str) -> None:
    side = cached_side(impl, skip_reading_prefix_cache=True)
    assert connector(side) == hit(ids([], []), 0, False)


@pytest.mark.parametrize("impl", IMPLS)
def test_without_mamba_it_is_the_plain_lookup(impl: str) -> None:
    groups = (GroupConfig("full", 4), GroupConfig("sliding_window", 4, sliding_window=4))
    side = cached_side(impl, groups)
    side.call("evict_blocks", {"block_ids": [5]})
    assert connector(side) == hit(ids([1, 3], [0, 4]), 8, False)
