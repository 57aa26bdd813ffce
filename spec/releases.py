"""What a release changes, as rules: for each switch of ``releases.toml``, vLLM
0.25.1's rule beside the rule the switch turns on (``RULES``).

``releases.toml`` says when each switch came; this table says what each does, so
every difference between 0.25.1 and 0.33.0 reads in one place. A profile carries
its release's rules (``profile.rules``, built by ``rules_for``) and the spec calls
each under its switch's name; it reads no switch as a flag. Most rules map values
(a count, a seed, the groups that drop an EAGLE block); a release that admits more
has a predicate (what it admits); a switch that adds a step has the step (0.25.1's:
nothing); the vocabulary's switches are its arguments (whether keys are tagged).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import pure
from .vocab import (
    NULL_BLOCK,
    PrefixCacheStats,
    PrefixCacheStats033,
    is_a,
    is_dcp_sharded,
    prefill_checkpoint_fields,
    sha256,
    sha256_cbor,
)


class Geometry(NamedTuple):
    """``dcp_sharded_geometry``'s parts: which layer specs context parallelism scales,
    how a hybrid caching layout under it is checked, what a hash block size off the
    one group's block size raises."""

    scales: Callable[[Any], bool]
    check_hybrid: Callable[[Sequence[Any], int, int], None]
    refusal: type[Exception]


class MambaFrees(NamedTuple):
    """``mamba_frees_processed_states``' parts: (computed tokens, speculative blocks)
    -> the tokens Mamba frees by; whether an 'align' request that needs no new block
    counts as allocated; whether passed 'align' states retire right to left past
    nulls (else the skipped prefix is freed up to its first null)."""

    free_by: Callable[[int, int], int]
    held_counts_as_allocated: bool
    retires_past_nulls: bool


NO_CONTEXT_PARALLEL = ("hybrid layouts and kinds other than full attention do not support "
                       "context parallelism with prefix caching (vLLM asserts)")
"""What refusing context parallelism under prefix caching says (NotImplementedError)."""


class MambaTail(NamedTuple):
    """Where an 'align' Mamba group keys its prompt-tail state: ``boundary`` (prompt
    tokens, hash block, EAGLE's drop, lookahead tokens) -> the position, and whether
    only a position inside a block is keyed (``inside_only``)."""

    boundary: Callable[[int, int, bool, int], int]
    inside_only: bool


StatsHook = Callable[[PrefixCacheStats, int, int, bool], None]
"""(stats, tokens, hit tokens, preempted) -> records the lookup, or nothing."""


def _record_stats(stats: PrefixCacheStats, *counts: Any) -> None:
    stats.record(*counts)


def _skip_stats(stats: PrefixCacheStats, *counts: Any) -> None:
    return None


class StatsAt(NamedTuple):
    """``stats_at_admission``'s parts: what the lookup records, and what the
    scheduler's admission of the request records (``record_prefix_cache_stats``)."""

    lookup: StatsHook
    admission: StatsHook


def refuse_hybrid_context_parallel(specs: Sequence[Any], dcp: int, pcp: int) -> None:
    """0.25.1: a hybrid layout with prefix caching takes no context parallelism."""
    if max(dcp, pcp) > 1:
        raise NotImplementedError(NO_CONTEXT_PARALLEL)


def check_hybrid_context_parallel(specs: Sequence[Any], dcp: int, pcp: int) -> None:
    """0.33.0: under pcp each group is full attention or replicated attention; under
    dcp each is full attention or replicated (AssertionError; vLLM asserts)."""
    for i, spec in enumerate(specs):
        full, replicated = is_a(spec, "FullAttentionSpec"), not is_dcp_sharded(spec)
        if pcp > 1 and not (full or (replicated and is_a(spec, "AttentionSpec"))):
            raise AssertionError(f"pcp_world_size={pcp}: group {i} is neither full "
                                 "attention nor replicated attention")
        if dcp > 1 and not (full or replicated):
            raise AssertionError(f"dcp_world_size={dcp}: group {i} is neither full "
                                 "attention nor replicated")


HISPARSE_KINDS = ("HiSparseResidentSpec", "HiSparseHotSpec")
"""vLLM 0.33.0's HiSparse spec classes (exact names)."""


@dataclass(frozen=True)
class ReleaseRules:
    """One release's rules, each named after its switch (``RULES`` says what each is)."""

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
    mamba_caps_new_state_blocks: bool
    stats_at_admission: StatsAt
    new_block_ids_zeroing_only: Callable[[bool], bool]
    zero_every_attention_group: Callable[[Any, bool], bool]
    stats_hits_by_source: type[PrefixCacheStats]
    event_locality: Mapping[str, str]
    event_ownership: Mapping[str, str]
    event_session_id: Mapping[str, str]
    event_lookahead_tokens: Mapping[str, str]
    circular_buffer_groups: Callable[[Any], bool]
    tq_spec_removed: Callable[[Any], bool]
    hisparse_groups: Callable[[Any, str | None], bool]
    mamba_prefill_checkpoints: Callable[[Any], tuple[int, int | None] | None]
    prefill_lookahead_argument: Callable[[int], bool]
    lookahead_arguments: Callable[[int], bool]
    mamba_align_only: Callable[[Any], bool]
    retention_zero_without_window: Callable[[int, bool], bool]
    tagged_extra_keys: bool
    mm_keys_by_window: bool
    none_hash_fixed_seed: Callable[[str | None, Callable[[Any], bytes]], str | None]
    pcp_not_scaled: Callable[[int, int], int]
    dcp_sharded_geometry: Geometry
    dcp_full_attention_only: Callable[[Any], bool] | None
    dcp_sharded_field: bool
    mamba_frees_processed_states: MambaFrees
    mamba_partial_prompt_tail: MambaTail | None
    mamba_prompt_tail_state: MambaTail | None
    mamba_eagle_state_drop: Callable[[bool], bool]
    mamba_checkpoint_at_prefill_end: Callable[[int, int], bool]
    mamba_prompt_checkpoint_kept: bool
    mamba_checkpoint_hit_alignment: Callable[[Any], int]
    mamba_checkpoint_eagle_whole_prompt: Callable[[int, int, bool, int], int]
    mamba_checkpoint_relocates_speculative: bool
    mamba_checkpoint_retention_mask: Callable[[Any, int, int | None, bool, bool], bool]
    mamba_tail_engine_eagle: Callable[[bool, bool], bool]
    mamba_fine_grained_hits: Callable[[Any], None]
    fine_grained_hits_under_dcp: Callable[[int], bool]
    cache_mask_hit_alignment: Callable[[Any], int]
    partial_hit_copy_on_write: Callable[[int, int], bool]
    partial_prompt_tail_entries: Callable[[Any, Any, int], None]
    prompt_tail_before_last_token: Callable[[bool], int]
    shared_prefix_junctions: Callable[[int], int]
    junction_eagle_tail: Callable[[int, int, bool], list[int]]

    def event_fields(self, name: str) -> tuple[str, ...]:
        """The fields event class ``name`` carries beyond 0.25.1's, in vLLM's order."""
        return tuple(rule[name] for rule in (self.event_locality, self.event_ownership,
                                             self.event_session_id, self.event_lookahead_tokens)
                     if name in rule)


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
    # whether an 'align' Mamba group's new blocks are its shortfall capped by what one
    # step can take (0.31.0), not that cap itself (pure.mamba_align_num_new_blocks)
    "mamba_caps_new_state_blocks": (False, True),
    # where a lookup's stats are recorded: at the lookup, or (0.27.0) once the
    # scheduler admits the request (see StatsAt)
    "stats_at_admission": (StatsAt(_record_stats, _skip_stats),
                           StatsAt(_skip_stats, _record_stats)),
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
    # event class name -> the field it gains (ReleaseRules.event_fields: in this order)
    "event_locality": ({}, {"BlockStored": "locality", "BlockRemoved": "locality"}),
    "event_ownership": ({}, {"BlockStored": "ownership", "BlockRemoved": "ownership"}),
    "event_session_id": ({}, {"BlockStored": "session_id"}),  # the request's
    "event_lookahead_tokens": ({}, {"BlockStored": "lookahead_token_ids"}),
    # layer spec -> whether the release admits its group (0.26.0 brought ring buffers)
    "circular_buffer_groups": (lambda spec: not is_a(spec, "CircularBufferSpec"),
                               lambda spec: True),
    # layer spec -> whether the release admits its group (0.28.0 removed TurboQuant's)
    "tq_spec_removed": (lambda spec: True,
                        lambda spec: type(spec).__name__ != "TQFullAttentionSpec"),
    # (layer spec, group role) -> whether the release admits the group (HiSparse)
    "hisparse_groups": (lambda spec, role: role != "hisparse_source"
                        and type(spec).__name__ not in HISPARSE_KINDS,
                        lambda spec, role: True),
    # Mamba spec -> the prefill-checkpoint fields the release reads (blocks, alignment);
    # None: it has none (a spec setting them is refused; no states are offered)
    "mamba_prefill_checkpoints": (lambda spec: None, prefill_checkpoint_fields),
    # num_prefill_lookahead -> whether the release admits it (0.25.1: only 0)
    "prefill_lookahead_argument": (lambda value: not value, lambda value: True),
    # num_hash_lookahead_tokens -> whether the release admits it (before 0.33.0: only
    # 0); it admits num_prefill_lookahead too
    "lookahead_arguments": (lambda value: not value, lambda value: True),
    # layer spec -> whether a caching manager admits it (0.33.0: Mamba only in 'align')
    "mamba_align_only": (lambda spec: True, lambda spec: type(spec).__name__ != "MambaSpec"
                         or spec.mamba_cache_mode == "align"),
    # (a retention interval, a sliding-window or Mamba group?) -> whether it is checked
    # (0.33.0 ignores 0 without such a group)
    "retention_zero_without_window": (lambda interval, windowed: True,
                                      lambda interval, windowed: interval != 0 or windowed),
    # whether a block's extra keys name their source: ("lora", name, path), ("mm", ...)
    "tagged_extra_keys": (False, True),
    # whether a block hashed after its request was made scans every multimodal item
    # (0.25.1: from the last one), for hashes and events alike
    "mm_keys_by_window": (False, True),
    # (hash seed, hash function) -> the seed of the first block's parent (None: random)
    "none_hash_fixed_seed": (
        lambda seed, fn: seed,
        lambda seed, fn: "vllm-none-hash" if seed is None and fn in (sha256, sha256_cbor)
        else seed),
    # (dcp, pcp) -> how many ranks a scaled group's block spans
    "pcp_not_scaled": (lambda dcp, pcp: dcp * pcp, lambda dcp, pcp: dcp),
    # which specs context parallelism scales, the hybrid check, the one group's refusal
    "dcp_sharded_geometry": (
        Geometry(lambda spec: True, refuse_hybrid_context_parallel, ValueError),
        Geometry(is_dcp_sharded, check_hybrid_context_parallel, AssertionError)),
    # which specs context parallelism scales instead of the geometry's (None: the
    # geometry's): 0.29.0 full attention only, until dcp_sharded_field
    "dcp_full_attention_only": (None, lambda spec: is_a(spec, "FullAttentionSpec")),
    # whether the geometry's own rule is back (0.31.0: the spec's dcp_sharded field)
    "dcp_sharded_field": (False, True),
    # how Mamba frees passed states (see MambaFrees)
    "mamba_frees_processed_states": (
        MambaFrees(lambda computed, spec: max(0, computed - spec), False, False),
        MambaFrees(lambda computed, spec: computed, True, True)),
    # where an 'align' Mamba group keys its prompt-tail state (None: nowhere): 0.26.0
    # at the whole prompt rounded down to the hash block, only inside a block; 0.32.0
    # (which replaces it) at the last boundary a lookup reuses, on block boundaries too
    "mamba_partial_prompt_tail": (None, MambaTail(
        lambda prompt, hash_block, eagle, lookahead:
        max(prompt // hash_block * hash_block - hash_block * eagle, 0), True)),
    "mamba_prompt_tail_state": (None, MambaTail(pure.mamba_prompt_tail_boundary, False)),
    # the engine's use_eagle -> whether Mamba's checkpoints (and tails) drop a hash block
    "mamba_eagle_state_drop": (lambda use_eagle: False, lambda use_eagle: use_eagle),
    # prefill checkpoints (mamba_prefill_checkpoints, 0.30.0): (chunk end, prefill end)
    # -> whether the chunk may take one (0.31.0: only one reaching the prefill end)
    "mamba_checkpoint_at_prefill_end": (lambda end, prefill_end: True,
                                        lambda end, prefill_end: end >= prefill_end),
    # whether the prompt's own checkpoint always keeps its key
    "mamba_prompt_checkpoint_kept": (False, True),
    # the group manager -> the unit a checkpoint's position is rounded to
    "mamba_checkpoint_hit_alignment": (lambda manager: manager.block_pool.hash_block_size,
                                       lambda manager: manager.cache_hit_alignment_tokens),
    # (tokens, unit, EAGLE, lookahead tokens) -> the checkpoint's position: EAGLE drops a
    # unit from all but the last token, then (0.32.0) from the whole
    "mamba_checkpoint_eagle_whole_prompt": (
        lambda n, unit, eagle, lookahead: max((n - 1) // unit * unit - unit, 0) if eagle
        else pure.mamba_prompt_tail_boundary(n, unit, eagle, lookahead),
        pure.mamba_prompt_tail_boundary),
    # whether a running request's checkpoint step moves its speculative blocks forward
    # (before: it takes fresh ones)
    "mamba_checkpoint_relocates_speculative": (False, True),
    # (manager, position, retention interval, before the prompt's end, the prompt's own
    # kept) -> whether a checkpoint is transient (its keys go): under latest-only
    # retention before the prompt's end; 0.32.0: unless the retention mask keeps it
    "mamba_checkpoint_retention_mask": (
        lambda manager, position, retention, before_end, kept:
        retention == 0 and before_end and not kept,
        lambda manager, position, retention, before_end, kept:
        not kept and not manager.checkpoint_retained(position, retention)),
    # (that drop, the group's own eagle bit under it) -> whether the tail drops one
    "mamba_tail_engine_eagle": (lambda engine, group: group, lambda engine, group: engine),
    # the manager, once its groups are bundled (several groups) -> nothing, or hits
    # that end on hash-block boundaries where an 'align' Mamba group needs them
    "mamba_fine_grained_hits": (lambda manager: None,
                                lambda manager: manager.enable_fine_grained_hits()),
    # dcp_world_size -> whether fine-grained hits may be on (before 0.29.0 only without
    # context parallelism)
    "fine_grained_hits_under_dcp": (lambda dcp: dcp == 1, lambda dcp: True),
    # the group manager -> the alignment its cache mask is laid on (before 0.29.0 the
    # scheduler block even where fine-grained hits end on the hash block)
    "cache_mask_hit_alignment": (lambda manager: manager.scheduler_block_size,
                                 lambda manager: manager.cache_hit_alignment_tokens),
    # (tokens a hit or state covers, block size) -> whether its last block, partly
    # covered, is copied before the request writes it
    "partial_hit_copy_on_write": (lambda num_tokens, block_size: False,
                                  lambda num_tokens, block_size: num_tokens % block_size != 0),
    # (group manager, request, tokens) -> nothing, or the prompt's last hash boundary
    # inside a block keyed (full attention's caching step)
    "partial_prompt_tail_entries": (
        lambda manager, request, num_tokens: None,
        lambda manager, request, num_tokens: manager.cache_prompt_tail(request, num_tokens)),
    # the group's use_eagle -> the prompt's tokens past the tail a group keys (0.32.0:
    # the last one, which no lookup reaches, unless EAGLE's)
    "prompt_tail_before_last_token": (lambda use_eagle: 0, lambda use_eagle: int(not use_eagle)),
    # a shared-prefix junction (where a lookup's longest single-kind hit ended) -> the
    # one the release knows, yielded by a lookup and cached like a replay boundary (0:
    # none), wherever it is read
    "shared_prefix_junctions": (lambda junction: 0, lambda junction: junction),
    # (a junction, the block size, EAGLE) -> the boundaries whose tails sparse
    # retention keeps for it: the junction, and (0.33.0) for EAGLE one block lower
    "junction_eagle_tail": (
        lambda junction, block, eagle: [junction],
        lambda junction, block, eagle: [junction, junction - block] if eagle else [junction]),
}


def rules_for(on: Collection[str]) -> ReleaseRules:
    """The value rules of a profile whose switches ``on`` are on: each switch's second
    rule where it is on, its first elsewhere."""
    return ReleaseRules(**{name: pair[name in on] for name, pair in RULES.items()})
