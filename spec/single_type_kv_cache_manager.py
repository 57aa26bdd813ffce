"""Per-group managers: one class, driven by its kind's row of rules (``KINDS``).

A row (``KindRules``) says what the kind skips, how a lookup finds its hit, which
blocks it caches, and which rule each step of the flow follows (allocation, free,
caching), defaulting to full attention's. ``SingleTypeKVCacheManager`` is the flow,
written once: each public method calls its row's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from . import pure
from .block_pool import BlockPool
from .profile import Profile
from .pure import cdiv
from .vocab import MEDIUM_CPU, NULL_BLOCK, KVCacheSpec, Request, admission_cap, cacheable

ZEROED_SPECS = ("FullAttentionSpec", "TQFullAttentionSpec", "MLAAttentionSpec",
                "HiddenStateCacheSpec")
"""Spec classes (exact) whose fresh blocks are reported by ``take_new_block_ids``."""

Hits = tuple[list[int], ...]
"""Per group of a lookup, the hit block ids (NULL_BLOCK where skipped)."""


def records_new_block_ids(kv_cache_spec: KVCacheSpec, profile: Profile,
                          needs_kv_cache_zeroing: bool) -> bool:
    """Whether a group reports its fresh blocks for zeroing: full attention and MLA
    (exact classes, as vLLM tests them) and what the release's rules add, where its
    rules let the layout record any."""
    rules = profile.rules
    return rules.new_block_ids_zeroing_only(needs_kv_cache_zeroing) and (
        type(kv_cache_spec).__name__ in ZEROED_SPECS
        or rules.zero_every_attention_group(kv_cache_spec, needs_kv_cache_zeroing))


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


# ---------------------------------------------------------------- the rules of each kind
# Hit searches: (the hashes up to max_length, which are cached, max_length, spec, drop
# the EAGLE block, alignment in tokens) -> (first, num_blocks), nulls before first.
HitSearch = Callable[[Sequence[bytes], Container[bytes], int, KVCacheSpec, bool, int],
                     tuple[int, int]]
# Fine-grained searches (mamba_fine_grained_hits): (hashes per hash block, max_length,
# group ids, pool, spec, drop the EAGLE block, hash block size) -> (hits, length).
FineHitSearch = Callable[[Sequence[bytes], int, list[int], BlockPool, KVCacheSpec, bool, int],
                         tuple[Hits, int]]
# Which of blocks [start, end) caching keys: (spec, start, end, block size, hit
# alignment, retention interval, replay boundaries, EAGLE) -> mask (None: all).
CacheMask = Callable[[KVCacheSpec, int, int, int, int, int | None, Sequence[int], bool],
                     list[bool] | None]


def full_attention_hit(block_hashes: Sequence[bytes], cached: Container[bytes], max_length: int,
                       spec: KVCacheSpec, drop_eagle_block: bool, alignment: int
                       ) -> tuple[int, int]:
    """The leading cached run, less the EAGLE block, aligned."""
    return 0, pure.full_attention_hit_num_blocks(
        block_hashes, cached, max_length // spec.block_size, drop_eagle_block, spec.block_size,
        alignment)


def window_blocks_for_hit(spec: KVCacheSpec, use_eagle: bool) -> int:
    """Contiguous cached blocks a sliding-window hit needs; EAGLE one more, dropped."""
    return pure.num_contiguous_blocks_for_hit(spec.sliding_window, spec.block_size, use_eagle)


def sliding_window_hit(block_hashes: Sequence[bytes], cached: Container[bytes], max_length: int,
                       spec: KVCacheSpec, drop_eagle_block: bool, alignment: int
                       ) -> tuple[int, int]:
    """The last cached run filling a window and ending where an aligned hit can; a
    shorter run from block 0 also counts."""
    return pure.sliding_window_hit_range(
        block_hashes, cached, max_length // spec.block_size,
        window_blocks_for_hit(spec, drop_eagle_block), drop_eagle_block, spec.block_size,
        alignment)


def chunked_local_hit(block_hashes: Sequence[bytes], cached: Container[bytes], max_length: int,
                      spec: KVCacheSpec, drop_eagle_block: bool, alignment: int
                      ) -> tuple[int, int]:
    """Nulls before the chunk of token ``max_length``, then the chunk's cached blocks.
    NotImplementedError with an EAGLE drop or an alignment other than the block."""
    if drop_eagle_block or spec.block_size != alignment:
        raise NotImplementedError("chunked local attention hits need no EAGLE drop and "
                                  f"block_size={spec.block_size} == alignment {alignment}")
    return pure.chunked_local_hit_range(block_hashes, cached, max_length,
                                        spec.attention_chunk_size, spec.block_size)


def mamba_hit(block_hashes: Sequence[bytes], cached: Container[bytes], max_length: int,
              spec: KVCacheSpec, drop_eagle_block: bool, alignment: int) -> tuple[int, int]:
    """The last cached state on an aligned boundary, nulls before it (never an EAGLE
    drop: draft models have no Mamba layers)."""
    num_blocks = pure.mamba_hit_num_blocks(block_hashes, cached, max_length // spec.block_size,
                                           spec.block_size, alignment)
    return max(num_blocks - 1, 0), num_blocks


def full_attention_fine_hit(block_hashes: Sequence[bytes], max_length: int, group_ids: list[int],
                            pool: BlockPool, spec: KVCacheSpec, drop_eagle_block: bool,
                            hash_block_size: int) -> tuple[Hits, int]:
    """The leading cached blocks, then the longest cached hash-block prefix inside the
    next block; EAGLE drops one hash block."""
    scale = spec.block_size // hash_block_size
    ends = [(i + 1) * scale - 1 for i in range(max_length // spec.block_size)]
    num_blocks = 0
    while num_blocks < len(ends) and ends[num_blocks] < len(block_hashes) and (
            pool.get_cached_block(block_hashes[ends[num_blocks]], group_ids) is not None):
        num_blocks += 1
    hit_ends = ends[:num_blocks]
    length = num_blocks * spec.block_size
    first = num_blocks * scale
    for i in reversed(range(first, min(first + scale - 1, max_length // hash_block_size,
                                       len(block_hashes)))):
        if pool.get_cached_block(block_hashes[i], group_ids) is not None:
            hit_ends.append(i)
            length = (i + 1) * hash_block_size
            break
    if drop_eagle_block and length > 0:
        length -= hash_block_size
    hit_ends = hit_ends[:cdiv(length, spec.block_size)]
    return hit_blocks([block_hashes[i] for i in hit_ends], 0, len(hit_ends), group_ids,
                      pool), length


def mamba_fine_hit(block_hashes: Sequence[bytes], max_length: int, group_ids: list[int],
                   pool: BlockPool, spec: KVCacheSpec, drop_eagle_block: bool,
                   hash_block_size: int) -> tuple[Hits, int]:
    """The last state cached at any hash boundary within ``max_length``, nulls before
    its block."""
    for i in reversed(range(min(max_length // hash_block_size, len(block_hashes)))):
        hits = pool.get_cached_block(block_hashes[i], group_ids)
        if hits is not None:
            nulls = [NULL_BLOCK] * (i // (spec.block_size // hash_block_size))
            return tuple([*nulls, b] for b in hits), (i + 1) * hash_block_size
    return tuple([] for _ in group_ids), 0


def sliding_window_mask(spec: KVCacheSpec, start: int, end: int, block_size: int,
                        alignment: int, retention_interval: int | None,
                        boundaries: Sequence[int], use_eagle: bool) -> list[bool] | None:
    """Only the window's blocks before each alignment boundary (shifted by one block
    with EAGLE) can serve a hit; with a retention interval, before each of its
    boundaries (none for 0) and each replay boundary instead."""
    num_needed = window_blocks_for_hit(spec, use_eagle)
    if retention_interval is not None:
        return pure.sliding_window_retention_mask(start, end, num_needed, block_size, alignment,
                                                  retention_interval, boundaries, use_eagle)
    return pure.sliding_window_reachable_mask(start, end, num_needed, alignment // block_size,
                                              use_eagle)


def mamba_mask(spec: KVCacheSpec, start: int, end: int, block_size: int, alignment: int,
               retention_interval: int | None, boundaries: Sequence[int], use_eagle: bool
               ) -> list[bool] | None:
    """Every state, unless a retention interval keeps only those on its boundaries and
    at the replay boundaries."""
    if retention_interval is None:
        return None
    return pure.mamba_retention_mask(start, end, block_size, alignment, retention_interval,
                                     boundaries)


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group: the flow, each step its row's rule (``rules``).

    ``req_to_blocks[r][i]`` holds tokens ``[i*block_size, (i+1)*block_size)`` of request
    r, NULL_BLOCK where attention skips them; some reads create an empty table, as
    vLLM's defaultdict does (``_blocks_of``). ``num_cached_block[r]`` counts r's leading
    blocks already cached; having one marks r as running. ``new_block_ids`` collects
    fresh full-attention ids until taken.

    Invariants (``check_invariants``): no table holds a block twice; NULL_BLOCK entries
    lead each table (R-SWA's gap and Mamba's align mode null blocks further in too);
    every cached-block count has a table. (A HiSparse resident table may name a block
    the pool gave another reader since: only its bookkeeping is checked.)"""

    coordinator: Any = None  # HiSparse: vLLM's HiSparseCoordinator, bound from outside

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, scheduler_block_size: int,
                 max_admission_blocks_per_request: int | None = None,
                 context_parallel: int = 1, *, profile: Profile | None = None,
                 needs_kv_cache_zeroing: bool = False, use_eagle: bool = False,
                 rules: KindRules | None = None) -> None:
        # ``profile``: the release whose switches it reads (default: its pool's); the
        # layout's ``needs_kv_cache_zeroing``; the engine's ``use_eagle`` (Mamba's tail).
        self.rules = row_for(kv_cache_spec) if rules is None else rules
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
        self.num_speculative_blocks = 0  # Mamba: held beyond the tokens (its rows' setup)
        self.cached_blocks_this_step: set[bytes] = set()  # Mamba: keys cached this step
        self.align: MambaAlign | None = None  # Mamba 'align' mode's record (its row's setup)
        self.rules.setup(self, use_eagle)

    def _reserve_sinks(self, use_eagle: bool) -> None:
        """Sink tokens: ``sink_len // block_size`` blocks (``sink_blocks``) leave the
        front of the free queue for good (ref count 0, counted as used)."""
        sink_len, pool = self.kv_cache_spec.sink_len, self.block_pool
        if not isinstance(sink_len, int) or sink_len <= 0 or sink_len % self.block_size:
            raise ValueError(f"sink_len={sink_len!r} must be a positive multiple of "
                             f"block_size={self.block_size}")
        num_sink_blocks = sink_len // self.block_size
        if num_sink_blocks > len(pool.free_queue):
            raise ValueError(f"sink_len={sink_len} needs {num_sink_blocks} free blocks, "
                             f"the pool has {len(pool.free_queue)}")
        self.sink_blocks = pool.free_queue[:num_sink_blocks]
        del pool.free_queue[:num_sink_blocks]

    def _set_up_states(self, use_eagle: bool) -> None:
        """Mamba: the spec's ``num_speculative_blocks`` are held beyond the tokens."""
        self.num_speculative_blocks = self.kv_cache_spec.num_speculative_blocks

    def _set_up_align(self, use_eagle: bool) -> None:
        """Mamba 'align': speculative blocks, and the mode's record (``MambaAlign``)."""
        self._set_up_states(use_eagle)
        rules = self.profile.rules
        checkpoints = rules.mamba_prefill_checkpoints(self.kv_cache_spec)
        blocks, alignment = checkpoints or (0, None)
        self.align = MambaAlign(
            drops_eagle=rules.mamba_eagle_state_drop(use_eagle),
            has_checkpoint_blocks=blocks > 0, checkpoint_alignment=alignment,
            offers_boundary_states=checkpoints is not None)

    def _set_up_hot_region(self, use_eagle: bool) -> None:
        """A hot group: the spec's region size, and the requests to get their region."""
        self.blocks_per_request: int = self.kv_cache_spec.blocks_per_request
        if not isinstance(self.blocks_per_request, int) or self.blocks_per_request <= 0:
            raise ValueError(f"blocks_per_request={self.blocks_per_request!r} must be a "
                             "positive int")
        self.hot_required: set[str] = set()

    def _set_up_residency(self, use_eagle: bool) -> None:
        """A resident group: its admission window, and the residency overlay."""
        cap = self.max_admission_blocks_per_request
        if not isinstance(cap, int) or cap <= 0:
            raise ValueError(f"max_admission_blocks_per_request={cap!r}: a resident group "
                             "needs its admission window")
        self.window: int = cap
        # request -> page -> block (NULL_BLOCK: dropped), overlaying the table
        self.residency_changes: dict[str, dict[int, int]] = {}

    def _blocks_of(self, request_id: str) -> list[int]:
        """The request's table, created empty if unknown (vLLM's defaultdict read)."""
        return self.req_to_blocks.setdefault(request_id, [])

    def _ends_inside_block(self, hits: Sequence[int], num_local_computed_tokens: int) -> bool:
        """Whether a hit ends inside its last block, which is copied before the request
        writes it (``partial_hit_copy_on_write``)."""
        return len(hits) > 0 and self.profile.rules.partial_hit_copy_on_write(
            num_local_computed_tokens, self.block_size)

    def _num_evictable(self, blocks: Sequence[int]) -> int:
        """Blocks that touching them takes out of the free queue."""
        return sum(self.block_pool.ref_cnt[b] == 0 and b != NULL_BLOCK for b in blocks)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no longer read once ``num_computed_tokens`` are computed."""
        return self.rules.skipped_tokens(self.kv_cache_spec, num_computed_tokens)

    # ------------------------------------------------------------ allocation

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """Free blocks needed to give the request ``num_tokens`` slots and take its hits,
        by the row's ``num_blocks`` (``num_local_computed_tokens``: computed plus hit
        tokens; ``prefill_end``: for Mamba's prefill checkpoints)."""
        return self.rules.num_blocks(self, request_id, num_tokens, new_computed_blocks,
                                     total_computed_tokens, apply_admission_cap,
                                     num_local_computed_tokens, num_tokens_main_model, prefill_end)

    def _num_table_blocks(self, request_id: str, num_tokens: int,
                          new_computed_blocks: Sequence[int], total_computed_tokens: int,
                          apply_admission_cap: bool, num_local_computed_tokens: int,
                          num_tokens_main_model: int = 0, prefill_end: int = 0) -> int:
        """A table's fresh blocks for ``num_tokens`` slots plus its hits' evictable ones
        (and the copy of a hit ending inside a block, ``partial_hit_copy_on_write``)."""
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

    def _waits_for_state(self, new_computed_blocks: Sequence[int]) -> bool:
        """Mamba: whether the hit ends on a state cached this step (not written yet)."""
        return bool(self.cached_blocks_this_step and len(new_computed_blocks) and self.block_pool
                    .block_hash.get(new_computed_blocks[-1]) in self.cached_blocks_this_step)

    def _num_state_blocks(self, request_id: str, num_tokens: int, hits: Sequence[int],
                          *args: Any) -> int:
        """Mamba: plus the speculative blocks in the layer's block size (vLLM takes more
        than it counts under context parallelism); a hit on a state cached this step
        needs more blocks than can be free: it waits a step."""
        if self._waits_for_state(hits):
            return self.block_pool.num_gpu_blocks + 1
        num_tokens += self.kv_cache_spec.block_size * self.num_speculative_blocks
        return self._num_table_blocks(request_id, num_tokens, hits, *args)

    def _num_host_blocks(self, request_id: str, num_tokens: int, hits: Sequence[int],
                         total_computed_tokens: int, apply_admission_cap: bool,
                         *args: Any) -> int:
        """The HiSparse source: 0 when its host pool has the blocks (no admission cap),
        else more than the device pool has."""
        needed = self._num_table_blocks(request_id, num_tokens, hits, total_computed_tokens,
                                        False, *args)
        free = self.block_pool.get_num_free_blocks()
        return 0 if needed <= free else int(self._bound_coordinator().gpu_pool.num_gpu_blocks) + 1

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[int],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Give a request without blocks its hits, by the row's ``adopt``."""
        self.rules.adopt(self, request_id, new_computed_blocks, num_local_computed_tokens,
                         num_external_computed_tokens)

    def _adopt_hits(self, request_id: str, new_computed_blocks: Sequence[int],
                    num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """The hits (touched), nulls where skipped; a hit ending inside its last block
        is copied at the next allocation (``partial_hit_copy_on_write``)."""
        if held := self.req_to_blocks.get(request_id):
            raise ValueError(f"request_id={request_id!r} already holds blocks {held}; "
                             "computed blocks only go to a request without blocks")
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(num_total) // self.block_size
        if num_skipped > 0:
            new_computed_blocks = new_computed_blocks[num_skipped:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"new_computed_blocks={list(new_computed_blocks)} with caching off")
        req_blocks = self._blocks_of(request_id)
        req_blocks.extend([NULL_BLOCK] * num_skipped)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        if self._ends_inside_block(new_computed_blocks, num_local_computed_tokens):
            # The last hit block is copied at the next allocation; the copy is cached anew.
            index = num_local_computed_tokens // self.block_size
            self.partial_hit_reqs[request_id] = (index, new_computed_blocks[-1])
            self.num_cached_block[request_id] = index

    def _nothing(self, *args: Any) -> None:
        """A step the kind takes no part in (a ring's hits, cross attention's loads)."""

    def _refuse_hits(self, request_id: str, hits: Sequence[int], *args: Any) -> None:
        if len(hits):  # cross attention
            raise ValueError(f"new_computed_blocks={list(hits)} for cross attention")

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Allocate blocks for the tokens a KV connector computed, by the row's ``load``;
        an async load that writes them (not ``record_for_zeroing``) needs no zeroing."""
        self.rules.load(self, request_id, num_local_computed_tokens,
                        num_external_computed_tokens, record_for_zeroing)

    def _load_blocks(self, request_id: str, num_local_computed_tokens: int,
                     num_external_computed_tokens: int, record_for_zeroing: bool) -> None:
        """Fresh blocks up to the loaded tokens, unless skipped."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(num_total - num_skipped_tokens,
                                               num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            req_blocks = self._blocks_of(request_id)
            num_new = self.profile.rules.external_blocks_floor_zero(
                cdiv(num_total, self.block_size) - len(req_blocks))  # it may hold more already
            self._append_new(req_blocks, num_new, record_for_zeroing)

    def _load_host_blocks(self, request_id: str, local: int, external: int, *args: Any) -> None:
        """The HiSparse source tells its coordinator of an import first."""
        if external > 0:
            self._bound_coordinator().record_pending_host_import(request_id, local + external)
        self._load_blocks(request_id, local, external, *args)

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

    def _extend_to(self, req_blocks: list[int], num_blocks: int) -> list[int]:
        """Fresh blocks (never zeroed) until the table holds ``num_blocks``; the new ones."""
        return self._append_new(req_blocks, max(num_blocks - len(req_blocks), 0), False)

    def _claim_ring_block(self, request_id: str, *args: Any) -> list[int]:
        """A ring's one block, taken at the request's first allocation or load."""
        return self._extend_to(self._blocks_of(request_id), 1)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int
                            ) -> list[int]:
        """Give the request ``num_tokens`` slots (the row's ``grow``); the new blocks."""
        return self.rules.grow(self, request_id, num_tokens, num_tokens_main_model)

    def _grow_table(self, request_id: str, num_tokens: int, num_main: int) -> list[int]:
        """Fresh blocks for ``num_tokens`` slots and the speculative ones, a partial hit's
        copy first (recorded for zeroing)."""
        num_tokens += self.block_size * self.num_speculative_blocks
        copies = []
        if request_id in self.partial_hit_reqs:
            index, source = self.partial_hit_reqs.pop(request_id)
            copies = self.block_pool.get_new_blocks(1)
            self._copy_hit_block(request_id, index, source, copies[0])
            self.new_block_ids.extend(copies)
        req_blocks = self._blocks_of(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        return copies + (self._append_new(req_blocks, num_new) if num_new > 0 else [])

    def _grow_hot_region(self, request_id: str, *args: Any) -> list[int]:
        """A hot group: the missing region if required, else nothing (it is admitted)."""
        req_blocks = self._blocks_of(request_id)
        self.num_cached_block[request_id] = 0
        required = request_id in self.hot_required
        return self._extend_to(req_blocks, self.blocks_per_request) if required else []

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
        """Drain the (source, copy) pairs queued since the last call (``take_copies``)."""
        return self.rules.take_copies(self)

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids allocated since the last call (the row's ``take_ids``)."""
        return self.rules.take_ids(self)

    def _drain_ids(self) -> list[int]:
        """Drain the ids allocated since the last call."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def _drain_host_ids(self) -> list[int]:
        """The HiSparse source: drain its ids and report none (host blocks are never
        zeroed)."""
        self._drain_ids()
        return []

    # ------------------------------------------------------------ caching

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None,
                     boundaries: Sequence[int] | None = None) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens (the
        row's ``cache``) that the mask keeps for the ``retention_interval`` and replay
        ``boundaries`` (None: one token short of the prompt; with
        ``shared_prefix_junctions`` also ``shared_prefix_boundary``, and one block
        below it for EAGLE)."""
        self.rules.cache(self, request, num_tokens, retention_interval, boundaries)

    def _key_full_blocks(self, request: Request, num_tokens: int, retention_interval: int | None,
                         boundaries: Sequence[int] | None) -> tuple[int, int]:
        """Key the full blocks the mask keeps (windowed kinds' rule); cached before, after."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_keyed = self.profile.rules.cache_within_hashed_tokens(num_tokens, request,
                                                                  self.block_pool)
        num_full = num_keyed // self.block_size
        if num_cached < num_full:
            kept = [request.num_prompt_tokens - 1] if boundaries is None else list(boundaries)
            junction = self.profile.rules.shared_prefix_junctions(
                getattr(request, "shared_prefix_boundary", 0))
            if junction:
                kept += self.profile.rules.junction_eagle_tail(junction, self.block_size,
                                                               self.use_eagle)
            mask = self.reachable_block_mask(num_cached, num_full, retention_interval, kept)
            self.block_pool.cache_full_blocks(request, self._blocks_of(rid), num_cached,
                                              num_full, self.block_size,
                                              self.kv_cache_group_id, mask)
            self.num_cached_block[rid] = num_full
        return num_cached, num_full

    def _cache_full_blocks(self, request: Request, num_tokens: int, retention: int | None,
                           boundaries: Sequence[int] | None) -> None:
        """Full attention: its full blocks, and (0.26.0+) the prompt's tail."""
        self._key_full_blocks(request, num_tokens, retention, boundaries)
        self.profile.rules.partial_prompt_tail_entries(self, request, num_tokens)

    def _cache_states(self, request: Request, *args: Any) -> None:
        """Mamba: its full blocks, remembering the keys cached this step."""
        self._cached_this_step(request.request_id, *self._key_full_blocks(request, *args), None)

    def _cache_align_states(self, request: Request, num_tokens: int,
                            retention_interval: int | None, *args: Any) -> None:
        """Mamba 'align': its full blocks and its state (``_align_cache_state``),
        remembering the keys cached this step and offering the states."""
        cached = self._key_full_blocks(request, num_tokens, retention_interval, *args)
        self._align_cache_state(request, num_tokens, retention_interval)
        align = self.align
        assert align is not None
        self._cached_this_step(request.request_id, *cached,
                               align.offers if align.offers_boundary_states else None)

    def _cached_this_step(self, rid: str, num_cached: int, num_full: int,
                          offers: list[tuple[str, int, int, int]] | None) -> None:
        """Remember the keys of blocks ``[num_cached, num_full)`` (not a hit before the
        next step, ``new_step_starts``); offer each state to ``offers`` if given."""
        if num_full <= num_cached:
            return
        for block_id in self.req_to_blocks[rid][num_cached:num_full]:
            if (key := self.block_pool.block_hash.get(block_id)) is not None:
                self.cached_blocks_this_step.add(key)
                if offers is not None:
                    offers.append((rid, self.kv_cache_group_id, block_id,
                                   self.block_pool.hash_num_tokens[block_id]))

    def _refuse_caching(self, *args: Any) -> None:
        raise ValueError("cross-attention blocks are never cached")

    def _publish_when_ready(self, request: Request, num_tokens: int,
                            retention_interval: int | None, boundaries: Any) -> None:
        """The HiSparse source: its coordinator caches once the host copies last."""
        self._bound_coordinator().publish_when_ready(
            request, num_tokens, retention_interval, replay_boundaries=boundaries)

    def cache_prompt_tail(self, request: Request, num_tokens: int) -> None:
        """partial_prompt_tail_entries: key the block holding the prompt's last hash
        boundary (prompt_tail_before_last_token: all but its last token, EAGLE all)
        inside it, within ``num_tokens``."""
        hbs = self.block_pool.hash_block_size
        if self.block_size == hbs:
            return
        limit = request.num_prompt_tokens - self.profile.rules.prompt_tail_before_last_token(
            self.use_eagle)
        boundary = min(limit // hbs, len(self.block_pool.block_hashes(request))) * hbs
        blocks = self._blocks_of(request.request_id)
        if (0 < boundary <= num_tokens and boundary % self.block_size
                and boundary // self.block_size < len(blocks)):
            self.block_pool.cache_partial_block(request, blocks[boundary // self.block_size],
                                                boundary, self.kv_cache_group_id, self.block_size)

    def reachable_block_mask(self, start_block: int, end_block: int,
                             retention_interval: int | None = None,
                             boundaries: Sequence[int] = ()) -> list[bool] | None:
        """Which of the blocks to cache a hit can ever use (None: all; ``cache_mask``),
        fewer with a retention interval, keeping what a replay from ``boundaries`` reads."""
        if self.rules.cache_mask is None:
            return None
        return self.rules.cache_mask(self.kv_cache_spec, start_block, end_block,
                                     self.block_size,
                                     self.profile.rules.cache_mask_hit_alignment(self),
                                     retention_interval, boundaries, self.use_eagle)

    # ------------------------------------------------------------ free

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forget the request; its blocks in allocation order, still referenced (the
        row's ``release``)."""
        return self.rules.release(self, request_id)

    def _release_table(self, request_id: str) -> list[int]:
        """Forget the request's table, cached count and pending copy; its blocks."""
        self.num_cached_block.pop(request_id, None)
        self.partial_hit_reqs.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def _release_align(self, request_id: str) -> list[int]:
        assert self.align is not None
        self.align.forget(request_id)
        return self._release_table(request_id)

    def _release_host(self, request_id: str) -> list[int]:
        self._bound_coordinator().free(request_id)
        return self._release_table(request_id)

    def _release_hot_region(self, request_id: str) -> list[int]:
        self.hot_required.discard(request_id)
        return self._release_table(request_id)

    def _release_pages(self, request_id: str) -> list[int]:
        """A resident group: its residency row without the leading nulls."""
        self._bound_coordinator().free(request_id)
        row = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        self._release_table(request_id)
        return row[next((i for i, b in enumerate(row) if b != NULL_BLOCK), len(row)):]

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first, so tails are evicted before heads."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Full attention: leading blocks whose ref count equals the number of tables
        (empty ones count); other kinds share none."""
        if not self.rules.common_prefix:
            return 0
        blocks = self._blocks_of(running_request_id)  # may add a table: count them after
        num_tables = len(self.req_to_blocks)
        return next((i for i, b in enumerate(blocks) if self.block_pool.ref_cnt[b] != num_tables),
                    len(blocks))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks attention no longer reads, tail first, leaving nulls (the
        row's ``drop_skipped``; R-SWA needs the prompt length)."""
        self.rules.drop_skipped(self, request_id, total_computed_tokens, num_prompt_tokens)

    def _free_skipped_prefix(self, request_id: str, total_computed_tokens: int,
                             num_prompt_tokens: int | None = None) -> None:
        """Free the skipped blocks still live, tail first, leaving nulls."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self._blocks_of(request_id)
        # The scan stops at a null: the rest was nulled by an earlier call.
        start, stop = pure.skipped_blocks_to_free(blocks, NULL_BLOCK,
                                                  num_skipped_tokens // self.block_size)
        self._null_out(blocks, start, stop)

    def _less_drafts(self, total_computed_tokens: int) -> int:
        """The tokens Mamba frees by (0.25.1: less the speculative block count, for
        rejected drafts; ``mamba_frees_processed_states``)."""
        return self.profile.rules.mamba_frees_processed_states.free_by(
            total_computed_tokens, self.num_speculative_blocks)

    def _null_out(self, blocks: list[int], start: int, stop: int) -> None:
        """Free ``blocks[start:stop]`` right to left and null them."""
        freed = blocks[start:stop][::-1]
        blocks[start:stop] = [NULL_BLOCK] * (stop - start)
        if freed:
            self.block_pool.free_blocks(freed)

    def _free_rswa_gap(self, request_id: str, total_computed_tokens: int,
                       num_prompt_tokens: int | None) -> None:
        """R-SWA: free the live blocks wholly between the prompt's last block and the
        decode window (the last ``rswa_window`` computed tokens); an unknown request or
        a missing prompt length frees nothing (and adds no table)."""
        if num_prompt_tokens is None or request_id not in self.req_to_blocks:
            return
        blocks = self.req_to_blocks[request_id]
        first, last = pure.rswa_gap_blocks(num_prompt_tokens, total_computed_tokens,
                                           self.kv_cache_spec.rswa_window, self.block_size)
        # The scan stops at a null: the rest of the gap was nulled by an earlier call.
        start, stop = pure.gap_blocks_to_free(blocks, NULL_BLOCK, first, last)
        self._null_out(blocks, start, stop)

    def new_step_starts(self) -> None:
        """A scheduler step begins: states cached in the last step are complete now."""
        self.cached_blocks_this_step.clear()

    def check_invariants(self, nulls_only_leading: bool = True) -> None:
        """Assert the invariants of the class docstring (the row's ``check``)."""
        self.rules.check(self, nulls_only_leading)

    def _check_tables(self, nulls_only_leading: bool) -> None:
        assert self.num_cached_block.keys() <= self.req_to_blocks.keys()
        for rid, ids in self.req_to_blocks.items():
            held = [b for b in ids if b != NULL_BLOCK]
            assert len(set(held)) == len(held), f"{rid!r} holds a block twice: {ids}"
            num_leading_nulls = next((i for i, b in enumerate(ids) if b != NULL_BLOCK), len(ids))
            assert not nulls_only_leading or len(held) == len(ids) - num_leading_nulls, (
                f"{rid!r} has a null block after a live one: {ids}")

    def _check_residency(self, nulls_only_leading: bool) -> None:
        assert self.num_cached_block.keys() <= self.req_to_blocks.keys()
        assert self.residency_changes.keys() <= self.req_to_blocks.keys()

    # ------------------------------------------------------------ Mamba 'align' mode

    def _num_align_blocks(self, request_id: str, num_tokens: int,
                          new_computed_blocks: Sequence[int], total_computed_tokens: int,
                          apply_admission_cap: bool, num_local_computed_tokens: int,
                          num_tokens_main_model: int, prefill_end: int) -> int:
        """Only the running state block plus speculative blocks (lookahead tokens would
        break the alignment); one more for the copy of a state ending inside its block
        (a hit, or the request's own prompt-tail entry; ``partial_hit_copy_on_write``)
        and for a prefill checkpoint (``_checkpoint_position``; recorded unless this is
        the admission estimate, ``apply_admission_cap``). A hit on a state cached this
        step waits."""
        if self._waits_for_state(new_computed_blocks):
            return self.block_pool.num_gpu_blocks + 1
        align, num_spec, rules = self.align, self.num_speculative_blocks, self.profile.rules
        assert align is not None
        allocated = request_id in align.allocated
        num_held = len(self._blocks_of(request_id))
        position = self._checkpoint_position(request_id, total_computed_tokens,
                                             num_tokens_main_model, prefill_end)
        checkpoint = 1 if position > 0 else 0
        if not apply_admission_cap:
            if checkpoint:
                index = cdiv(num_tokens_main_model, self.block_size) - 2
                align.checkpoints[request_id] = (position, index)
            else:
                align.checkpoints.pop(request_id, None)
        copy = request_id in self.partial_hit_reqs or self._ends_inside_block(
            new_computed_blocks, num_local_computed_tokens)
        num_new = pure.mamba_align_num_new_blocks(
            num_tokens_main_model, self.block_size, num_spec, len(new_computed_blocks),
            num_held, allocated, copy, checkpoint, rules.mamba_caps_new_state_blocks,
            not rules.mamba_checkpoint_relocates_speculative)
        return num_new + self._num_evictable(new_computed_blocks)

    def _checkpoint_position(self, request_id: str, start: int, end: int, prefill_end: int
                             ) -> int:
        """Where the chunk computing tokens ``[start, end)`` leaves a prefill checkpoint
        (0: none): with checkpoint blocks, for a chunk reaching ``prefill_end`` (0 unless
        retention keeps only the latest state; ``mamba_checkpoint_at_prefill_end``), the
        last reusable boundary before ``end`` (``_checkpoint_boundary``) if the layer can export it
        (``pure.mamba_checkpoint_exportable``) into a free column: the block before the
        chunk's last, not in the table yet, null, or a running request's speculative one."""
        align = self.align
        assert align is not None
        if (not align.has_checkpoint_blocks
                or not self.profile.rules.mamba_checkpoint_at_prefill_end(end, prefill_end)):
            return 0
        position = self._checkpoint_boundary(end)
        if not pure.mamba_checkpoint_exportable(start, end, position,
                                                self.block_pool.hash_block_size,
                                                self.block_size, align.checkpoint_alignment):
            return 0
        column = cdiv(end, self.block_size) - 2
        blocks = self._blocks_of(request_id)
        free_column = (column >= len(blocks) or blocks[column] == NULL_BLOCK
                       or (request_id in align.allocated
                           and column >= len(blocks) - self.num_speculative_blocks))
        return position if column >= 0 and free_column else 0

    def _checkpoint_boundary(self, num_tokens: int) -> int:
        """Where a prefill checkpoint of ``num_tokens`` (a chunk's end, or the prompt)
        sits: the release's boundary rule (``mamba_checkpoint_eagle_whole_prompt``) at
        its alignment (``mamba_checkpoint_hit_alignment``), EAGLE's drop included."""
        rules, align = self.profile.rules, self.align
        assert align is not None
        return rules.mamba_checkpoint_eagle_whole_prompt(
            num_tokens, rules.mamba_checkpoint_hit_alignment(self), align.drops_eagle,
            self.block_pool.num_hash_lookahead_tokens)

    def checkpoint_retained(self, position: int, retention_interval: int | None) -> bool:
        """Whether the retention mask keeps a state ending at ``position`` (a block
        boundary only)."""
        if position % self.block_size:
            return False
        state = position // self.block_size - 1  # the block whose state ends there
        mask = self.reachable_block_mask(state, state + 1, retention_interval)
        return mask is None or mask[0]

    def _grow_align(self, request_id: str, _: int, num_tokens_main_model: int) -> list[int]:
        """Nulls up to the new state block, last step's speculative blocks moved up, and
        the blocks after it. A pending partial state gets a copy: in place of a new
        request's hit block, or (a running request's prompt-tail entry) the entry moves
        onto it, hittable from the next step, while the request keeps its block. A
        recorded prefill checkpoint keeps its column a real block (not nulled, no
        speculative block moved off it, a new one if needed, even in a long table;
        before ``mamba_checkpoint_relocates_speculative`` the step moves none and
        takes fresh speculative blocks)."""
        align, num_spec = self.align, self.num_speculative_blocks
        assert align is not None
        req_blocks = self._blocks_of(request_id)
        num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
        num_held = len(req_blocks)
        partial = self.partial_hit_reqs.pop(request_id, None)
        checkpoint = 1 if request_id in align.checkpoints else 0
        if num_required <= num_held and partial is None and not checkpoint:
            if self.profile.rules.mamba_frees_processed_states.held_counts_as_allocated:
                align.allocated.add(request_id)
            return []
        allocated_before = request_id in align.allocated
        if allocated_before:
            align.last_state_block_idx[request_id] = num_held - 1 - num_spec
        elif num_held > 0:  # the last block holds the hit's state
            align.last_state_block_idx[request_id] = num_held - 1
        num_nulled = num_required - num_spec - 1 - checkpoint  # a checkpoint's column stays
        req_blocks.extend([NULL_BLOCK] * (num_nulled - num_held))
        # a checkpoint step takes fresh speculative blocks before 0.32.0
        fresh_spec = not allocated_before or bool(
            checkpoint and not self.profile.rules.mamba_checkpoint_relocates_speculative)
        if not fresh_spec:
            for i in range(num_held - num_spec, min(num_held, num_nulled)):
                req_blocks.append(req_blocks[i])
                req_blocks[i] = NULL_BLOCK
        num_new = max(num_required - len(req_blocks), 0)
        if num_new > 1 + checkpoint + (num_spec if fresh_spec else 0):
            raise ValueError(f"request_id={request_id!r} would get {num_new} new Mamba blocks")
        returned = req_blocks[num_held:]
        new_ids = self.block_pool.get_new_blocks(num_new + (partial is not None))
        if partial is not None:
            (index, source), copy = partial, new_ids.pop(0)
            if allocated_before:
                self.block_pool.move_block_hashes(source, copy)
                self.pending_copies.append((source, copy))
                self.block_pool.ref_cnt[source] += 1
                if (tail := align.producer_tails.pop(request_id, None)) is not None:
                    # the request's own prompt-tail state lives on in the copy
                    align.offers.append((request_id, self.kv_cache_group_id, copy, tail[1]))
                if (key := self.block_pool.block_hash.get(copy)) is not None:
                    self.cached_blocks_this_step.add(key)  # filled by this step's copy
            else:
                self._copy_hit_block(request_id, index, source, copy)
                returned.insert(0, copy)
        req_blocks.extend(new_ids)
        align.allocated.add(request_id)
        return returned + new_ids

    def _align_cache_state(self, request: Request, num_tokens: int,
                           retention_interval: int | None) -> None:
        """Key (or unkey) a prefill checkpoint (``_cache_checkpoint``); else, under
        the release's prompt-tail rule (``MambaTail``: ``mamba_prompt_tail_state``, else
        ``mamba_partial_prompt_tail``), key the state block at the prompt's tail when
        caching reaches exactly there and it is not keyed there yet (e.g. after
        ``evict_blocks``); EAGLE's drop follows the group's eagle bit or, under
        ``mamba_tail_engine_eagle``, the engine's."""
        align, rid, pool = self.align, request.request_id, self.block_pool
        assert align is not None
        if rid in align.checkpoints:
            key = self._cache_checkpoint(request, retention_interval, num_tokens)
            if key is not None:
                self.cached_blocks_this_step.add(key)
            return
        rules = self.profile.rules
        inside = num_tokens % self.block_size != 0
        tail = rules.mamba_prompt_tail_state or rules.mamba_partial_prompt_tail
        if tail is None or num_tokens <= 0 or not (inside or not tail.inside_only):
            return
        eagle = rules.mamba_tail_engine_eagle(align.drops_eagle,
                                              rules.mamba_eagle_state_drop(self.use_eagle))
        if ((inside and not rules.partial_hit_copy_on_write(num_tokens, self.block_size))
                or num_tokens != tail.boundary(request.num_prompt_tokens, pool.hash_block_size,
                                               eagle, pool.num_hash_lookahead_tokens)):
            return
        blocks = self._blocks_of(rid)
        idx = cdiv(num_tokens, self.block_size) - 1
        if (idx < len(blocks) and blocks[idx] != NULL_BLOCK
                and pool.hash_num_tokens.get(blocks[idx]) != num_tokens):
            key = pool.cache_partial_block(request, blocks[idx], num_tokens,
                                           self.kv_cache_group_id, self.block_size,
                                           any_boundary=True)
            if key is not None:
                self.cached_blocks_this_step.add(key)
            if key is not None and inside:  # the next allocation moves it to a copy
                self.partial_hit_reqs[rid] = (idx, blocks[idx])
                self.num_cached_block[rid] = idx
                if align.offers_boundary_states:
                    align.producer_tails[rid] = (blocks[idx], num_tokens)

    def _cache_checkpoint(self, request: Request, retention_interval: int | None,
                          num_tokens: int) -> bytes | None:
        """Key the checkpoint block at its position, dropping its other keys (it holds
        that state now), unless the release's rule calls it transient
        (``mamba_checkpoint_retention_mask``; the prompt's own checkpoint,
        ``mamba_prompt_checkpoint_kept``, and the request's ``shared_prefix_boundary``
        never are): then unkey it (the running state overwrites it). The new key, or
        None."""
        align, rules = self.align, self.profile.rules
        assert align is not None
        position, index = align.checkpoints[request.request_id]
        blocks = self._blocks_of(request.request_id)
        assert 0 <= index < len(blocks), (request.request_id, index, len(blocks))
        block = blocks[index]
        kept = rules.mamba_prompt_checkpoint_kept and position == self._checkpoint_boundary(
            request.num_prompt_tokens)
        if position != getattr(request, "shared_prefix_boundary", 0) and (
                rules.mamba_checkpoint_retention_mask(
                    self, position, retention_interval,
                    num_tokens < request.num_prompt_tokens, kept)):
            self.block_pool._maybe_evict_cached_block(block)
            return None
        if self.block_pool.hash_num_tokens.get(block) == position:
            return None
        return self.block_pool.cache_partial_block(
            request, block, position, self.kv_cache_group_id, self.block_size,
            any_boundary=True, replace=True)

    def take_boundary_state_offers(self) -> list[tuple[str, int, int, int]]:
        """Drain the offered states: (request, group, block, tokens its key covers)."""
        if self.align is None:
            return []
        offers, self.align.offers = self.align.offers, []
        return offers

    def finalize_partial_tail(self, request_id: str, num_computed_tokens: int,
                              num_in_flight_tokens: int) -> tuple[int, int, int] | None:
        """A finishing request's own prompt-tail state inside a block, (group, block,
        tokens), once, if no later token was computed into its block (nothing in
        flight, the computed tokens at the tail); else None."""
        tail = None if self.align is None else self.align.producer_tails.pop(request_id, None)
        if tail is None or num_in_flight_tokens != 0 or num_computed_tokens != tail[1]:
            return None
        return self.kv_cache_group_id, tail[0], tail[1]

    def _free_align_states(self, request_id: str, total_computed_tokens: int,
                           num_prompt_tokens: int | None) -> None:
        """Free the skipped states (``_less_drafts``; 0.33.0: every live state before
        the latest that an earlier call has not retired, right to left, past null
        gaps), then the previous step's state block once passed."""
        align = self.align
        assert align is not None
        total_computed_tokens = self._less_drafts(total_computed_tokens)
        if not self.profile.rules.mamba_frees_processed_states.retires_past_nulls:
            self._free_skipped_prefix(request_id, total_computed_tokens)
        elif (num_skipped := self.get_num_skipped_tokens(total_computed_tokens)) > 0:
            blocks = self._blocks_of(request_id)
            stop = min(num_skipped // self.block_size, len(blocks))
            start = align.num_retired_blocks.get(request_id, 0)
            if start < stop:
                freed = [b for b in blocks[start:stop][::-1] if b != NULL_BLOCK]
                blocks[start:stop] = [NULL_BLOCK] * (stop - start)
                if freed:
                    self.block_pool.free_blocks(freed)
                align.num_retired_blocks[request_id] = stop
        idx = align.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(total_computed_tokens, self.block_size) - 1:
            blocks = self._blocks_of(request_id)
            if blocks[idx] != NULL_BLOCK:
                self.block_pool.free_blocks([blocks[idx]])
                blocks[idx] = NULL_BLOCK

    # ------------------------------------------------------------ HiSparse (vLLM 0.33.0)
    # A source group (full attention, role "hisparse_source") in a host pool of its own
    # (``bind_host_pool``), resident groups (the pages a request reads from the device)
    # and hot groups (a region a request takes to read host-only pages). vLLM's
    # HiSparseCoordinator (not modelled) binds itself as their ``coordinator``.

    def _bound_coordinator(self) -> Any:
        """The HiSparse coordinator; RuntimeError if none is bound yet."""
        if self.coordinator is None:
            raise RuntimeError(f"{self.rules.name} (group {self.kv_cache_group_id}) has no "
                               "HiSparse coordinator bound")
        return self.coordinator

    def bind_host_pool(self, num_blocks: int) -> None:
        """The source: use a new host pool of ``num_blocks`` blocks (medium CPU, caching
        as the group, hashing as the device pool, events into the device pool's queue)."""
        device = self.block_pool
        host = BlockPool(num_blocks, self.enable_caching and cacheable(self.kv_cache_spec),
                         device.hash_block_size, device.enable_kv_cache_events,
                         medium=MEDIUM_CPU, profile=device.profile,
                         num_hash_lookahead_tokens=device.num_hash_lookahead_tokens)
        host.hash_fn, host.none_hash = device.hash_fn, device.none_hash
        host.share_event_queue(device)
        self.block_pool = host

    def take_host_cow_copies(self) -> list[tuple[int, int]]:
        """Drain the (source, copy) pairs: the source's host pairs (others: ``take_copies``)."""
        pending, self.pending_copies = self.pending_copies, []
        return pending

    def publish_blocks(self, request: Request, num_tokens: int,
                       retention_interval: int | None = None,
                       replay_boundaries: Sequence[int] | None = None) -> None:
        """The source: cache as full attention does (once the host copies last)."""
        self._cache_full_blocks(request, num_tokens, retention_interval, replay_boundaries)

    def require_hot(self, request_id: str) -> None:
        """A hot group: the request gets its region at its next allocation."""
        self.hot_required.add(request_id)

    def has_hot(self, request_id: str) -> bool:
        """A hot group: whether the request holds its whole region."""
        return len(self.req_to_blocks.get(request_id, [])) == self.blocks_per_request

    def _num_hot_blocks(self, request_id: str, num_tokens: int, hits: Sequence[int], total: int,
                        cap: bool, local: int, *args: Any) -> int:
        """The missing region if the request needs it now (an import, a new request with
        a local hit, or ``require_hot``), else 0."""
        check_no_hits(request_id, hits)
        imports = total > local
        new_with_hit = local > 0 and request_id not in self.num_cached_block
        if imports or new_with_hit or request_id in self.hot_required:
            return max(self.blocks_per_request - len(self.req_to_blocks.get(request_id, [])), 0)
        return 0

    def _num_resident_blocks(self, request_id: str, num_tokens: int, hits: Sequence[int],
                             total: int, cap: bool, local: int, *args: Any) -> int:
        """Device pages still needed for ``num_tokens``: with an import, its last page
        (if not resident) and the pages past it; else the pages past the host prefix
        and the table (at most the window's under the admission cap)."""
        check_no_hits(request_id, hits)
        num_pages = len(self.req_to_blocks.get(request_id, []))
        needed = cdiv(num_tokens, self.block_size)
        if total > local:
            imported = cdiv(total, self.block_size)
            tail = self.get_resident_page(request_id, imported - 1) is None
            return int(tail) + max(needed - max(imported, num_pages), 0)
        if cap:
            needed = min(needed, self.window)
        return max(needed - max(num_pages, cdiv(local, self.block_size)), 0)

    def _admit_hot(self, request_id: str, hits: Sequence[int], local: int, *args: Any) -> None:
        """A hot group admits the request (a local hit, or no resident group, needs
        the region)."""
        check_no_hits(request_id, hits)
        self._blocks_of(request_id)
        self.num_cached_block[request_id] = 0
        if local > 0 or not self._bound_coordinator().resident_managers:
            self.require_hot(request_id)

    def _adopt_host_prefix(self, request_id: str, hits: Sequence[int], local: int,
                           *args: Any) -> None:
        """A resident group: the host prefix hit becomes host-only pages; the
        coordinator is told."""
        check_no_hits(request_id, hits)
        req_blocks = self._blocks_of(request_id)
        if req_blocks:
            raise ValueError(f"request_id={request_id!r} already holds pages {req_blocks}")
        num_pages = cdiv(local, self.block_size)
        req_blocks.extend([NULL_BLOCK] * num_pages)
        self.num_cached_block[request_id] = 0
        self._bound_coordinator().commit_computed_blocks(request_id, num_pages)

    def _resident_import(self, request_id: str, num_local_computed_tokens: int,
                         num_external_computed_tokens: int, record_for_zeroing: bool) -> None:
        """Imported pages stay host-only but the last, which gets a writable block
        unless it is resident."""
        if num_external_computed_tokens <= 0:
            raise ValueError(f"num_external_computed_tokens={num_external_computed_tokens}: "
                             "an import needs tokens")
        req_blocks = self._blocks_of(request_id)
        last = (num_local_computed_tokens + num_external_computed_tokens - 1) // self.block_size
        req_blocks.extend([NULL_BLOCK] * (last + 1 - len(req_blocks)))
        if self.get_resident_page(request_id, last) is None:
            req_blocks[last] = self.block_pool.get_new_blocks(1)[0]

    def adopt_resident_page(self, request_id: str, page: int, block: int) -> bool:
        """Read host-only ``page`` from ``block`` from now on; False (no change) past
        the table or if the page is resident."""
        if (page >= len(self.req_to_blocks.get(request_id, []))
                or self.get_resident_page(request_id, page) is not None):
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
        return None if page >= len(row) or row[page] == NULL_BLOCK else row[page]

    def get_residency_row(self, request_id: str, start: int = 0) -> list[int]:
        """The pages from ``start``, changes applied (host-only: the null block)."""
        changes = self.residency_changes.get(request_id, {})
        table = self.req_to_blocks.get(request_id, [])
        return [changes.get(page, table[page]) for page in range(start, len(table))]


M = SingleTypeKVCacheManager  # the rows' steps are its methods


@dataclass(frozen=True)
class KindRules:
    """One group kind: a row of ``KINDS``. ``name``: vLLM's manager class; ``resume``:
    its row in ``spec.effectiveness.KINDS`` (None: not judged); ``skipped_tokens(spec,
    n)``: the leading tokens no longer read once ``n`` are computed; ``hit``: its hit
    search (None: refuses prefix caching); ``fine_hit``: hits ending inside a block;
    ``cache_mask``: the blocks caching keys (None: all); ``common_prefix``: blocks all
    requests hold count as a common prefix; ``encoder``: sized by the encoder tokens;
    ``retains_longer_hit``: HiSparse's source, whose hit outlives the common hit. The
    rest: the flow's rules, manager methods (default: full attention's), each called
    by the public method of its step (``setup``: the constructor)."""

    name: str
    resume: str | None
    skipped_tokens: Callable[[KVCacheSpec, int], int]
    hit: HitSearch | None
    fine_hit: FineHitSearch | None = None
    cache_mask: CacheMask | None = None
    common_prefix: bool = False
    encoder: bool = False
    retains_longer_hit: bool = False
    setup: Callable[[M, bool], None] = M._nothing
    num_blocks: Callable[[M, str, int, Sequence[int], int, bool, int, int, int], int] = (
        M._num_table_blocks)
    adopt: Callable[[M, str, Sequence[int], int, int], None] = M._adopt_hits
    load: Callable[[M, str, int, int, bool], object] = M._load_blocks
    grow: Callable[[M, str, int, int], list[int]] = M._grow_table
    take_copies: Callable[[M], list[tuple[int, int]]] = M.take_host_cow_copies
    take_ids: Callable[[M], list[int]] = M._drain_ids
    cache: Callable[[M, Request, int, int | None, Sequence[int] | None], object] = (
        M._cache_full_blocks)
    release: Callable[[M, str], list[int]] = M._release_table
    drop_skipped: Callable[[M, str, int, int | None], None] = M._nothing  # nothing skipped
    check: Callable[[M, bool], None] = M._check_tables

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickled (and copied) as its ``ROWS`` key: a row is one object (``is`` compares)."""
        return row_named, (next(key for key, row in ROWS.items() if row is self),)


def nothing_skipped(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Full attention reads every token."""
    return pure.num_skipped_tokens_full_attention(num_computed_tokens)


def before_window(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Sliding window: the tokens before the next token's window."""
    return pure.num_skipped_tokens_sliding_window(num_computed_tokens, spec.sliding_window)


def before_chunk(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Chunked local attention: the tokens of the chunks before the next token's."""
    return pure.num_skipped_tokens_chunked_local(num_computed_tokens, spec.attention_chunk_size)


def before_last(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Mamba: every token but the last (only the latest state is read)."""
    return pure.num_skipped_tokens_mamba(num_computed_tokens)


FULL = KindRules("FullAttentionManager", "full", nothing_skipped, full_attention_hit,
                 full_attention_fine_hit, common_prefix=True)
RSWA = replace(FULL, name="RSWAManager", resume="rswa", drop_skipped=M._free_rswa_gap,
               check=lambda m, _: m._check_tables(False))  # nulls inside: the gap
SINK = replace(FULL, name="SinkFullAttentionManager", resume="sink", setup=M._reserve_sinks)
RING = replace(FULL, name="CircularBufferManager", resume="circular", fine_hit=None,
               common_prefix=False,  # rewritten in place: nothing shared
               hit=lambda *_: (0, 0),  # outside prefix caching: hits nothing
               num_blocks=lambda m, r, *_: 0 if m.req_to_blocks.get(r) else 1,  # its one block
               adopt=M._nothing, load=M._claim_ring_block, grow=M._claim_ring_block,
               cache=M._nothing)
SLIDING_WINDOW = KindRules("SlidingWindowManager", "sliding_window", before_window,
                           sliding_window_hit, cache_mask=sliding_window_mask,
                           cache=M._key_full_blocks, drop_skipped=M._free_skipped_prefix)
CHUNKED_LOCAL = KindRules("ChunkedLocalAttentionManager", "chunked_local", before_chunk,
                          chunked_local_hit, cache=M._key_full_blocks,
                          drop_skipped=M._free_skipped_prefix)
CROSS = KindRules("CrossAttentionManager", "cross_attention", nothing_skipped, None,
                  encoder=True, adopt=M._refuse_hits, load=M._nothing, cache=M._refuse_caching)
MAMBA = KindRules("MambaManager", "mamba", before_last, mamba_hit, mamba_fine_hit, mamba_mask,
                  setup=M._set_up_states, num_blocks=M._num_state_blocks, cache=M._cache_states,
                  drop_skipped=lambda m, r, n, _: m._free_skipped_prefix(r, m._less_drafts(n)))
MAMBA_ALIGN = replace(MAMBA, setup=M._set_up_align, num_blocks=M._num_align_blocks,
                      grow=M._grow_align, cache=M._cache_align_states, release=M._release_align,
                      drop_skipped=M._free_align_states, check=RSWA.check)
HISPARSE_SOURCE = replace(FULL, name="HiSparseSourceManager", resume=None,
                          retains_longer_hit=True, num_blocks=M._num_host_blocks,
                          load=M._load_host_blocks,
                          take_copies=lambda m: [],  # its coordinator's: take_host_cow_copies
                          take_ids=M._drain_host_ids,
                          cache=M._publish_when_ready, release=M._release_host)
HISPARSE_HOT = KindRules("HiSparseHotManager", None, nothing_skipped, None,
                         setup=M._set_up_hot_region, num_blocks=M._num_hot_blocks,
                         adopt=M._admit_hot, load=lambda m, r, *_: m.require_hot(r),
                         grow=M._grow_hot_region, cache=M._nothing, release=M._release_hot_region)
HISPARSE_RESIDENT = KindRules("HiSparseResidentManager", None, nothing_skipped, None,
                              setup=M._set_up_residency, num_blocks=M._num_resident_blocks,
                              adopt=M._adopt_host_prefix, load=M._resident_import,
                              grow=lambda m, r, n, _: m._extend_to(  # a block per new page
                                  m._blocks_of(r), cdiv(n, m.block_size)),
                              cache=M._nothing, release=M._release_pages,
                              check=M._check_residency)

KINDS: dict[str, KindRules] = {
    "FullAttentionSpec": FULL, "TQFullAttentionSpec": FULL, "MLAAttentionSpec": FULL,
    "HiddenStateCacheSpec": FULL, "RSWASpec": RSWA, "SinkFullAttentionSpec": SINK,
    "CircularBufferSpec": RING, "SlidingWindowSpec": SLIDING_WINDOW,
    "SlidingWindowMLASpec": SLIDING_WINDOW, "ChunkedLocalAttentionSpec": CHUNKED_LOCAL,
    "CrossAttentionSpec": CROSS, "MambaSpec": MAMBA, "HiSparseHotSpec": HISPARSE_HOT,
    "HiSparseResidentSpec": HISPARSE_RESIDENT,
}  # fmt: skip
"""Each modelled layer-spec class's row, by class name (exact class only; ``row_for``
gives a Mamba spec in 'align' mode ``MAMBA_ALIGN``)."""

ROLE_KINDS: dict[str, KindRules] = {"hisparse_source": HISPARSE_SOURCE}
"""vLLM 0.33.0's group roles with a row of their own (before the spec class)."""

ROWS = {name: row for name, row in globals().items() if isinstance(row, KindRules)}
"""Every row, by its name here (``FULL``, ..., ``MAMBA_ALIGN``, ...)."""


def row_named(name: str) -> KindRules:
    """The row called ``name`` in ``ROWS`` (``KindRules.__reduce__``)."""
    return ROWS[name]


def row_for(kv_cache_spec: KVCacheSpec, role: str | None = None) -> KindRules:
    """A group's row: its role's, else its spec class's (Mamba's by mode); KeyError if none."""
    rules = ROLE_KINDS.get(role or "") or KINDS[type(kv_cache_spec).__name__]
    if rules is MAMBA and kv_cache_spec.mamba_cache_mode == "align":
        return MAMBA_ALIGN
    return rules


def find_longest_cache_hit(rules: KindRules, block_hashes: Sequence[bytes], max_length: int,
                           group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                           drop_eagle_block: bool, alignment_tokens: int) -> Hits:
    """Per group, the kind's longest hit of at most ``max_length`` tokens cached in all
    ``group_ids``, aligned, less EAGLE's last block (NotImplementedError: no caching)."""
    if rules.hit is None:
        raise NotImplementedError(f"{rules.name} does not support prefix caching")
    block_hashes = block_hashes[:max(max_length, 0) // kv_cache_spec.block_size]
    first, num_blocks = rules.hit(block_hashes, CachedInAllGroups(pool, group_ids), max_length,
                                  kv_cache_spec, drop_eagle_block, alignment_tokens)
    return hit_blocks(block_hashes, first, num_blocks, group_ids, pool)


def find_fine_grained_hit(rules: KindRules, block_hashes: Sequence[bytes], max_length: int,
                          group_ids: list[int], pool: BlockPool, kv_cache_spec: KVCacheSpec,
                          drop_eagle_block: bool, hash_block_size: int) -> tuple[Hits, int]:
    """A hit that may end inside a block, and its length (``block_hashes`` per hash block)."""
    if rules.fine_hit is None:
        raise NotImplementedError(f"{rules.name} finds no hits inside a block")
    return rules.fine_hit(block_hashes, max_length, group_ids, pool, kv_cache_spec,
                          drop_eagle_block, hash_block_size)


@dataclass
class MambaAlign:
    """Mamba 'align' mode's bookkeeping (the ``align`` of a ``MAMBA_ALIGN`` group):
    ``allocated``: the requests given blocks already; ``last_state_block_idx[r]``: the
    state block of r's previous step, freed once passed; ``num_retired_blocks[r]``:
    how far retiring passed states got (``mamba_frees_processed_states``).
    ``checkpoints[r]``: r's prefill checkpoint (position, block index) for the chunk
    being allocated (``mamba_prefill_checkpoints``: a chunk may leave the state at a
    reusable position inside it in the block before its last). With the same switch
    each state block caching keys is offered to a KV connector (``offers``: request,
    group, block, tokens its key covers) and a request's own prompt-tail state inside
    a block waits in ``producer_tails[r]`` (block, tokens) until it moves to its copy
    or the request ends (``finalize_partial_tail``); a freed request's offers go."""

    drops_eagle: bool  # mamba_eagle_state_drop, with the engine's use_eagle
    has_checkpoint_blocks: bool
    checkpoint_alignment: int | None
    offers_boundary_states: bool
    allocated: set[str] = field(default_factory=set)
    last_state_block_idx: dict[str, int] = field(default_factory=dict)
    num_retired_blocks: dict[str, int] = field(default_factory=dict)
    checkpoints: dict[str, tuple[int, int]] = field(default_factory=dict)
    offers: list[tuple[str, int, int, int]] = field(default_factory=list)
    producer_tails: dict[str, tuple[int, int]] = field(default_factory=dict)

    def forget(self, request_id: str) -> None:
        """Drop the request's bookkeeping and its offers."""
        self.allocated.discard(request_id)
        for table in (self.checkpoints, self.last_state_block_idx, self.num_retired_blocks,
                      self.producer_tails):
            table.pop(request_id, None)
        self.offers = [offer for offer in self.offers if offer[0] != request_id]


def sink_manager(kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, dcp_world_size: int = 1, pcp_world_size: int = 1,
                 **switches: Any) -> SingleTypeKVCacheManager:
    """A sink group's manager, built as vLLM 0.25.1 builds it: ``dcp_world_size`` and
    ``pcp_world_size`` land in the ``scheduler_block_size`` and context parallelism."""
    return SingleTypeKVCacheManager(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id,
                                    dcp_world_size, None, pcp_world_size, **switches)


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int,
                                  max_model_len: int, block_pool: BlockPool, enable_caching: bool,
                                  kv_cache_group_id: int, scheduler_block_size: int,
                                  context_parallel: int = 1, role: str | None = None,
                                  **switches: Any) -> SingleTypeKVCacheManager:
    """The manager of the group's row (``row_for`` its vLLM 0.33.0 role and spec);
    windowed kinds get their admission cap. NotImplementedError for unmodelled specs
    and cross attention with caching; TypeError for a sink group, as in vLLM 0.25.1
    (``sink_manager``). ``switches``: the manager's keyword arguments."""
    try:
        rules = row_for(kv_cache_spec, role)
    except KeyError:
        raise NotImplementedError(f"no spec manager for {type(kv_cache_spec).__name__}") from None
    if rules is SINK:
        # vLLM 0.25.1 passes scheduler_block_size, which the sink constructor lacks.
        raise TypeError("SinkFullAttentionManager.__init__() got an unexpected keyword "
                        "argument 'scheduler_block_size'")
    if rules.encoder and enable_caching:
        raise NotImplementedError("prefix caching with a cross-attention group")
    cap = admission_cap(kv_cache_spec, max_num_batched_tokens, max_model_len)
    return SingleTypeKVCacheManager(
        kv_cache_spec, block_pool, enable_caching, kv_cache_group_id, scheduler_block_size, cap,
        context_parallel, rules=rules, **switches)
