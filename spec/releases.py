"""What a release changes, as rules: for each switch the flow reads as a value,
vLLM 0.25.1's rule beside the rule the switch turns on (``RULES``).

``releases.toml`` says when each switch came; this table says what it does, so
0.33.0's value rules read in one place next to 0.25.1's. A profile carries its
release's rules (``profile.rules``, built by ``rules_for``) and the flow calls each
under its switch's name.

The other switches are read as ``profile.<switch>``: what a release admits, checked
once when a manager is built (``circular_buffer_groups``, ``hisparse_groups``,
``mamba_prefill_checkpoints``, ``lookahead_arguments``, ``mamba_align_only``,
``retention_zero_without_window``); arguments of the hashing and event vocabulary
(``tagged_extra_keys``, ``mm_keys_by_window``, ``none_hash_fixed_seed``,
``event_session_id``); the context-parallel geometry and its checks
(``pcp_not_scaled``, ``dcp_sharded_geometry``); and steps that change the flow's path
rather than a value in it (``mamba_frees_processed_states``,
``mamba_prompt_tail_state``, ``mamba_fine_grained_hits``, ``partial_hit_copy_on_write``,
``partial_prompt_tail_entries``, ``shared_prefix_junctions``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from . import pure
from .vocab import (
    NULL_BLOCK,
    BlockRemoved033,
    BlockStored033,
    PrefixCacheStats,
    PrefixCacheStats033,
    is_a,
)


@dataclass(frozen=True)
class ReleaseRules:
    """One release's value rules, each named after its switch (``RULES`` says what each
    one maps)."""

    eagle_master_switch: Callable[[set[int], bool], set[int]]
    mamba_no_eagle_margin: Callable[[Any], bool]
    eagle_peek_to_hashed_length: Callable[[int, int], int]
    trim_every_full_group: int | None
    retention_replay_boundaries: Callable[[int, int, bool], tuple[int, ...]]
    free_on_processed_tokens: Callable[[int, Any], int]
    external_blocks_floor_zero: Callable[[int], int]
    cache_within_hashed_tokens: Callable[[int, Any, Any], int]
    adopt_computed_without_new_tokens: Callable[[int], bool]
    full_report_mode: Callable[[Any], bool]
    pop_drops_null_head: Callable[[list[int]], list[int]]
    cascade_always_zero: Callable[[Any, str], int]
    mamba_caps_new_state_blocks: Callable[[int, int, int], int]
    stats_at_admission: Callable[[PrefixCacheStats, int, int, bool], None]
    new_block_ids_zeroing_only: Callable[[bool], bool]
    zero_every_attention_group: Callable[[Any, bool], bool]
    stats_hits_by_source: type[PrefixCacheStats]
    event_new_fields: Mapping[str, type]


RULES: dict[str, tuple[Any, Any]] = {  # switch: (vLLM 0.25.1's rule, the rule once on)
    # (the groups marked EAGLE, use_eagle) -> the groups that drop a hit block
    "eagle_master_switch": (lambda ids, use_eagle: ids,
                            lambda ids, use_eagle: ids if use_eagle else set()),
    # layer spec -> whether a hybrid lookup's EAGLE group of that spec peeks past its
    # candidate length (0.26.0: Mamba does not, its finder never drops a block)
    "mamba_no_eagle_margin": (lambda spec: True, lambda spec: not is_a(spec, "MambaSpec")),
    # (the request's hashed tokens, max_cache_hit_length) -> how far an EAGLE peek
    # past the candidate may reach (one group never peeks past max_cache_hit_length)
    "eagle_peek_to_hashed_length": (lambda hashed, max_hit: max_hit,
                                    lambda hashed, max_hit: hashed),
    # how many of a hybrid lookup's attention groups are trimmed to the common hit
    # (the full-attention ones among them; None: all)
    "trim_every_full_group": (1, None),
    # (prompt tokens, scheduler block size, EAGLE) -> where sparse retention keeps tails
    "retention_replay_boundaries": (lambda prompt, block, eagle: (prompt - 1,),
                                    pure.replay_boundaries),
    # (computed tokens, request) -> the tokens allocate_slots frees skipped blocks by:
    # in 0.33.0 not those in-flight steps may still read
    "free_on_processed_tokens": (
        lambda computed, request: computed,
        lambda computed, request: max(0, computed - getattr(request, "num_in_flight_tokens", 0))),
    # a group's block shortfall for external tokens -> the fresh blocks it takes
    # (after a speculative over-allocation it may hold more already)
    "external_blocks_floor_zero": (lambda num_blocks: num_blocks,
                                   lambda num_blocks: max(num_blocks, 0)),
    # (tokens, request, pool) -> how far a group keys its full blocks: in 0.33.0 only
    # as far as the request has hashes (lookahead hashing delays a block's hash)
    "cache_within_hashed_tokens": (
        lambda num_tokens, request, pool: num_tokens,
        lambda num_tokens, request, pool: min(
            num_tokens, len(pool.block_hashes(request)) * int(pool.hash_block_size))),
    # new computed tokens -> whether allocate_slots takes num_new_tokens == 0 without
    # external ones
    "adopt_computed_without_new_tokens": (lambda num_new_computed: False,
                                          lambda num_new_computed: num_new_computed > 0),
    # request -> whether its lookup also queues BlockStored for the blocks it hit
    "full_report_mode": (
        lambda request: False,
        lambda request: getattr(request, "kv_cache_report_mode", "incremental") == "full"),
    # a group's ids popped for free -> the ids pop_blocks_for_free returns
    "pop_drops_null_head": (
        lambda ids: ids,
        lambda ids: list(itertools.dropwhile(lambda b: b == NULL_BLOCK, ids))),
    # (group manager, request id) -> the group's common prefix blocks (0.32.0 removed
    # cascade attention: 0, no lookup)
    "cascade_always_zero": (lambda manager, rid: manager.get_num_common_prefix_blocks(rid),
                            lambda manager, rid: 0),
    # an 'align' Mamba group's (new state blocks, checkpoint blocks, shortfall) -> the
    # new blocks it counts: 0.33.0 counts the shortfall, capped at one state block
    # (plus the checkpoint's), where there are new blocks at all
    "mamba_caps_new_state_blocks": (
        lambda num_new, checkpoint, shortfall: num_new,
        lambda num_new, checkpoint, shortfall: min(num_new + checkpoint, shortfall)
        if num_new > 0 else num_new),
    # (stats, tokens, hit tokens, preempted) -> what a lookup records (0.27.0: nothing,
    # the scheduler records the request once it is admitted)
    "stats_at_admission": (lambda stats, *counts: stats.record(*counts),
                           lambda stats, *counts: None),
    # whether the layout needs zeroing -> whether any group records its new block ids
    "new_block_ids_zeroing_only": (lambda needs_zeroing: True,
                                   lambda needs_zeroing: needs_zeroing),
    # (layer spec, whether the layout needs zeroing) -> whether a group beyond full
    # attention and MLA (exact classes) records its new block ids: every attention kind
    # but a ring buffer beside a Mamba group
    "zero_every_attention_group": (
        lambda spec, needs_zeroing: False,
        lambda spec, needs_zeroing: needs_zeroing and is_a(spec, "AttentionSpec")
        and not is_a(spec, "CircularBufferSpec")),
    # the class of the prefix-cache stats a manager records
    "stats_hits_by_source": (PrefixCacheStats, PrefixCacheStats033),
    # event classes replaced when events are taken (by 0.25.1's class name), the new
    # fields at their defaults
    "event_new_fields": ({}, {"BlockStored": BlockStored033, "BlockRemoved": BlockRemoved033}),
}


def rules_for(on: Collection[str]) -> ReleaseRules:
    """The value rules of a profile whose switches ``on`` are on: each switch's second
    rule where it is on, its first elsewhere."""
    return ReleaseRules(**{name: pair[name in on] for name, pair in RULES.items()})
