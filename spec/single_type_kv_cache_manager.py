"""Per-group managers: the bookkeeping of the base class, one subclass per group kind."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import pure
from .block_pool import NULL_BLOCK, BlockPool
from .profile import Profile
from .pure import cdiv
from .vocab import MEDIUM_CPU, KVCacheSpec, Request, admission_cap, cacheable, is_a

ZEROED_SPECS = ("FullAttentionSpec", "TQFullAttentionSpec", "MLAAttentionSpec",
                "HiddenStateCacheSpec")
"""Spec classes (exact) whose fresh blocks are reported by ``take_new_block_ids``."""

Hits = tuple[list[int], ...]
"""Per group of a lookup, the hit block ids (NULL_BLOCK where skipped)."""


def records_new_block_ids(kv_cache_spec: KVCacheSpec, profile: Profile,
                          needs_kv_cache_zeroing: bool) -> bool:
    """Whether a group reports its fresh blocks for zeroing: full attention and MLA
    (exact classes, as vLLM tests them), or, under ``zero_every_attention_group`` in a
    layout that zeroes, every attention kind but a ring buffer; under
    ``new_block_ids_zeroing_only`` none where the layout needs no zeroing."""
    if profile.new_block_ids_zeroing_only and not needs_kv_cache_zeroing:
        return False
    return type(kv_cache_spec).__name__ in ZEROED_SPECS or (
        profile.zero_every_attention_group and needs_kv_cache_zeroing
        and is_a(kv_cache_spec, "AttentionSpec") and not is_a(kv_cache_spec, "CircularBufferSpec"))


def check_no_hits(request_id: str, new_computed_blocks: Sequence[int]) -> None:
    """A running request gets no new hits (vLLM asserts it)."""
    if len(new_computed_blocks):
        raise ValueError(f"request_id={request_id!r} is running: new_computed_blocks "
                         f"must be empty, got {list(new_computed_blocks)}")


class CachedInAllGroups:
    """The hashes cached in every one of ``group_ids``: the ``cached`` of the searches."""

    def __init__(self, pool: BlockPool, group_ids: list[int]) -> None:
        self.pool = pool
        self.group_ids = group_ids

    def __contains__(self, block_hash: Any) -> bool:
        return self.pool.get_cached_block(block_hash, self.group_ids) is not None


def hit_blocks(block_hashes: Sequence[bytes], first: int, num_blocks: int,
               group_ids: list[int], pool: BlockPool) -> Hits:
    """Per group, NULL_BLOCK before ``first``, then the blocks cached under the hashes
    of ``[first, num_blocks)`` (which a search found cached)."""
    hits = tuple([NULL_BLOCK] * first for _ in group_ids)
    for block_hash in block_hashes[first:num_blocks]:
        cached_ids = pool.get_cached_block(block_hash, group_ids)
        assert cached_ids is not None
        for group_hits, block_id in zip(hits, cached_ids, strict=True):
            group_hits.append(block_id)
    return hits


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group.

    ``req_to_blocks[r][i]`` holds tokens ``[i*block_size, (i+1)*block_size)`` of request
    r, NULL_BLOCK where attention skips them. vLLM keeps the tables in a defaultdict,
    so some reads create an empty entry (``_blocks_of``). ``num_cached_block[r]``
    counts r's leading blocks already cached; having one marks r as running.
    ``new_block_ids`` collects fresh full-attention ids until taken.

    Invariants (``check_invariants``): no table holds a block twice; NULL_BLOCK entries
    are a prefix of each table (skipped positions; Mamba's align mode also nulls
    blocks further in); every cached-block count belongs to a table.
    """

    # vLLM 0.33.0: a group whose hit outlives the hybrid hit (the HiSparse source):
    # the coordinator's trims leave it, allocate_slots cuts it to what it adopts.
    retains_longer_hit = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, scheduler_block_size: int,
                 max_admission_blocks_per_request: int | None = None,
                 context_parallel: int = 1, *, profile: Profile | None = None,
                 needs_kv_cache_zeroing: bool = False, use_eagle: bool = False) -> None:
        # The release whose switches this group reads, under their own names: by
        # default its pool's. ``needs_kv_cache_zeroing``: the layout's (0.33.0's
        # zeroing switches); ``use_eagle``: the engine's flag (Mamba's prompt tail).
        self.profile = block_pool.profile if profile is None else profile
        self.kv_cache_spec = kv_cache_spec
        # Context parallelism (dcp * pcp ranks) spreads a block's tokens over the ranks.
        self.block_size = kv_cache_spec.block_size * context_parallel
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.use_eagle = False  # set by the coordinator
        # Where hits end: the hash block under mamba_fine_grained_hits (the coordinator).
        self.cache_hit_alignment_tokens = scheduler_block_size
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.new_block_ids: list[int] = []
        self.records_new_block_ids = records_new_block_ids(kv_cache_spec, self.profile,
                                                           needs_kv_cache_zeroing)
        # partial_hit_copy_on_write: per request, (index, block) of a hit block to copy at the
        # next allocation; the (source, copy) pairs queued for the worker.
        self.partial_hit_reqs: dict[str, tuple[int, int]] = {}
        self.pending_copies: list[tuple[int, int]] = []

    def _blocks_of(self, request_id: str) -> list[int]:
        """The request's table, created empty if unknown (vLLM's defaultdict read)."""
        return self.req_to_blocks.setdefault(request_id, [])

    def _ends_inside_block(self, hits: Sequence[int], num_local_computed_tokens: int) -> bool:
        """Under ``partial_hit_copy_on_write``: whether a hit ends inside its last block."""
        return (self.profile.partial_hit_copy_on_write and len(hits) > 0
                and num_local_computed_tokens % self.block_size != 0)

    def _num_evictable(self, blocks: Sequence[int]) -> int:
        """Blocks that touching them takes out of the free queue."""
        return sum(self.block_pool.ref_cnt[b] == 0 and b != NULL_BLOCK for b in blocks)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """Free blocks needed to give the request ``num_tokens`` slots and take its hits
        (one more for the copy of a hit ending inside a block, ``partial_hit_copy_on_write``;
        ``num_local_computed_tokens``: computed plus hit tokens; ``prefill_end``: read by
        Mamba's prefill checkpoints only)."""
        num_required = pure.num_required_blocks(
            num_tokens, self.block_size,
            self.max_admission_blocks_per_request if apply_admission_cap else None)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            check_no_hits(request_id, new_computed_blocks)
            return pure.num_new_blocks(num_required, num_held, 0, 0, True)
        num_skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = pure.num_new_blocks(num_required, num_held, len(new_computed_blocks),
                                      num_skipped, False)
        if self._ends_inside_block(new_computed_blocks, num_local_computed_tokens):
            num_new += 1
        return num_new + self._num_evictable(
            new_computed_blocks[pure.num_skipped_hits(num_skipped, num_held):])

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[int],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Give a request without blocks its hits (touched), nulls where skipped."""
        req_blocks = self._blocks_of(request_id)
        if req_blocks:
            raise ValueError(f"request_id={request_id!r} already holds blocks {req_blocks}; "
                             "computed blocks only go to a request without blocks")
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(num_total) // self.block_size
        if num_skipped > 0:
            new_computed_blocks = new_computed_blocks[num_skipped:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"new_computed_blocks={list(new_computed_blocks)} with caching off")
        req_blocks.extend([NULL_BLOCK] * num_skipped)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        if self._ends_inside_block(new_computed_blocks, num_local_computed_tokens):
            # The last hit block is copied at the next allocation; the copy is cached anew.
            index = num_local_computed_tokens // self.block_size
            self.partial_hit_reqs[request_id] = (index, new_computed_blocks[-1])
            self.num_cached_block[request_id] = index

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Allocate blocks for the tokens a KV connector computed, unless skipped; an
        async load that writes them (not ``record_for_zeroing``) needs no zeroing."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(num_total - num_skipped_tokens,
                                               num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            req_blocks = self._blocks_of(request_id)
            num_new = cdiv(num_total, self.block_size) - len(req_blocks)
            if self.profile.external_blocks_floor_zero:  # it may hold more already (draft slots)
                num_new = max(num_new, 0)
            self._append_new(req_blocks, num_new, record_for_zeroing)

    def reports_new_blocks(self) -> bool:
        """Whether this group reports its fresh blocks for zeroing (``records_new_block_ids``)."""
        return self.records_new_block_ids

    def _append_new(self, req_blocks: list[int], num_blocks: int,
                    record_for_zeroing: bool = True) -> list[int]:
        """Append ``num_blocks`` fresh blocks, reported for zeroing where the group
        reports them (``reports_new_blocks``) unless an async load writes them."""
        new_ids = self.block_pool.get_new_blocks(num_blocks)
        req_blocks.extend(new_ids)
        if record_for_zeroing and self.reports_new_blocks():
            self.new_block_ids.extend(new_ids)
        return new_ids

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int
                            ) -> list[int]:
        """Append fresh blocks until the request has ``num_tokens`` slots; return them. A
        pending partial hit first gets its copy (returned first, recorded for zeroing)."""
        copies = []
        if request_id in self.partial_hit_reqs:
            index, source = self.partial_hit_reqs.pop(request_id)
            copies = self.block_pool.get_new_blocks(1)
            self._copy_hit_block(request_id, index, source, copies[0])
            self.new_block_ids.extend(copies)
        req_blocks = self._blocks_of(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        return copies + (self._append_new(req_blocks, num_new) if num_new > 0 else [])

    def _copy_hit_block(self, request_id: str, index: int, source: int, copy: int) -> None:
        """Put ``copy`` in place of hit block ``source`` and queue the copy. Until the
        caller takes the copies both stay held: ``source`` by the request's hit
        reference, ``copy`` by one more."""
        req_blocks = self._blocks_of(request_id)
        assert req_blocks[index] == source
        req_blocks[index] = copy
        self.pending_copies.append((source, copy))
        self.block_pool.ref_cnt[copy] += 1

    def take_pending_cow_copies(self) -> list[tuple[int, int]]:
        """Drain the (source, copy) pairs queued since the last call."""
        pending, self.pending_copies = self.pending_copies, []
        return pending

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids allocated since the last call."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens (those
        the group's mask keeps, for the coordinator's ``retention_interval`` and replay
        ``boundaries``; None: one token short of the prompt). With
        ``shared_prefix_junctions`` the request's ``shared_prefix_boundary`` is a
        boundary too (and one block below it for an EAGLE group)."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        if self.profile.cache_within_hashed_tokens:  # only blocks the request has hashes for
            hbs = self.block_pool.hash_block_size
            num_tokens = min(num_tokens, len(self.block_pool.block_hashes(request)) * hbs)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        kept = [request.num_prompt_tokens - 1] if boundaries is None else list(boundaries)
        junction = getattr(request, "shared_prefix_boundary", 0)
        if self.profile.shared_prefix_junctions and junction:
            kept += [junction, junction - self.block_size] if self.use_eagle else [junction]
        mask = self.reachable_block_mask(num_cached, num_full, retention_interval, kept)
        self.block_pool.cache_full_blocks(request, self._blocks_of(rid), num_cached, num_full,
                                          self.block_size, self.kv_cache_group_id, mask)
        self.num_cached_block[rid] = num_full

    def reachable_block_mask(self, start_block: int, end_block: int,
                             retention_interval: int | None = None,
                             boundaries: Sequence[int] = ()) -> list[bool] | None:
        """Which of the blocks to cache a hit can ever use (None: all). A retention
        interval (not None) thins them out further, keeping what a replay resuming at
        one of ``boundaries`` reads: see the windowed kinds."""
        return None

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forget the request; return its blocks in allocation order, still referenced."""
        self.num_cached_block.pop(request_id, None)
        self.partial_hit_reqs.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first, so tails are evicted before heads."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks shared by every request (0: only full attention shares)."""
        return 0

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                               drop_eagle_block: bool, alignment_tokens: int) -> Hits:
        """Per group, the longest hit of at most ``max_length`` tokens cached in all groups,
        a multiple of ``alignment_tokens``; EAGLE drops its last block."""
        raise NotImplementedError(f"{cls.__name__} does not support prefix caching")

    @classmethod
    def find_fine_grained_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                              group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                              drop_eagle_block: bool, hash_block_size: int
                              ) -> tuple[Hits, int]:
        """A hit that may end inside a block, and its length: full attention and Mamba."""
        raise NotImplementedError(f"{cls.__name__} finds no hits inside a block")

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks attention no longer reads, tail first, leaving nulls."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self._blocks_of(request_id)
        # The scan stops at a null: the rest was nulled by an earlier call.
        start, stop = pure.skipped_blocks_to_free(blocks, NULL_BLOCK,
                                                  num_skipped_tokens // self.block_size)
        freed = blocks[start:stop][::-1]
        blocks[start:stop] = [NULL_BLOCK] * (stop - start)
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no longer read once ``num_computed_tokens`` are computed."""
        return pure.num_skipped_tokens_full_attention(num_computed_tokens)

    def new_step_starts(self) -> None:
        """Hook run once per scheduler step."""

    def check_invariants(self, nulls_only_leading: bool = True) -> None:
        """Assert the invariants of the class docstring."""
        assert set(self.num_cached_block) <= set(self.req_to_blocks)
        for rid, ids in self.req_to_blocks.items():
            held = [b for b in ids if b != NULL_BLOCK]
            assert len(set(held)) == len(held), f"{rid!r} holds a block twice: {ids}"
            num_leading_nulls = next((i for i, b in enumerate(ids) if b != NULL_BLOCK), len(ids))
            assert not nulls_only_leading or len(held) == len(ids) - num_leading_nulls, (
                f"{rid!r} has a null block after a live one: {ids}")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept until the request ends."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                               drop_eagle_block: bool, alignment_tokens: int) -> Hits:
        """Walk the hash chain left to right up to the first miss."""
        max_num_blocks = max_length // kv_cache_spec.block_size
        block_hashes = block_hashes[:max_num_blocks]
        num_blocks = pure.full_attention_hit_num_blocks(
            block_hashes, CachedInAllGroups(pool, group_ids), max_num_blocks, drop_eagle_block,
            kv_cache_spec.block_size, alignment_tokens)
        return hit_blocks(block_hashes, 0, num_blocks, group_ids, pool)

    @classmethod
    def find_fine_grained_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                              group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                              drop_eagle_block: bool, hash_block_size: int
                              ) -> tuple[Hits, int]:
        """With mamba_fine_grained_hits (blocks larger than the hash block): the leading
        cached blocks, then the longest cached hash-block prefix inside the next block;
        EAGLE drops one hash block. ``block_hashes`` are per hash block. Returns the
        hits and their length in tokens."""
        scale = kv_cache_spec.block_size // hash_block_size
        ends = [(i + 1) * scale - 1 for i in range(max_length // kv_cache_spec.block_size)]
        num_blocks = 0
        while num_blocks < len(ends) and ends[num_blocks] < len(block_hashes) and (
                pool.get_cached_block(block_hashes[ends[num_blocks]], group_ids) is not None):
            num_blocks += 1
        hit_ends = ends[:num_blocks]
        length = num_blocks * kv_cache_spec.block_size
        first = num_blocks * scale
        for i in reversed(range(first, min(first + scale - 1, max_length // hash_block_size,
                                           len(block_hashes)))):
            if pool.get_cached_block(block_hashes[i], group_ids) is not None:
                hit_ends.append(i)
                length = (i + 1) * hash_block_size
                break
        if drop_eagle_block and length > 0:
            length -= hash_block_size
        hit_ends = hit_ends[:cdiv(length, kv_cache_spec.block_size)]
        return hit_blocks([block_hashes[i] for i in hit_ends], 0, len(hit_ends), group_ids,
                          pool), length

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Cache the full blocks; with partial_prompt_tail_entries (0.33.0), also the block
        holding the prompt's last reachable hash boundary, as a partial entry: the
        boundary of ``num_prompt_tokens - 1`` tokens (the whole prompt for EAGLE), when
        it falls inside a block and within ``num_tokens``."""
        super().cache_blocks(request, num_tokens, retention_interval, boundaries)
        hbs = self.block_pool.hash_block_size
        if not self.profile.partial_prompt_tail_entries or self.block_size == hbs:
            return
        limit = request.num_prompt_tokens - (0 if self.use_eagle else 1)
        boundary = min(limit // hbs, len(self.block_pool.block_hashes(request))) * hbs
        blocks = self._blocks_of(request.request_id)
        if (0 < boundary <= num_tokens and boundary % self.block_size
                and boundary // self.block_size < len(blocks)):
            self.block_pool.cache_partial_block(request, blocks[boundary // self.block_size],
                                                boundary, self.kv_cache_group_id, self.block_size)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks whose ref count equals the number of tables (empty ones count)."""
        blocks = self._blocks_of(running_request_id)  # may add a table: count them after
        num_tables = len(self.req_to_blocks)
        return next((i for i, b in enumerate(blocks) if self.block_pool.ref_cnt[b] != num_tables),
                    len(blocks))


class CircularBufferManager(FullAttentionManager):
    """A ring buffer (vLLM 0.33.0's ``CircularBufferSpec``): one block per request, taken
    at its first allocation (or external load) and kept until it is freed; never a hit,
    never cached, never recorded for zeroing."""

    def _claim_ring_block(self, request_id: str) -> list[int]:
        req_blocks = self._blocks_of(request_id)
        if req_blocks:
            return []
        new_ids = self.block_pool.get_new_blocks(1)
        req_blocks.extend(new_ids)
        return new_ids

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """1 until the request holds its ring block, then 0."""
        return 0 if self.req_to_blocks.get(request_id) else 1

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[int],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Nothing: a ring has no hits."""

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """The ring block, for a request a KV connector loads."""
        self._claim_ring_block(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int
                            ) -> list[int]:
        """The ring block on the first allocation; nothing afterwards."""
        return self._claim_ring_block(request_id)

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Nothing: a ring block is never cached."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                               drop_eagle_block: bool, alignment_tokens: int) -> Hits:
        """No hit."""
        return tuple([] for _ in group_ids)


class RSWAManager(FullAttentionManager):
    """Reference sliding window (R-SWA): full attention, except that the blocks wholly
    between the prompt's last block and the decode window (the last ``rswa_window``
    computed tokens) are freed and nulled once passed. Only ``remove_skipped_blocks``
    differs, and only when it is given the prompt length; tables get nulls in the
    middle, after the prompt's blocks."""

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the gap's live blocks tail first, leaving nulls; an unknown request or a
        missing prompt length frees nothing (and adds no table)."""
        if num_prompt_tokens is None or request_id not in self.req_to_blocks:
            return
        blocks = self.req_to_blocks[request_id]
        first, last = pure.rswa_gap_blocks(num_prompt_tokens, total_computed_tokens,
                                           self.kv_cache_spec.rswa_window, self.block_size)
        # The scan stops at a null: the rest of the gap was nulled by an earlier call.
        start, stop = pure.gap_blocks_to_free(blocks, NULL_BLOCK, first, last)
        freed = blocks[start:stop][::-1]
        blocks[start:stop] = [NULL_BLOCK] * (stop - start)
        if freed:
            self.block_pool.free_blocks(freed)

    def check_invariants(self, nulls_only_leading: bool = True) -> None:
        """As the base class; the gap's nulls sit after the prompt's blocks."""
        super().check_invariants(False)


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with sink tokens: on construction ``sink_len // block_size`` blocks
    leave the front of the free queue for good (``sink_blocks``, ref count 0, counted
    as used); otherwise full attention.

    Built as vLLM 0.25.1 builds it: the arguments after the group id are
    ``dcp_world_size`` and ``pcp_world_size``, and the base class gets them as its
    ``scheduler_block_size`` and its context-parallel size;
    ``get_manager_for_kv_cache_spec`` cannot build it.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, dcp_world_size: int = 1, pcp_world_size: int = 1,
                 **switches: Any) -> None:
        # vLLM's base class takes dcp_world_size as scheduler_block_size and
        # pcp_world_size as its dcp_world_size: only the latter scales the block.
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id,
                         dcp_world_size, None, pcp_world_size, **switches)
        sink_len = kv_cache_spec.sink_len
        if not isinstance(sink_len, int) or sink_len <= 0 or sink_len % self.block_size:
            raise ValueError(f"sink_len={sink_len!r} must be a positive multiple of "
                             f"block_size={self.block_size}")
        num_sink_blocks = sink_len // self.block_size
        if num_sink_blocks > len(block_pool.free_queue):
            raise ValueError(f"sink_len={sink_len} needs {num_sink_blocks} free blocks, "
                             f"the pool has {len(block_pool.free_queue)}")
        self.sink_blocks = block_pool.free_queue[:num_sink_blocks]
        del block_pool.free_queue[:num_sink_blocks]


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: a token reads the ``sliding_window`` tokens ending at itself."""

    @staticmethod
    def _num_blocks_for_hit(kv_cache_spec: KVCacheSpec, use_eagle: bool) -> int:
        """Contiguous hits a window needs; EAGLE matches one more and drops it."""
        return pure.num_contiguous_blocks_for_hit(kv_cache_spec.sliding_window,
                                                  kv_cache_spec.block_size, use_eagle)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                               drop_eagle_block: bool, alignment_tokens: int) -> Hits:
        """Scan right to left for the last run of hits that fills a window and ends where
        an aligned hit can; a shorter run starting at block 0 also counts. Blocks before
        the run are null."""
        max_num_blocks = max_length // kv_cache_spec.block_size
        block_hashes = block_hashes[:max_num_blocks]
        first, num_blocks = pure.sliding_window_hit_range(
            block_hashes, CachedInAllGroups(pool, group_ids), max_num_blocks,
            cls._num_blocks_for_hit(kv_cache_spec, drop_eagle_block), drop_eagle_block,
            kv_cache_spec.block_size, alignment_tokens)
        return hit_blocks(block_hashes, first, num_blocks, group_ids, pool)

    def reachable_block_mask(self, start_block: int, end_block: int,
                             retention_interval: int | None = None,
                             boundaries: Sequence[int] = ()) -> list[bool] | None:
        """Only the window's blocks before each ``scheduler_block_size`` boundary (shifted by
        one block with EAGLE) can serve a hit; None when that is every block. With a
        retention interval: before each ``retention_interval`` boundary instead (none
        for 0), and before each of the replay ``boundaries``."""
        num_needed = self._num_blocks_for_hit(self.kv_cache_spec, self.use_eagle)
        if retention_interval is not None:
            return pure.sliding_window_retention_mask(
                start_block, end_block, num_needed, self.block_size,
                self.cache_hit_alignment_tokens, retention_interval, boundaries, self.use_eagle)
        return pure.sliding_window_reachable_mask(
            start_block, end_block, num_needed,
            self.cache_hit_alignment_tokens // self.block_size, self.use_eagle)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token."""
        return pure.num_skipped_tokens_sliding_window(num_computed_tokens,
                                                      self.kv_cache_spec.sliding_window)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: a token reads only its own ``attention_chunk_size`` chunk."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                               drop_eagle_block: bool, alignment_tokens: int) -> Hits:
        """Blocks before the chunk of token ``max_length`` hit as nulls; the chunk's own
        blocks are matched left to right."""
        block_size, chunk_size = kv_cache_spec.block_size, kv_cache_spec.attention_chunk_size
        if drop_eagle_block or block_size != alignment_tokens:
            raise NotImplementedError("chunked local attention hits need no EAGLE drop and "
                                      f"block_size={block_size} == alignment {alignment_tokens}")
        block_hashes = block_hashes[:max(max_length, 0) // block_size]
        first, num_blocks = pure.chunked_local_hit_range(
            block_hashes, CachedInAllGroups(pool, group_ids), max_length, chunk_size, block_size)
        return hit_blocks(block_hashes, first, num_blocks, group_ids, pool)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the next token's chunk."""
        return pure.num_skipped_tokens_chunked_local(num_computed_tokens,
                                                     self.kv_cache_spec.attention_chunk_size)


class MambaManager(SingleTypeKVCacheManager):
    """Mamba: a request needs only the state after its last computed token.

    Modes "none"/"all": a block per ``block_size`` tokens plus ``num_speculative_blocks``,
    older states freed as the request advances. Mode "align": only the running state
    block (+ speculative blocks) is allocated, nulls before it; ``last_state_block_idx[r]``
    is the state block of r's previous step, freed once passed, and
    ``_allocated_block_reqs`` the requests given blocks already.
    ``cached_blocks_this_step`` holds pool keys cached this step: their states may not be
    written yet, so a hit on one is refused until ``new_step_starts``.

    Prefill checkpoints (``mamba_prefill_checkpoints``, 0.33.0, align mode, a layer with
    ``num_prefill_checkpoint_blocks`` > 0): a prefill chunk may also leave the state at a
    reusable position inside it in a block of its own, the one before the chunk's last
    block. ``checkpoints[r]`` is r's (position, block index) for the chunk being
    allocated; ``cache_blocks`` keys that block at the position, or unkeys it.

    Boundary-state offloads (``offers_boundary_states``: the same switch, align mode):
    each state block ``cache_blocks`` leaves keyed among the blocks it caches is offered
    to a KV connector, ``offers`` (request, group, block, tokens its key covers) until
    ``take_boundary_state_offers``; a request's own prompt-tail state inside a block is
    remembered in ``producer_tails[r]`` (block, tokens) and offered when it moves to its
    copy, or at the request's end (``finalize_partial_tail``). Freeing a request drops
    its offers (its blocks may go to another request).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self.cached_blocks_this_step: set[bytes] = set()
        self.last_state_block_idx: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()
        self.num_retired_blocks: dict[str, int] = {}  # align, mamba_frees_processed_states
        p, align = self.profile, self.mamba_cache_mode == "align"
        # mamba_prompt_tail_state with the engine's use_eagle: the tail drops a block
        self.prompt_tail_drops_eagle = p.mamba_prompt_tail_state and kwargs.get("use_eagle", False)
        self.has_checkpoint_blocks = (p.mamba_prefill_checkpoints and align and getattr(
            kv_cache_spec, "num_prefill_checkpoint_blocks", 0) > 0)
        self.checkpoint_alignment: int | None = getattr(
            kv_cache_spec, "prefill_checkpoint_alignment", None)
        self.checkpoints: dict[str, tuple[int, int]] = {}
        self.offers_boundary_states = p.mamba_prefill_checkpoints and align
        self.offers: list[tuple[str, int, int, int]] = []
        self.producer_tails: dict[str, tuple[int, int]] = {}

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                               drop_eagle_block: bool, alignment_tokens: int) -> Hits:
        """The last cached state ending on an aligned boundary, nulls before it (no EAGLE
        drop: draft models have no Mamba layers)."""
        max_num_blocks = max_length // kv_cache_spec.block_size
        block_hashes = block_hashes[:max_num_blocks]
        num_blocks = pure.mamba_hit_num_blocks(
            block_hashes, CachedInAllGroups(pool, group_ids), max_num_blocks,
            kv_cache_spec.block_size, alignment_tokens)
        return hit_blocks(block_hashes, max(num_blocks - 1, 0), num_blocks, group_ids, pool)

    @classmethod
    def find_fine_grained_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                              group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                              drop_eagle_block: bool, hash_block_size: int
                              ) -> tuple[Hits, int]:
        """With mamba_fine_grained_hits: the last state cached at any hash boundary within
        ``max_length``, nulls before its block (``block_hashes`` per hash block)."""
        for i in reversed(range(min(max_length // hash_block_size, len(block_hashes)))):
            hits = pool.get_cached_block(block_hashes[i], group_ids)
            if hits is not None:
                nulls = [NULL_BLOCK] * (i // (kv_cache_spec.block_size // hash_block_size))
                return tuple([*nulls, b] for b in hits), (i + 1) * hash_block_size
        return tuple([] for _ in group_ids), 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """As the base class, plus speculative blocks. A hit on a state cached this step
        needs ``num_gpu_blocks + 1`` blocks: more than can be free, so it waits a step.
        In align mode a state ending inside its block (a hit there, or the request's own
        prompt-tail entry; ``partial_hit_copy_on_write``) needs one block more, its copy, and so
        does a prefill checkpoint (``checkpoint_position``), which a call other than the
        admission estimate (``apply_admission_cap``) records for the allocation."""
        if (len(new_computed_blocks) and self.block_pool.block_hash.get(new_computed_blocks[-1])
                in self.cached_blocks_this_step):
            return self.block_pool.num_gpu_blocks + 1
        if self.mamba_cache_mode != "align":
            # vLLM counts these tokens in the layer's block size, not the manager's (they
            # differ under context parallelism): then it takes more than it counts.
            num_tokens += self.kv_cache_spec.block_size * self.num_speculative_blocks
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                num_tokens_main_model, apply_admission_cap, num_local_computed_tokens)
        # Align mode ignores lookahead tokens (they would break the alignment).
        num_new = pure.mamba_align_num_new_blocks(
            num_tokens_main_model, self.block_size, self.num_speculative_blocks,
            len(new_computed_blocks), len(self._blocks_of(request_id)),
            request_id in self._allocated_block_reqs)
        position = self.checkpoint_position(request_id, total_computed_tokens,
                                            num_tokens_main_model, prefill_end)
        checkpoint = 1 if position > 0 else 0
        if not apply_admission_cap:
            if checkpoint:
                index = cdiv(num_tokens_main_model, self.block_size) - 2
                self.checkpoints[request_id] = (position, index)
            else:
                self.checkpoints.pop(request_id, None)
        num_held = len(self._blocks_of(request_id))
        shortfall = (cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
                     - len(new_computed_blocks) - num_held)
        if self.profile.mamba_caps_new_state_blocks and num_new > 0:  # the shortfall, capped
            num_new = min(num_new + checkpoint, shortfall)
        if request_id in self.partial_hit_reqs or self._ends_inside_block(
                new_computed_blocks, num_local_computed_tokens):
            cap = 2 if request_id in self._allocated_block_reqs else 2 + self.num_speculative_blocks
            num_new = min(max(shortfall, 0) + 1, cap + checkpoint)
        return num_new + self._num_evictable(new_computed_blocks)

    def checkpoint_position(self, request_id: str, start: int, end: int, prefill_end: int
                            ) -> int:
        """Where the chunk computing tokens ``[start, end)`` leaves a prefill checkpoint;
        0 for none. The position is the last reusable hash boundary before the chunk's
        end (``pure.mamba_prompt_tail_boundary`` of ``end``). There is one only with
        checkpoint blocks, for a chunk reaching ``prefill_end`` (the coordinator passes
        0 unless retention keeps only the latest state), at a position the layer can
        export (``pure.mamba_checkpoint_exportable``), into a column (the block before
        the chunk's last) that is free for it: not yet in the table, null, or, for a
        request given blocks already, one of its speculative blocks."""
        if not self.has_checkpoint_blocks or end < prefill_end:
            return 0
        position = pure.mamba_prompt_tail_boundary(
            end, self.cache_hit_alignment_tokens, self.prompt_tail_drops_eagle,
            self.block_pool.num_hash_lookahead_tokens)
        if not pure.mamba_checkpoint_exportable(start, end, position,
                                                self.block_pool.hash_block_size,
                                                self.block_size, self.checkpoint_alignment):
            return 0
        column = cdiv(end, self.block_size) - 2
        blocks = self._blocks_of(request_id)
        free_column = (column >= len(blocks) or blocks[column] == NULL_BLOCK
                       or (request_id in self._allocated_block_reqs
                           and column >= len(blocks) - self.num_speculative_blocks))
        return position if column >= 0 and free_column else 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int
                            ) -> list[int]:
        """As the base class plus speculative blocks; in align mode, nulls up to the new
        state block, last step's speculative blocks moved up, and the blocks after it.
        A pending partial state also gets a copy: in place of a new request's hit block,
        or, for a running request (its own prompt-tail entry), the entry moves onto the
        copy (hittable from the next step) while the request keeps its block. A recorded
        prefill checkpoint keeps its column (the block before the new state block) a real
        block: not nulled, no speculative block moved off it, a new block there if
        needed, even when the table is long enough already."""
        num_spec = self.num_speculative_blocks
        if self.mamba_cache_mode != "align":
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * num_spec, num_tokens_main_model)
        req_blocks = self._blocks_of(request_id)
        num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
        num_held = len(req_blocks)
        partial = self.partial_hit_reqs.pop(request_id, None)
        checkpoint = 1 if request_id in self.checkpoints else 0
        if num_required <= num_held and partial is None and not checkpoint:
            if self.profile.mamba_frees_processed_states:  # 0.33.0: counts as allocated
                self._allocated_block_reqs.add(request_id)
            return []
        allocated_before = request_id in self._allocated_block_reqs
        if allocated_before:
            self.last_state_block_idx[request_id] = num_held - 1 - num_spec
        elif num_held > 0:  # the last block holds the hit's state
            self.last_state_block_idx[request_id] = num_held - 1
        num_skipped = num_required - num_spec - 1
        num_nulled = num_skipped - checkpoint  # a checkpoint's column stays a real block
        req_blocks.extend([NULL_BLOCK] * (num_nulled - num_held))
        if allocated_before:
            for i in range(num_held - num_spec, min(num_held, num_nulled)):
                req_blocks.append(req_blocks[i])
                req_blocks[i] = NULL_BLOCK
        num_new = max(num_required - len(req_blocks), 0)
        if num_new > (1 if allocated_before else 1 + num_spec) + checkpoint:
            raise ValueError(f"request_id={request_id!r} would get {num_new} new Mamba blocks")
        returned = req_blocks[num_held:]
        new_ids = self.block_pool.get_new_blocks(num_new + (partial is not None))
        if partial is not None:
            (index, source), copy = partial, new_ids.pop(0)
            if allocated_before:
                self.block_pool.move_block_hashes(source, copy)
                self.pending_copies.append((source, copy))
                self.block_pool.ref_cnt[source] += 1
                if (tail := self.producer_tails.pop(request_id, None)) is not None:
                    # the request's own prompt-tail state lives on in the copy
                    self.offers.append((request_id, self.kv_cache_group_id, copy, tail[1]))
                if (key := self.block_pool.block_hash.get(copy)) is not None:
                    self.cached_blocks_this_step.add(key)  # filled by this step's copy
            else:
                self._copy_hit_block(request_id, index, source, copy)
                returned.insert(0, copy)
        req_blocks.extend(new_ids)
        self._allocated_block_reqs.add(request_id)
        return returned + new_ids

    def reachable_block_mask(self, start_block: int, end_block: int,
                             retention_interval: int | None = None,
                             boundaries: Sequence[int] = ()) -> list[bool] | None:
        """Every state (None), unless a retention interval thins them out to those on
        its boundaries and at the replay ``boundaries``."""
        if retention_interval is None:
            return None
        return pure.mamba_retention_mask(start_block, end_block, self.block_size,
                                         self.cache_hit_alignment_tokens, retention_interval,
                                         boundaries)

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """As the base class; remember the keys cached in this step. With
        ``mamba_prompt_tail_state`` (0.33.0, align) also key the state block at the
        prompt's last reusable hash boundary when caching reaches exactly there and the
        block is not keyed there already (e.g. after ``evict_blocks``); a request with a
        prefill checkpoint keys (or unkeys) its checkpoint block instead
        (``cache_checkpoint``)."""
        rid = request.request_id
        num_cached_before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens, retention_interval, boundaries)
        num_cached_after = self.num_cached_block.get(rid, 0)
        hbs = self.block_pool.hash_block_size
        inside = num_tokens % self.block_size != 0  # only with partial_hit_copy_on_write
        if self.mamba_cache_mode == "align" and rid in self.checkpoints:
            key = self.cache_checkpoint(request, retention_interval)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        elif (self.profile.mamba_prompt_tail_state and self.mamba_cache_mode == "align"
                and num_tokens > 0 and (not inside or self.profile.partial_hit_copy_on_write)
                and num_tokens == pure.mamba_prompt_tail_boundary(
                    request.num_prompt_tokens, hbs, self.prompt_tail_drops_eagle,
                    self.block_pool.num_hash_lookahead_tokens)):
            blocks = self._blocks_of(rid)
            idx = cdiv(num_tokens, self.block_size) - 1
            if (idx < len(blocks) and blocks[idx] != NULL_BLOCK
                    and self.block_pool.hash_num_tokens.get(blocks[idx]) != num_tokens):
                key = self.block_pool.cache_partial_block(
                    request, blocks[idx], num_tokens, self.kv_cache_group_id, self.block_size,
                    any_boundary=True)
                if key is not None:
                    self.cached_blocks_this_step.add(key)
                if key is not None and inside:  # the next allocation moves it to a copy
                    self.partial_hit_reqs[rid] = (idx, blocks[idx])
                    self.num_cached_block[rid] = idx
                    if self.offers_boundary_states:
                        self.producer_tails[rid] = (blocks[idx], num_tokens)
        if num_cached_after > num_cached_before:
            for block_id in self.req_to_blocks[rid][num_cached_before:num_cached_after]:
                if (key := self.block_pool.block_hash.get(block_id)) is not None:
                    self.cached_blocks_this_step.add(key)
                    if self.offers_boundary_states:
                        self.offers.append((rid, self.kv_cache_group_id, block_id,
                                            self.block_pool.hash_num_tokens[block_id]))

    def take_boundary_state_offers(self) -> list[tuple[str, int, int, int]]:
        """Drain the offered states: (request, group, block, tokens its key covers)."""
        offers, self.offers = self.offers, []
        return offers

    def finalize_partial_tail(self, request_id: str, num_computed_tokens: int,
                              num_in_flight_tokens: int) -> tuple[int, int, int] | None:
        """A finishing request's own prompt-tail state inside a block, (group, block,
        tokens), once, if no later token was computed into its block (nothing in
        flight, the computed tokens at the tail); else None."""
        tail = self.producer_tails.pop(request_id, None)
        if tail is None or num_in_flight_tokens != 0 or num_computed_tokens != tail[1]:
            return None
        return self.kv_cache_group_id, tail[0], tail[1]

    def cache_checkpoint(self, request: Request, retention_interval: int | None
                         ) -> bytes | None:
        """Key the request's checkpoint block at the checkpoint's position, dropping the
        block's other keys (its contents are that state now), when a later lookup can
        use it there: it is the prompt's checkpoint (the whole prompt's reusable
        boundary, ``pure.mamba_prompt_tail_boundary`` of its length), a state the
        retention interval keeps (on a block boundary), or the request's
        ``shared_prefix_boundary``.
        Otherwise unkey the block: the running state overwrites it. The new key, or
        None (unkeyed, or keyed there already)."""
        position, index = self.checkpoints[request.request_id]
        blocks = self._blocks_of(request.request_id)
        assert 0 <= index < len(blocks), (request.request_id, index, len(blocks))
        block = blocks[index]
        prompt_checkpoint = position == pure.mamba_prompt_tail_boundary(
            request.num_prompt_tokens, self.cache_hit_alignment_tokens,
            self.prompt_tail_drops_eagle, self.block_pool.num_hash_lookahead_tokens)
        retained = False
        if position % self.block_size == 0:
            state = position // self.block_size - 1  # the block whose state ends there
            mask = self.reachable_block_mask(state, state + 1, retention_interval)
            retained = mask is None or mask[0]
        junction = getattr(request, "shared_prefix_boundary", 0)
        if not prompt_checkpoint and not retained and position != junction:
            self.block_pool._maybe_evict_cached_block(block)
            return None
        if self.block_pool.hash_num_tokens.get(block) == position:
            return None
        return self.block_pool.cache_partial_block(
            request, block, position, self.kv_cache_group_id, self.block_size,
            any_boundary=True, replace=True)

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """As the base class; forget the align-mode bookkeeping too."""
        self._allocated_block_reqs.discard(request_id)
        self.checkpoints.pop(request_id, None)
        self.last_state_block_idx.pop(request_id, None)
        self.num_retired_blocks.pop(request_id, None)
        self.producer_tails.pop(request_id, None)
        self.offers = [offer for offer in self.offers if offer[0] != request_id]
        return super().pop_blocks_for_free(request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """As the base class, and in align mode free the previous step's state block."""
        if not self.profile.mamba_frees_processed_states:
            # NOTE: like vLLM 0.25.1, subtract a block count from a token count, for
            # rejected drafts.
            total_computed_tokens = max(0, total_computed_tokens - self.num_speculative_blocks)
        if self.profile.mamba_frees_processed_states and self.mamba_cache_mode == "align":
            self._retire_skipped_states(request_id, total_computed_tokens)
        else:
            super().remove_skipped_blocks(request_id, total_computed_tokens)
        idx = self.last_state_block_idx.get(request_id)
        if (self.mamba_cache_mode == "align" and idx is not None
                and idx < cdiv(total_computed_tokens, self.block_size) - 1):
            blocks = self._blocks_of(request_id)
            if blocks[idx] != NULL_BLOCK:
                self.block_pool.free_blocks([blocks[idx]])
                blocks[idx] = NULL_BLOCK

    def _retire_skipped_states(self, request_id: str, total_computed_tokens: int) -> None:
        """0.33.0's align mode: free every live state before the latest that an earlier
        call has not retired, right to left, past null gaps; remember how far it got."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self._blocks_of(request_id)
        stop = min(num_skipped_tokens // self.block_size, len(blocks))
        start = self.num_retired_blocks.get(request_id, 0)
        if start >= stop:
            return
        freed = [b for b in blocks[start:stop][::-1] if b != NULL_BLOCK]
        blocks[start:stop] = [NULL_BLOCK] * (stop - start)
        if freed:
            self.block_pool.free_blocks(freed)
        self.num_retired_blocks[request_id] = stop

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token but the last: only the latest state is read."""
        return pure.num_skipped_tokens_mamba(num_computed_tokens)

    def new_step_starts(self) -> None:
        """States cached in the last step are complete now."""
        self.cached_blocks_this_step.clear()

    def check_invariants(self, nulls_only_leading: bool = True) -> None:
        """As the base class; align mode may null any block before the running state."""
        super().check_invariants(self.mamba_cache_mode != "align")


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross attention: blocks for the encoder output, sized by ``num_encoder_tokens``,
    private to the request and never cached."""

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[int],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Nothing to add: cross-attention blocks are never hits."""
        if len(new_computed_blocks):
            raise ValueError(f"new_computed_blocks={list(new_computed_blocks)} for cross attention")

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Nothing: a KV connector loads no encoder output."""

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Refused: cross-attention blocks are never cached."""
        raise ValueError("cross-attention blocks are never cached")


# ---------------------------------------------------------------- HiSparse (vLLM 0.33.0)
# A HiSparse layout: a source group (full attention, role "hisparse_source") whose
# blocks live in a host pool of their own (``bind_host_pool``), resident groups (the
# pages a request reads from the device) and hot groups (a fixed region a request
# takes to read host-only pages). vLLM's HiSparseCoordinator (outside the core, not
# modelled) binds itself as each manager's ``coordinator`` and is called back below.


def bound_coordinator(manager: SingleTypeKVCacheManager) -> Any:
    """The manager's HiSparse coordinator; RuntimeError if none is bound yet."""
    coordinator = getattr(manager, "coordinator", None)
    if coordinator is None:
        raise RuntimeError(f"{type(manager).__name__} (group {manager.kv_cache_group_id}) has "
                           "no HiSparse coordinator bound")
    return coordinator


class HiSparseSourceManager(FullAttentionManager):
    """The HiSparse source: full attention over a host pool. Admission counts 0 when
    the host pool can back the pages, else one more than the device pool (admission
    fails); its caching waits for the coordinator (``publish_blocks``); it records
    nothing for zeroing; its copy-on-write pairs go to the coordinator."""

    retains_longer_hit = True
    coordinator: Any = None

    def bind_host_pool(self, num_blocks: int) -> None:
        """Use a new host pool of ``num_blocks`` blocks (medium CPU, caching as the
        group, hashing as the device pool, events into the device pool's queue)."""
        device = self.block_pool
        host = BlockPool(num_blocks, self.enable_caching and cacheable(self.kv_cache_spec),
                         device.hash_block_size, device.enable_kv_cache_events,
                         medium=MEDIUM_CPU, profile=device.profile,
                         num_hash_lookahead_tokens=device.num_hash_lookahead_tokens)
        host.hash_fn, host.none_hash = device.hash_fn, device.none_hash
        host.share_event_queue(device)
        self.block_pool = host

    def take_new_block_ids(self) -> list[int]:
        """Nothing: host blocks are never zeroed."""
        self.new_block_ids = []
        return []

    def take_pending_cow_copies(self) -> list[tuple[int, int]]:
        """Nothing: host copies are the coordinator's (``take_host_cow_copies``)."""
        return []

    def take_host_cow_copies(self) -> list[tuple[int, int]]:
        """Drain the (source, copy) host block pairs."""
        return super().take_pending_cow_copies()

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """0 if the host pool has the blocks, else the device pool's size + 1."""
        needed = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_tokens_main_model, False, num_local_computed_tokens)
        if needed <= self.block_pool.get_num_free_blocks():
            return 0
        return int(bound_coordinator(self).gpu_pool.num_gpu_blocks) + 1

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Tell the coordinator of the import first, then take its host blocks."""
        if num_external_computed_tokens <= 0:
            return
        bound_coordinator(self).record_pending_host_import(
            request_id, num_local_computed_tokens + num_external_computed_tokens)
        super().allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                  num_external_computed_tokens,
                                                  record_for_zeroing)

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Leave it to the coordinator (``publish_when_ready``)."""
        bound_coordinator(self).publish_when_ready(request, num_tokens, retention_interval,
                                                   replay_boundaries=boundaries)

    def publish_blocks(self, request: Request, num_tokens: int,
                       retention_interval: int | None = None,
                       replay_boundaries: Sequence[int] | None = None) -> None:
        """Cache as full attention does (the coordinator, once the host copies last)."""
        FullAttentionManager.cache_blocks(self, request, num_tokens, retention_interval,
                                          replay_boundaries)

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Tell the coordinator (``free``), then forget the request."""
        bound_coordinator(self).free(request_id)
        return super().pop_blocks_for_free(request_id)


class HiSparseHotManager(SingleTypeKVCacheManager):
    """A hot group: ``blocks_per_request`` blocks, taken only when the request must
    read host pages (an import, a new request with a local hit, or ``require_hot``).
    Never hit, cached or zeroed."""

    coordinator: Any = None

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.blocks_per_request: int = kv_cache_spec.blocks_per_request
        if not isinstance(self.blocks_per_request, int) or self.blocks_per_request <= 0:
            raise ValueError(f"blocks_per_request={self.blocks_per_request!r} must be a "
                             "positive int")
        self.hot_required: set[str] = set()

    def require_hot(self, request_id: str) -> None:
        """The request gets its region at its next allocation."""
        self.hot_required.add(request_id)

    def has_hot(self, request_id: str) -> bool:
        """Whether the request holds its whole region."""
        return len(self.req_to_blocks.get(request_id, [])) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        """The region's blocks the request lacks."""
        return max(self.blocks_per_request - len(self.req_to_blocks.get(request_id, [])), 0)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """The missing region if the request needs it now, else 0 (a running request
        needs it only after ``require_hot``)."""
        check_no_hits(request_id, new_computed_blocks)
        imports = total_computed_tokens > num_local_computed_tokens
        new_with_hit = num_local_computed_tokens > 0 and request_id not in self.num_cached_block
        if imports or new_with_hit or request_id in self.hot_required:
            return self.get_num_required_blocks(request_id)
        return 0

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[int],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Admit the request; a local hit (or no resident group) needs the region."""
        check_no_hits(request_id, new_computed_blocks)
        self._blocks_of(request_id)
        self.num_cached_block[request_id] = 0
        if num_local_computed_tokens > 0 or not bound_coordinator(self).resident_managers:
            self.require_hot(request_id)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """An import is read from the host: the request needs the region."""
        self.require_hot(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int
                            ) -> list[int]:
        """The missing region if required, else nothing; the request is admitted."""
        req_blocks = self._blocks_of(request_id)
        self.num_cached_block[request_id] = 0
        if request_id not in self.hot_required:
            return []
        num_new = self.blocks_per_request - len(req_blocks)
        new_ids = self.block_pool.get_new_blocks(num_new) if num_new > 0 else []
        req_blocks.extend(new_ids)
        return new_ids

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Nothing: the source caches."""

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forget the request, its region request too."""
        self.hot_required.discard(request_id)
        return super().pop_blocks_for_free(request_id)


class HiSparseResidentManager(SingleTypeKVCacheManager):
    """A resident group: per request, the device block each page is read from. The
    table only grows (a host-only page is the null block); ``residency_changes``
    (request -> page -> block, NULL_BLOCK for a page dropped) overlays it. Never hit,
    cached or zeroed. The table may name a block the pool gave to another reader since
    (a dropped page's), so its invariants are only the base's bookkeeping."""

    coordinator: Any = None

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        cap = self.max_admission_blocks_per_request
        if not isinstance(cap, int) or cap <= 0:
            raise ValueError(f"max_admission_blocks_per_request={cap!r}: a resident group "
                             "needs its admission window")
        self.window: int = cap
        self.residency_changes: dict[str, dict[int, int]] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """Device pages still needed for ``num_tokens``: with an import, its last page
        (if not resident) and the pages past it; else the pages past the host prefix
        and the table (at most the window's under ``apply_admission_cap``)."""
        check_no_hits(request_id, new_computed_blocks)
        num_pages = len(self.req_to_blocks.get(request_id, []))
        needed = cdiv(num_tokens, self.block_size)
        if total_computed_tokens > num_local_computed_tokens:
            imported = cdiv(total_computed_tokens, self.block_size)
            tail = self.get_resident_page(request_id, imported - 1) is None
            return int(tail) + max(needed - max(imported, num_pages), 0)
        if apply_admission_cap:
            needed = min(needed, self.window)
        return max(needed - max(num_pages, cdiv(num_local_computed_tokens, self.block_size)), 0)

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[int],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """The host prefix hit becomes host-only pages; the coordinator is told."""
        check_no_hits(request_id, new_computed_blocks)
        req_blocks = self._blocks_of(request_id)
        if req_blocks:
            raise ValueError(f"request_id={request_id!r} already holds pages {req_blocks}")
        num_pages = cdiv(num_local_computed_tokens, self.block_size)
        req_blocks.extend([NULL_BLOCK] * num_pages)
        self.num_cached_block[request_id] = 0
        bound_coordinator(self).commit_computed_blocks(request_id, num_pages)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Imported pages stay host-only but the last, which gets a writable block
        unless it is resident."""
        if num_external_computed_tokens <= 0:
            raise ValueError(f"num_external_computed_tokens={num_external_computed_tokens}: "
                             "an import needs tokens")
        req_blocks = self._blocks_of(request_id)
        last = (num_local_computed_tokens + num_external_computed_tokens - 1) // self.block_size
        while len(req_blocks) <= last:
            req_blocks.append(NULL_BLOCK)
        if self.get_resident_page(request_id, last) is None:
            req_blocks[last] = self.block_pool.get_new_blocks(1)[0]

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int
                            ) -> list[int]:
        """A device block per new page up to ``num_tokens``."""
        req_blocks = self._blocks_of(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        new_ids = self.block_pool.get_new_blocks(num_new) if num_new > 0 else []
        req_blocks.extend(new_ids)
        return new_ids

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Nothing: the source caches."""

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Tell the coordinator (``free``), forget the request; its residency row
        without the leading null blocks."""
        bound_coordinator(self).free(request_id)
        row = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        super().pop_blocks_for_free(request_id)
        while row and row[0] == NULL_BLOCK:
            row.pop(0)
        return row

    def adopt_resident_page(self, request_id: str, page: int, block: int) -> bool:
        """Read host-only ``page`` from ``block`` from now on; False (no change) past
        the table or if the page is resident."""
        if page >= len(self.req_to_blocks.get(request_id, [])):
            return False
        if self.get_resident_page(request_id, page) is not None:
            return False
        self.residency_changes.setdefault(request_id, {})[page] = block
        return True

    def drop_resident_page(self, request_id: str, page: int) -> int | None:
        """Stop reading ``page`` from the device; the block it was read from (None if
        it was host-only)."""
        block = self.get_resident_page(request_id, page)
        if block is not None:
            self.residency_changes.setdefault(request_id, {})[page] = NULL_BLOCK
        return block

    def get_resident_page(self, request_id: str, page: int) -> int | None:
        """The block ``page`` is read from; None if host-only or past the table."""
        row = self.get_residency_row(request_id)
        if page >= len(row) or row[page] == NULL_BLOCK:
            return None
        return row[page]

    def get_residency_row(self, request_id: str, start: int = 0) -> list[int]:
        """The pages from ``start``, changes applied (host-only: the null block)."""
        changes = self.residency_changes.get(request_id, {})
        table = self.req_to_blocks.get(request_id, [])
        return [changes.get(page, table[page]) for page in range(start, len(table))]

    def check_invariants(self, nulls_only_leading: bool = True) -> None:
        """The base's bookkeeping only (see the class docstring)."""
        assert set(self.num_cached_block) <= set(self.req_to_blocks)
        assert set(self.residency_changes) <= set(self.req_to_blocks)


MANAGER_CLASSES: dict[str, type[SingleTypeKVCacheManager]] = {
    "FullAttentionSpec": FullAttentionManager,
    "TQFullAttentionSpec": FullAttentionManager,
    "MLAAttentionSpec": FullAttentionManager,
    "HiddenStateCacheSpec": FullAttentionManager,
    "SlidingWindowSpec": SlidingWindowManager,
    "SlidingWindowMLASpec": SlidingWindowManager,
    "ChunkedLocalAttentionSpec": ChunkedLocalAttentionManager,
    "MambaSpec": MambaManager,
    "CrossAttentionSpec": CrossAttentionManager,
    "RSWASpec": RSWAManager,
    "SinkFullAttentionSpec": SinkFullAttentionManager,
    "CircularBufferSpec": CircularBufferManager,
    "HiSparseResidentSpec": HiSparseResidentManager,
    "HiSparseHotSpec": HiSparseHotManager,
}
"""The manager of each modelled layer-spec class, by class name (exact class only)."""

ROLE_MANAGER_CLASSES: dict[str, type[SingleTypeKVCacheManager]] = {
    "hisparse_source": HiSparseSourceManager,
}
"""vLLM 0.33.0's group roles with a manager of their own (before the spec class)."""


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int,
                                  max_model_len: int, block_pool: BlockPool, enable_caching: bool,
                                  kv_cache_group_id: int, scheduler_block_size: int,
                                  context_parallel: int = 1, role: str | None = None,
                                  **switches: Any) -> SingleTypeKVCacheManager:
    """The manager of the group's role (vLLM 0.33.0's ``KVCacheGroupSpec.role``), else
    of the spec's kind; windowed kinds get their admission cap. NotImplementedError for
    unmodelled spec types and for cross attention with caching. ``switches``: the
    manager's keyword arguments (``profile``, ``needs_kv_cache_zeroing``, ``use_eagle``)."""
    manager_cls = ROLE_MANAGER_CLASSES.get(role or "") or MANAGER_CLASSES.get(
        type(kv_cache_spec).__name__)
    if manager_cls is None:
        raise NotImplementedError(f"no spec manager for {type(kv_cache_spec).__name__}")
    if manager_cls is SinkFullAttentionManager:
        # vLLM 0.25.1 passes scheduler_block_size, which this constructor lacks.
        raise TypeError("SinkFullAttentionManager.__init__() got an unexpected keyword "
                        "argument 'scheduler_block_size'")
    if manager_cls is CrossAttentionManager and enable_caching:
        raise NotImplementedError("prefix caching with a cross-attention group")
    cap = admission_cap(kv_cache_spec, max_num_batched_tokens, max_model_len)
    return manager_cls(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id,
                       scheduler_block_size, cap, context_parallel, **switches)
