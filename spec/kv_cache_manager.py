"""The request-level KV-cache manager (vLLM 0.25.1's API, blocks as int ids)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from . import effectiveness, pure
from .block_pool import NULL_BLOCK, BlockPool
from .kv_cache_coordinator import KVCacheCoordinator, group_role
from .profile import Profile, resolve_profile
from .pure import cdiv
from .single_type_kv_cache_manager import HISPARSE_RESIDENT, MAMBA
from .vocab import (
    BlockRemoved033,
    BlockStored,
    BlockStored033,
    KVCacheConfig,
    KVCacheEvent,
    PrefixCacheStats,
    PrefixCacheStats033,
    Request,
    event_kind,
    event_sliding_window,
    is_a,
    pool_key,
)

WATERMARKED = ("WAITING", "PREEMPTED")
"""Statuses (by name) whose admission keeps the watermark free."""


@dataclass
class KVCacheBlocks:
    """Block ids per KV-cache group (``blocks[g][i]``), as handed to the scheduler;
    ``block_pool`` lets the unhashed-id queries read the current hashes."""

    blocks: tuple[Sequence[int], ...]
    block_pool: BlockPool | None = field(default=None, compare=False, repr=False)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenate group by group."""
        pairs = zip(self.blocks, other.blocks, strict=False)
        return KVCacheBlocks(tuple(list(itertools.chain(a, b)) for a, b in pairs),
                             self.block_pool or other.block_pool)

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(self, allow_none: Literal[True]) -> tuple[list[int], ...] | None: ...

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Fresh lists of ids per group; None instead of all-empty when ``allow_none``."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple(list(group) for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the only group's uncached blocks (null included); ValueError if not 1 group."""
        if len(self.blocks) != 1:
            raise ValueError(f"get_unhashed_block_ids needs 1 group, got {len(self.blocks)}")
        assert self.block_pool is not None
        return [b for b in self.blocks[0] if b not in self.block_pool.block_hash]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, ids of blocks that are neither cached nor the null block."""
        assert self.block_pool is not None
        hashed = self.block_pool.block_hash
        return [[b for b in g if b not in hashed and b != NULL_BLOCK] for g in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        """An empty instance with as many groups."""
        return KVCacheBlocks(tuple(() for _ in self.blocks), self.block_pool)


class KVCacheManager:
    """Allocates, caches and frees the KV-cache blocks of requests, per vLLM 0.25.1.

    State lives in ``block_pool`` (free queue, ref counts, prefix cache) and in the
    per-group managers of ``coordinator`` (block tables); ``abstract_state`` shows it all.

    Beyond vLLM's arguments, two engine settings vLLM gives its request hasher: the spec
    hashes requests itself with ``caching_hash_algo`` (sha256, sha256_cbor, xxhash,
    xxhash_cbor), the chain seeded by ``hash_seed`` (None: ``PYTHONHASHSEED``). vLLM
    reads the retention interval from its environment; the spec is told it
    (``prefix_cache_retention_interval``, see the coordinator).

    Invariants (``check_invariants``), besides the pool's and the managers':
      - every id in a table or in ``new_block_ids`` is a valid block id (and not 0 in
        ``new_block_ids``);
      - a non-null block is held by one group only (a hit shares it within its group),
        and its ref count is at least the number of table entries holding it; more only
        for blocks from ``pop_blocks_for_free`` the caller has not freed yet.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 scheduler_block_size: int, hash_block_size: int,
                 max_num_batched_tokens: int | None = None, enable_caching: bool = True,
                 use_eagle: bool = False, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, metrics_collector: Any = None,
                 watermark: float = 0.0, *, caching_hash_algo: str = "sha256",
                 hash_seed: str | None = None,
                 prefix_cache_retention_interval: int | None = None,
                 profile: Profile | str | None = None, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0) -> None:
        self.profile = resolve_profile(profile)  # spec/profile.py
        rings = [g for g in kv_cache_config.kv_cache_groups
                 if is_a(g.kv_cache_spec, "CircularBufferSpec")]
        if rings and not self.profile.circular_buffer_groups:
            raise NotImplementedError("a CircularBufferSpec group (a vLLM 0.33.0 kind) under "
                                      f"profile {self.profile.release}")
        for i, g in enumerate(kv_cache_config.kv_cache_groups):  # vLLM 0.33.0's HiSparse
            kind = type(g.kv_cache_spec).__name__
            what = (f"role {group_role(g)!r}" if group_role(g) == "hisparse_source"
                    else kind if kind in ("HiSparseResidentSpec", "HiSparseHotSpec") else None)
            if what and not self.profile.hisparse_groups:
                raise NotImplementedError(f"{what} (group {i}) is not supported under "
                                          f"profile {self.profile.release}: HiSparse is "
                                          "vLLM 0.33.0's")
        for g in kv_cache_config.kv_cache_groups:  # 0.33.0's MambaSpec fields
            blocks = getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0)
            alignment = getattr(g.kv_cache_spec, "prefill_checkpoint_alignment", None)
            if (blocks or alignment is not None) and not self.profile.mamba_prefill_checkpoints:
                raise ValueError(f"num_prefill_checkpoint_blocks={blocks}, prefill_checkpoint_"
                                 f"alignment={alignment}: Mamba prefill checkpoints are vLLM "
                                 f"0.33.0's; profile {self.profile.release} has no such fields")
        # 0.33.0's lookahead hashing and prefill lookahead (0: none; a bool hash
        # lookahead counts as 0 / 1, as vLLM does arithmetic with it).
        for name, value in (("num_hash_lookahead_tokens", num_hash_lookahead_tokens),
                            ("num_prefill_lookahead", num_prefill_lookahead)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        for name, value in (("num_hash_lookahead_tokens", num_hash_lookahead_tokens),
                            ("num_prefill_lookahead", num_prefill_lookahead)):
            if value and not self.profile.lookahead_arguments:
                raise ValueError(f"{name}={value}: lookahead is vLLM 0.33.0's; profile "
                                 f"{self.profile.release} has no such argument")
        if isinstance(num_prefill_lookahead, bool):
            raise ValueError(f"num_prefill_lookahead must be a non-negative int, got "
                             f"{num_prefill_lookahead!r}")
        eagle = use_eagle or any(g.is_eagle_group for g in kv_cache_config.kv_cache_groups)
        if enable_caching and eagle and num_prefill_lookahead > scheduler_block_size:
            raise ValueError(f"num_prefill_lookahead={num_prefill_lookahead} with prefix caching "
                             f"and an EAGLE group needs scheduler_block_size="
                             f"{scheduler_block_size} to be at least as large")
        for name, size in (("dcp_world_size", dcp_world_size), ("pcp_world_size", pcp_world_size)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        if metrics_collector is not None:
            raise NotImplementedError("metrics_collector is not modelled by the spec")
        self.max_model_len = max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = self._new_stats() if log_stats else None
        self.coordinator = KVCacheCoordinator(
            kv_cache_config, max_model_len, self.max_num_batched_tokens, use_eagle,
            enable_caching, enable_kv_cache_events, scheduler_block_size, hash_block_size,
            caching_hash_algo, hash_seed, dcp_world_size, pcp_world_size,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            profile=self.profile, num_hash_lookahead_tokens=int(num_hash_lookahead_tokens),
            num_prefill_lookahead=num_prefill_lookahead)
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        # vLLM 0.33.0: groups whose hits outlive the common hit (the HiSparse source);
        # allocate_slots keeps of theirs what the new hits and external tokens cover.
        self.retained_hit_group_ids = tuple(
            i for i, m in enumerate(self.coordinator.single_type_managers)
            if m.rules.retains_longer_hit)
        self.kv_cache_config = kv_cache_config
        if not watermark >= 0.0:
            raise ValueError(f"watermark must be non-negative, got {watermark!r}")
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (event_kind(g.kv_cache_spec), event_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)), self.block_pool)
        if self.profile.mamba_align_only and enable_caching:
            for m in self.coordinator.single_type_managers:
                if m.rules is MAMBA and m.kv_cache_spec.mamba_cache_mode != "align":
                    mode = m.kv_cache_spec.mamba_cache_mode
                    raise AssertionError(f"mamba_cache_mode={mode!r} with prefix caching on: "
                                         "this release caches Mamba only in 'align'")

    def _new_stats(self) -> PrefixCacheStats:
        """Empty stats, of 0.33.0's class under stats_hits_by_source."""
        stats: PrefixCacheStats = (PrefixCacheStats033() if self.profile.stats_hits_by_source
                                   else PrefixCacheStats())
        return stats

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks in use."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the hit stats gathered so far and start new ones (None unless log_stats)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._new_stats()
        return stats

    def effectiveness_lookup(self, request: Request) -> effectiveness.Lookup | None:
        """The lookup of ``request`` now as ``spec.effectiveness`` judges it: each group's
        resume row and the token boundaries at which the pool holds this request's key
        for it. None for layouts the rows do not cover (HiSparse)."""
        managers = self.coordinator.single_type_managers
        groups = []
        for m in managers:
            kind = m.rules.resume
            if kind is None or len(self.coordinator.pools()) > 1:
                return None
            spec = m.kv_cache_spec
            span = getattr(spec, "sliding_window", None) or getattr(
                spec, "attention_chunk_size", None) or 0
            groups.append(effectiveness.Group(kind, m.block_size, span, m.use_eagle))
        pool, h = self.block_pool, self.block_pool.hash_block_size
        hashes = pool.block_hashes(request)
        fine = getattr(self.coordinator, "fine_grained", False)
        return effectiveness.Lookup(
            groups=tuple(groups),
            cached=tuple(
                frozenset((i + 1) * h for i, digest in enumerate(hashes)
                          if pool_key(digest, g) in pool.cached)
                for g in range(len(managers))),
            num_tokens=request.num_tokens,
            hashed_tokens=len(hashes) * h,
            hash_block=h,
            alignment=h if fine else self.coordinator.scheduler_block_size,
            caching=self.enable_caching,
            skips_reading=request.skip_reading_prefix_cache,
            eagle_step=tuple(h if fine else m.block_size for m in managers),
        )

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's longest cached prefix: its blocks and length in tokens. At most
        ``num_tokens - 1`` tokens hit: the last one is recomputed for its logits."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            self.block_pool.block_hashes(request), request.num_tokens - 1)
        if self.prefix_cache_stats is not None and not self.profile.stats_at_admission:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens,
                                           request.num_preemptions > 0)
        if (self.profile.full_report_mode and num_hit_tokens > 0
                and getattr(request, "kv_cache_report_mode", "incremental") == "full"):
            for group_id, group_hits in enumerate(hits):  # tell subscribers of the hits too
                if group_hits:
                    self.block_pool.emit_cached_block_events(
                        request, len(group_hits),
                        self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.block_size,
                        group_id)
        return self.create_kv_cache_blocks(hits), num_hit_tokens

    def shared_prefix_boundary(self, request: Request, num_hit_tokens: int) -> int:
        """shared_prefix_junctions (0.33.0's third lookup value), right after the
        request's lookup hit ``num_hit_tokens``: where the longest single-kind hit
        ended when it is longer than the common hit, else 0 (always 0 under 0.25.1,
        and for a lookup that did not run)."""
        if (not self.profile.shared_prefix_junctions or not self.enable_caching
                or request.skip_reading_prefix_cache):
            return 0
        uncached = getattr(self.coordinator, "num_uncached_common_prefix_tokens", 0)
        return num_hit_tokens + uncached if uncached else 0

    def get_computed_blocks_for_connector(self, request: Request
                                          ) -> tuple[KVCacheBlocks, int, int, bool]:
        """0.33.0's lookup for a KV connector that takes divergent hybrid hits:
        (blocks, local hit tokens, shared-prefix boundary, hit_diverged).

        In a hybrid layout with a Mamba group whose first spec is full attention each
        spec is looked up alone. A group hitting deeper than the first full-attention
        group means that group lost its tail: then the plain lookup, not diverged.
        Else the full-attention hit is the local hit, with each group's own hits,
        boundary 0, diverged when any group hit less (a Mamba state evicted; a ring
        buffer is never looked up, so always). Any other layout: the plain lookup, not
        diverged. Records nothing (stats come at admission, no "full" report events)."""
        coordinator = self.coordinator
        groups = self.kv_cache_config.kv_cache_groups
        if self.enable_caching and len(groups) > 1 and any(
                is_a(g.kv_cache_spec, "MambaSpec") for g in groups):
            first = coordinator.attention_groups[0]
            if is_a(first.spec, "FullAttentionSpec"):
                if not self.enable_caching or request.skip_reading_prefix_cache:
                    return self.empty_kv_cache_blocks, 0, 0, False
                hits, lengths = coordinator.find_longest_cache_hit_per_group(
                    self.block_pool.block_hashes(request), request.num_tokens - 1)
                num_local = lengths[first.group_ids[0]]
                if max(lengths) <= num_local:  # else full attention lost its tail
                    return self.create_kv_cache_blocks(hits), num_local, 0, min(lengths) < num_local
        blocks, num_hit_tokens = self.get_computed_blocks(request)
        return blocks, num_hit_tokens, self.shared_prefix_boundary(request, num_hit_tokens), False

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """stats_at_admission: the scheduler counts an admitted request's lookup here
        (nothing without log_stats, caching, or for a request that skipped the cache)."""
        if (self.prefix_cache_stats is None or not self.enable_caching
                or request.skip_reading_prefix_cache):
            return
        self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: Sequence[int] = ()) -> KVCacheBlocks | None:
        """Add prefix hits, external tokens and ``num_new_tokens`` (+ lookahead) slots;
        cache the full blocks among the request's known tokens unless ``delay_cache_blocks``.
        The groups in ``skip_zeroing_group_ids`` (0.33.0: an async load writes them)
        report no block for the external tokens for zeroing.

        Returns the new blocks, or None when the free blocks minus ``reserved_blocks`` cannot
        cover them plus the watermark (out-of-window blocks may be freed all the same).
        ValueError if there are no new and no external tokens, or for a skipped group id
        that names no group.
        """
        num_groups = len(self.coordinator.single_type_managers)
        for group_id in skip_zeroing_group_ids:
            if type(group_id) is not int or not 0 <= group_id < num_groups:
                raise ValueError(f"skip_zeroing_group_ids: {group_id!r} is no group id "
                                 f"(there are {num_groups})")
        adopts = num_new_computed_tokens > 0 and self.profile.adopt_computed_without_new_tokens
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and not adopts:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no external computed tokens")
        rid, coordinator = request.request_id, self.coordinator
        hits = (self.empty_kv_cache_blocks if new_computed_blocks is None
                else new_computed_blocks).blocks
        if new_computed_blocks is not None and self.retained_hit_group_ids:
            # NOTE: as in vLLM, a new tuple even for the empty instance: a new request
            # then always adopts (its managers' add_local_computed_blocks run).
            managers, reused = coordinator.single_type_managers, (
                num_new_computed_tokens + num_external_computed_tokens)
            hits = tuple(list(h[:cdiv(reused, managers[g].block_size)])
                         if g in self.retained_hit_group_ids else h
                         for g, h in enumerate(hits))
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_computed = num_local_computed + num_external_computed_tokens
        total_computed = min(num_computed, self.max_model_len)
        watermark_blocks = 0
        if has_scheduled_reqs and request.status.name in WATERMARKED:
            watermark_blocks = self.watermark_blocks
        # Where the prefill ends (for Mamba's prefill checkpoints): the prompt, or, for a
        # resumed request, every token but the last.
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            num_needed = coordinator.get_num_blocks_to_allocate(
                rid, num_full, hits, num_encoder_tokens, total_computed, num_full, True,
                num_local_computed, prefill_end)
            if not pure.admits(num_needed, self.block_pool.get_num_free_blocks(), 0,
                               watermark_blocks):
                return None
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens,
                                   self.max_model_len)
        # Free out-of-window blocks first (even if we then refuse) so fewer get evicted.
        processed = total_computed
        if self.profile.free_on_processed_tokens:  # in-flight steps may still read the rest
            processed = max(0, total_computed - getattr(request, "num_in_flight_tokens", 0))
        coordinator.remove_skipped_blocks(rid, processed, request.num_prompt_tokens)
        num_needed = coordinator.get_num_blocks_to_allocate(
            rid, num_tokens_need_slot, hits, num_encoder_tokens, num_computed,
            num_tokens_main_model, False, num_local_computed, prefill_end)
        if not pure.admits(num_needed, self.block_pool.get_num_free_blocks(), reserved_blocks,
                           watermark_blocks):
            return None
        # NOTE: an identity test, as in vLLM: a distinct empty KVCacheBlocks does add.
        if hits is not self.empty_kv_cache_blocks.blocks or num_external_computed_tokens > 0:
            coordinator.allocate_new_computed_blocks(rid, hits, num_local_computed,
                                                     num_external_computed_tokens,
                                                     skip_zeroing_group_ids)
        new_blocks = coordinator.allocate_new_blocks(rid, num_tokens_need_slot,
                                                     num_tokens_main_model, num_encoder_tokens)
        if self.enable_caching and not delay_cache_blocks:
            # Draft tokens beyond request.num_tokens may be rejected: never cache them.
            coordinator.cache_blocks(request, min(total_computed + num_new_tokens,
                                                  request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first in each group."""
        self.coordinator.free(request.request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks attention no longer reads."""
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[int]:
        """Forget the request; the caller frees the returned ids later, in reverse.
        NotImplementedError with a HiSparse host pool: its ids overlap the shared
        pool's (vLLM's blocks carry their pool, ints do not); pop and free each group's
        blocks through its manager and pool instead."""
        if len(self.coordinator.pools()) > 1:
            raise NotImplementedError("pop_blocks_for_free with a HiSparse host pool: pop and "
                                      "free each group's blocks through its own pool")
        if self.profile.pop_drops_null_head:  # each group's leading null blocks left out
            return [b for m in self.coordinator.single_type_managers
                    for b in drop_null_head(m.pop_blocks_for_free(request.request_id))]
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the given blocks from the prefix cache (see ``BlockPool.evict_blocks``)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (no change) while any block is in use."""
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks of the request held by every request with a table."""
        if self.profile.cascade_always_zero:  # cascade attention is gone: zeros, no lookup
            return [0] * self.num_kv_cache_groups
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the pool's events, labelling each BlockStored with its group's kind."""
        events = self.block_pool.take_events()
        for event in events:
            if (isinstance(event, BlockStored) and event.group_idx is not None
                    and 0 <= event.group_idx < len(self.kv_cache_event_metadata)):
                kind, window = self.kv_cache_event_metadata[event.group_idx]
                event.kv_cache_spec_kind = kind
                event.kv_cache_spec_sliding_window = window
        if self.profile.event_new_fields:  # 0.33.0's classes, the new fields at defaults
            new = {"BlockStored": BlockStored033, "BlockRemoved": BlockRemoved033}
            events = [new[type(e).__name__](**vars(e)) if type(e).__name__ in new else e
                      for e in events]
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks (live tables, as vLLM shares them)."""
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Copies of the request's block tables."""
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        """Per group, the blocks covering the first ``num_computed_tokens`` tokens
        (whole tables for Mamba and cross attention, whose blocks are not per token)."""
        clipped = []
        groups, tables = self.kv_cache_config.kv_cache_groups, self.get_block_ids(request_id)
        for g, ids in zip(groups, tables, strict=False):
            s = g.kv_cache_spec
            per_token = is_a(s, "AttentionSpec") and not is_a(s, "CrossAttentionSpec")
            clipped.append(ids[:cdiv(num_computed_tokens, s.block_size)] if per_token else ids)
        return tuple(clipped)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks among its first tokens (if caching is on)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[list[int], ...]) -> KVCacheBlocks:
        """Wrap per-group ids; the shared empty instance when all groups are empty."""
        return KVCacheBlocks(blocks, self.block_pool) if any(blocks) else self.empty_kv_cache_blocks

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Report the request's blocks from ``start_token`` on for zeroing again, in the
        groups that report new blocks (0.33.0: blocks a failed async load left
        unwritten). ValueError unless ``start_token`` is a multiple of each such group's
        block size (zeroing a block's valid prefix would lose it)."""
        managers = [m for m in self.coordinator.single_type_managers if m.reports_new_blocks()]
        for m in managers:
            if start_token % m.block_size:
                raise ValueError(f"start_token={start_token} is not a multiple of group "
                                 f"{m.kv_cache_group_id}'s block size {m.block_size}")
        for m in managers:
            m.new_block_ids += m.req_to_blocks.get(request_id, [])[start_token // m.block_size:]

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids allocated since the last call, group after group."""
        return [b for m in self.coordinator.single_type_managers for b in m.take_new_block_ids()]

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Drain the copy-on-write copies queued since the last call, group after group:
        the (source, copy) id pairs, and the blocks they keep held (source then copy per
        pair), which the caller frees once the copies have run (0.33.0's scheduler)."""
        pairs = [p for m in self.coordinator.single_type_managers
                 for p in m.take_pending_cow_copies()]
        return pairs, [block for pair in pairs for block in pair]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain the Mamba 'align' states offered to a KV connector since the last call
        (0.33.0, ``mamba_prefill_checkpoints``): per request, (group, block, tokens the
        state covers), group after group, in the order they were cached."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for m in self.coordinator.single_type_managers:
            for rid, group, block, num_tokens in m.take_boundary_state_offers():
                offloads.setdefault(rid, []).append((group, block, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing request's own prompt-tail states inside a block that no later
        token was written into, (group, block, tokens) per Mamba group, each once."""
        in_flight = getattr(request, "num_in_flight_tokens", 0) or 0
        tails = [m.finalize_partial_tail(request.request_id, request.num_computed_tokens,
                                         in_flight)
                 for m in self.coordinator.single_type_managers]
        return [tail for tail in tails if tail is not None]

    def new_step_starts(self) -> None:
        """Tell the managers a scheduler step begins."""
        self.coordinator.new_step_starts()

    def abstract_state(self) -> dict[str, Any]:
        """The whole state as plain data, in the format of docs/contract.md."""
        pool, managers = self.block_pool, self.coordinator.single_type_managers
        return {
            "num_blocks": pool.num_gpu_blocks,
            "free_queue": list(pool.free_queue),
            "ref_cnt": {b: c for b, c in enumerate(pool.ref_cnt) if b != NULL_BLOCK and c != 0},
            "block_hash": dict(pool.block_hash),
            "cached": {key: list(ids) for key, ids in pool.cached.items()},
            "req_to_blocks": [{r: list(ids) for r, ids in m.req_to_blocks.items()}
                              for m in managers],
            "num_cached_block": [dict(m.num_cached_block) for m in managers],
            "new_block_ids": [list(m.new_block_ids) for m in managers],
        }

    def check_invariants(self) -> None:
        """Assert the invariants of the class docstring."""
        for pool in self.coordinator.pools():
            pool.check_invariants()
            holders: Counter[int] = Counter()
            group_of: dict[int, int] = {}
            for g, m in enumerate(self.coordinator.single_type_managers):
                if m.block_pool is not pool:
                    continue
                m.check_invariants()
                if m.rules is HISPARSE_RESIDENT:
                    continue  # its table may name blocks reused since (see the class)
                assert all(0 < b < pool.num_gpu_blocks for b in m.new_block_ids)
                for ids in m.req_to_blocks.values():
                    assert all(0 <= b < pool.num_gpu_blocks for b in ids)
                    for b in ids:
                        if b != NULL_BLOCK:
                            assert group_of.setdefault(b, g) == g, f"block {b} in two groups"
                            holders[b] += 1
            for b, count in holders.items():
                assert pool.ref_cnt[b] >= count, f"block {b}: ref_cnt {pool.ref_cnt[b]} < {count}"


def drop_null_head(ids: list[int]) -> list[int]:
    """``ids`` without its leading null blocks."""
    return list(itertools.dropwhile(lambda b: b == NULL_BLOCK, ids))
