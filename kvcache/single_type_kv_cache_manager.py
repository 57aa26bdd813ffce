"""Per-group managers: the block table of every request for one KV-cache group.

A ``SingleTypeKVCacheManager`` owns ``req_to_blocks`` for its group and knows
the group's attention rule: how many blocks a request needs, which leading
tokens it may skip, and how a prefix hit is searched. New group kinds subclass
it and register in ``get_manager_for_kv_cache_spec``.
"""

from __future__ import annotations

import importlib
import itertools
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from mypy_extensions import mypyc_attr

from kvcache import kv_cache_math
from kvcache.block_pool import BlockPool
from kvcache.kv_cache_interface import (
    HISPARSE_SOURCE_ROLE,
    SPEC_MODULES,
    ChunkedLocalAttentionSpec,
    ContextParallelError,
    HiSparseResidentSpec,
    KVCacheSpec,
    KVCacheSpecValueError,
    MambaSpec,
    SlidingWindowSpec,
    check_world_size,
    is_spec_kind,
    records_blocks_for_zeroing,
    spec_exact_class_name,
)
from kvcache.kv_cache_math import cdiv  # imported, not aliased: a native call when compiled
from kvcache.kv_cache_spec_registry import KVCacheSpecRegistry
from kvcache.kv_cache_utils import (
    BlockHash,
    BlockHashList,
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
)

if TYPE_CHECKING:
    from kvcache.profile import Profile
    from kvcache.request import Request


@mypyc_attr(allow_interpreted_subclasses=True)
class _CachedInAllGroups:
    """Hashes cached in every one of ``kv_cache_group_ids``: the ``cached`` container
    of the hit searches when several groups share a spec."""

    def __init__(self, block_pool: BlockPool, kv_cache_group_ids: list[int]) -> None:
        self._block_pool = block_pool
        self._kv_cache_group_ids = kv_cache_group_ids

    def __contains__(self, block_hash: object) -> bool:
        return (
            self._block_pool.get_cached_block(cast(BlockHash, block_hash), self._kv_cache_group_ids)
            is not None
        )


def _cached_in(block_pool: BlockPool, kv_cache_group_ids: list[int]) -> Any:
    """What the hit searches probe: the group's own hash map for one group (a dict
    lookup), else a view that asks every group."""
    if len(kv_cache_group_ids) == 1:
        return block_pool.get_cached_block_map(kv_cache_group_ids[0])
    return _CachedInAllGroups(block_pool, kv_cache_group_ids)


def _hit_blocks(
    block_hashes: BlockHashList,
    first: int,
    num_blocks: int,
    kv_cache_group_ids: list[int],
    block_pool: BlockPool,
) -> tuple[list[KVCacheBlock], ...]:
    """Per group, the null block before ``first``, then the blocks cached under
    hashes ``[first, num_blocks)`` (a search found them all cached)."""
    null = block_pool.null_block
    if len(kv_cache_group_ids) == 1:
        m = block_pool.get_cached_block_map(kv_cache_group_ids[0])  # hash -> oldest block
        return ([null] * first + [m[block_hashes[i]] for i in range(first, num_blocks)],)
    computed = tuple([null] * first for _ in kv_cache_group_ids)
    for i in range(first, num_blocks):
        cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
        assert cached is not None
        for group_blocks, block in zip(computed, cached, strict=True):
            group_blocks.append(block)
    return computed


def _blocks_at(
    block_pool: BlockPool, block_hash: BlockHash, kv_cache_group_ids: list[int]
) -> list[KVCacheBlock] | None:
    """The block cached under ``block_hash`` in each group (None on any miss)."""
    return block_pool.get_cached_block(block_hash, kv_cache_group_ids)


@mypyc_attr(allow_interpreted_subclasses=True)
class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group over the shared ``BlockPool``.

    State: ``req_to_blocks`` (request id -> blocks, the null block at skipped
    positions) and ``num_cached_block`` (request id -> how many leading blocks
    are already in the prefix cache; set once a request's hits are added).

    NOTE: ``req_to_blocks`` is a ``defaultdict`` as in vLLM, so reading an
    unknown id (``get_num_common_prefix_blocks``, ``allocate_new_blocks``)
    creates an empty entry, which counts as a request in the common-prefix test.

    Args:
        kv_cache_spec: The group's spec.
        block_pool: The shared pool.
        enable_caching: Whether prefix caching is on.
        kv_cache_group_id: The group's index.
        scheduler_block_size: Scheduling granularity (multiple of block_size).
        dcp_world_size: Decode context parallel size (scales ``block_size``).
        pcp_world_size: Prefill context parallel size (scales ``block_size``).
        max_admission_blocks_per_request: Admission cap for groups that recycle
            blocks (None: no cap).
        needs_kv_cache_zeroing: Keyword only (vLLM 0.33.0's argument): whether the
            layout zeroes fresh blocks, which decides with the release whether the
            group reports them (``tracks_new_block_ids``).
        profile: Keyword only: the release whose switches the manager reads, under
            their own names (``kvcache.profile``); None: its pool's release.
    """

    #: Whether the kind finds hits ending inside a block (``find_fine_grained_hit``;
    #: vLLM 0.33.0's name): full attention and its variants, and Mamba.
    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    #: Whether the group keeps a hit longer than the hybrid hit (vLLM 0.33.0's name:
    #: the HiSparse source group, whose host tier outlives the device groups' blocks).
    retains_longer_hit: ClassVar[bool] = False
    #: Whether ``get_num_blocks_to_allocate`` takes vLLM 0.33.0's argument order
    #: (``num_local_computed_tokens`` fifth: the 0.33-only HiSparse kinds, whose
    #: callers are 0.33.0's); the coordinator calls those by that order.
    counts_in_0_33_order: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        *,
        needs_kv_cache_zeroing: bool = False,
        profile: Profile | None = None,
    ) -> None:
        check_world_size("dcp_world_size", dcp_world_size)
        check_world_size("pcp_world_size", pcp_world_size)
        self.kv_cache_spec = kv_cache_spec
        # Each context-parallel rank stores 1/(dcp*pcp) of a block's tokens, so to
        # the manager one block spans block_size * dcp * pcp tokens (as in vLLM).
        self.block_size = kv_cache_spec.block_size * dcp_world_size * pcp_world_size
        self.scheduler_block_size = scheduler_block_size
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self._max_admission_blocks_per_request = max_admission_blocks_per_request
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        # The blocks allocated since the last take_new_block_ids, in order: their
        # ids (``new_block_ids``) are made when asked for (compiled, a block's id
        # is an unboxed int, and boxing it allocates).
        self.new_blocks: list[KVCacheBlock] = []
        self._null_block = block_pool.null_block
        self.use_eagle = False
        # Whether get_num_skipped_tokens is always 0 (lets callers skip the call).
        self.never_skips_tokens = (
            type(self).get_num_skipped_tokens is (SingleTypeKVCacheManager.get_num_skipped_tokens)
            and type(self).remove_skipped_blocks is SingleTypeKVCacheManager.remove_skipped_blocks
        )
        # The release's switches this manager reads, under their names (kvcache.profile):
        # by default the release of the pool it is built over.
        if profile is None:
            profile = block_pool.profile
        self.profile = profile
        self._tracks_new_block_ids = tracks_new_block_ids(
            kv_cache_spec, profile, needs_kv_cache_zeroing
        )
        # Full attention (and its variants) only.
        self.partial_prompt_tail_entries = profile.partial_prompt_tail_entries
        self.prompt_tail_before_last_token = profile.prompt_tail_before_last_token
        # Where hits may end (vLLM 0.33.0's name): the scheduler block, or the hash
        # block under mamba_fine_grained_hits (set by the hybrid coordinator).
        self.cache_hit_alignment_tokens = scheduler_block_size
        # What the cache mask is laid on: the hit alignment, or (before 0.29.0) the
        # scheduler block even under fine-grained hits (cache_mask_hit_alignment).
        self.cache_mask_hit_alignment = profile.cache_mask_hit_alignment
        # A hit ending inside a block is copied on write. Per request, the index and
        # block of the hit's last block until allocate_new_blocks copies it; the
        # (source, copy) pairs until take_pending_cow_copies.
        self.partial_hit_copy_on_write = profile.partial_hit_copy_on_write
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # Under sparse retention also keep the tail before the request's
        # shared_prefix_boundary (vLLM 0.33.0's Request).
        self.shared_prefix_junctions = profile.shared_prefix_junctions
        self.junction_eagle_tail = profile.junction_eagle_tail
        self.cache_within_hashed_tokens = profile.cache_within_hashed_tokens
        self.external_blocks_floor_zero = profile.external_blocks_floor_zero
        # Boundary states handed to a KV connector (vLLM 0.33.0): (request id, group
        # id, block, tokens its state covers), until take_pending_boundary_state_offloads.
        # Only Mamba 'align' under mamba_prefill_checkpoints records any.
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []

    # ------------------------------------------------------------ sizing

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_local_computed_tokens: int = 0,
        prefill_end: int = 0,
    ) -> int:
        """Blocks the pool must supply so the request has ``num_tokens`` slots.

        Counts new blocks past the request's existing and hit blocks, plus hit
        blocks that are currently free (touching them takes them off the free
        queue). Leading blocks the group skips are neither allocated nor touched.

        Args:
            request_id: The request.
            num_tokens: Tokens needing a slot, already-allocated ones included.
            new_computed_blocks: Prefix-hit blocks not yet added to the request.
            total_computed_tokens: Local plus external computed tokens.
            num_tokens_main_model: ``num_tokens`` without lookahead (spec decode).
            apply_admission_cap: Apply the per-request admission cap (admission gate only).
            num_local_computed_tokens: Computed plus hit tokens (vLLM 0.33.0's argument):
                under ``partial_hit_copy_on_write`` a hit ending inside a block needs one
                more block, its copy.
            prefill_end: Where the request's prefill ends (vLLM 0.33.0's argument; 0:
                anywhere): only Mamba prefill checkpoints read it.
        """
        num_required_blocks = kv_cache_math.num_required_blocks(
            num_tokens,
            self.block_size,
            self._max_admission_blocks_per_request if apply_admission_cap else None,
        )
        req_blocks = self.req_to_blocks.get(request_id)
        num_req_blocks = 0 if req_blocks is None else len(req_blocks)
        if request_id in self.num_cached_block:
            # A running request has no new hits; it may even hold more blocks than
            # needed (rejected draft tokens).
            if len(new_computed_blocks):
                raise ValueError(f"request {request_id!r} is running: it cannot take prefix hits")
            return kv_cache_math.num_new_blocks(num_required_blocks, num_req_blocks, 0, 0, True)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new_blocks = kv_cache_math.num_new_blocks(
            num_required_blocks, num_req_blocks, len(new_computed_blocks), num_skipped_blocks, False
        )
        # Skipped hit blocks are never touched, so they do not leave the free queue.
        first_kept = kv_cache_math.num_skipped_hits(num_skipped_blocks, num_req_blocks)
        num_evictable = 0
        for block in new_computed_blocks[first_kept:]:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        if self.partial_hit_copy_on_write and self._has_partial_local_hit(
            new_computed_blocks, num_local_computed_tokens
        ):
            num_new_blocks += 1
        return num_new_blocks + num_evictable

    def _has_partial_local_hit(
        self, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int
    ) -> bool:
        """Whether the hit ends inside one of its blocks (that block needs a copy)."""
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    # ------------------------------------------------------------ allocation

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Give a new request its prefix-hit blocks: touch them, pad skipped
        positions with the null block, and mark them all as already cached."""
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            raise ValueError(f"request {request_id!r} already has blocks; hits come first")
        num_skipped_blocks = (
            self.get_num_skipped_tokens(num_local_computed_tokens + num_external_computed_tokens)
            // self.block_size
        )
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            if new_computed_blocks:
                raise ValueError("new_computed_blocks given while prefix caching is disabled")
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        if self.partial_hit_copy_on_write and self._has_partial_local_hit(
            new_computed_blocks, num_local_computed_tokens
        ):
            # The hit's last block is shared and only partly this request's: the next
            # allocation swaps in a copy, which is cached again once it is full.
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, new_computed_blocks[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Allocate blocks for tokens a KV connector computed (after every group
        touched its hits, so this cannot evict another group's hits).

        ``record_for_zeroing`` False (vLLM 0.33.0's ``skip_zeroing_group_ids``): an
        async load writes the new blocks, so they are not reported for zeroing.
        With ``external_blocks_floor_zero`` a request already holding the blocks
        the computed tokens need (a speculative over-allocation) takes none.
        """
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                num_total - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_total, self.block_size) - len(req_blocks)
        if self.external_blocks_floor_zero and num_new_blocks < 0:
            num_new_blocks = 0
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self._tracks_new_block_ids and record_for_zeroing:
            self.new_blocks.extend(new_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Append fresh blocks until the request has ``num_tokens`` slots.

        Under ``partial_hit_copy_on_write`` a hit that ended inside a block first gets
        that block replaced by a fresh copy (``_copy_partial_hit``).

        Returns:
            The blocks added (possibly none), the copy first.
        """
        copies: list[KVCacheBlock] = []
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            block_idx, source = self._partial_hit_reqs.pop(request_id)
            copy = self.block_pool.get_new_blocks(1)[0]
            self._copy_partial_hit(request_id, block_idx, source, copy)
            self.new_blocks.append(copy)
            copies.append(copy)
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return copies
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self._tracks_new_block_ids:
            self.new_blocks.extend(new_blocks)
        return copies + new_blocks if copies else new_blocks

    def _copy_partial_hit(
        self, request_id: str, block_idx: int, source: KVCacheBlock, copy: KVCacheBlock
    ) -> None:
        """Put ``copy`` in the request's table in place of the hit block ``source``
        and queue the copy. Both stay held until the copy ran: ``source`` keeps the
        request's hit reference, ``copy`` gets one more (``take_pending_cow_copies``
        hands both to the caller, who releases them)."""
        req_blocks = self.req_to_blocks[request_id]
        assert req_blocks[block_idx] is source and source.ref_cnt > 0
        req_blocks[block_idx] = copy
        self._pending_cow_copies.append((source, copy))
        copy.ref_cnt += 1

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Return and clear the (source, copy) block pairs queued since the last call."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """Return and clear the boundary states recorded for a KV connector since the
        last call: ``(request id, group id, block, tokens its state covers)``. The
        blocks are not held for the caller: one reading them later must pin them."""
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """A finishing request's own partial prompt-tail state for a connector, as
        ``(group id, block, tokens)``; None here (only Mamba 'align' has one)."""
        return None

    @property
    def records_new_block_ids(self) -> bool:
        """Whether this group reports its newly allocated block ids (for zeroing)."""
        return self._tracks_new_block_ids

    @property
    def new_block_ids(self) -> list[int]:
        """The ids of the blocks allocated since the last ``take_new_block_ids``.

        A fresh list made from ``new_blocks`` (vLLM keeps the ids themselves):
        appending to it records nothing; record blocks in ``new_blocks``."""
        return [b.block_id for b in self.new_blocks]

    def take_new_block_ids(self) -> list[int]:
        """Return and clear the ids allocated since the last call."""
        ids = self.new_block_ids
        self.new_blocks = []
        return ids

    # ------------------------------------------------------------ caching

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Cache the request's blocks that are full within its first ``num_tokens`` tokens.

        Under sparse retention (``retention_interval`` not None) windowed kinds keep
        the tails before ``replay_boundaries`` (token positions a replay of the prompt
        resumes at, chosen by the coordinator; None: 0.25.1's ``num_prompt_tokens - 1``)
        and, with ``shared_prefix_junctions``, before the request's
        ``shared_prefix_boundary`` (one block lower too for an EAGLE group, with
        ``junction_eagle_tail``)."""
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        if self.cache_within_hashed_tokens:  # a block's hash may wait for its lookahead
            num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
            num_tokens = min(num_tokens, num_hashed_tokens)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        boundaries: Sequence[int] | None = replay_boundaries
        if retention_interval is not None and self.shared_prefix_junctions:
            junction: int = getattr(request, "shared_prefix_boundary", 0) or 0
            if junction:
                if boundaries is None:
                    boundaries = (request.num_prompt_tokens - 1,)
                boundaries = [*boundaries, junction]
                if self.use_eagle and self.junction_eagle_tail:
                    # A sibling diverging right after the junction has no block past
                    # it to drop, so its hit ends one block lower.
                    boundaries.append(junction - self.block_size)
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
            block_mask=self.reachable_block_mask(
                start_block=num_cached_blocks,
                end_block=num_full_blocks,
                alignment_tokens=self.cache_mask_alignment_tokens(),
                kv_cache_spec=self.kv_cache_spec,
                use_eagle=self.use_eagle,
                retention_interval=retention_interval,
                num_prompt_tokens=request.num_prompt_tokens,
                reachable_boundaries=boundaries,
            ),
        )
        self.num_cached_block[request_id] = num_full_blocks

    def cache_mask_alignment_tokens(self) -> int:
        """The alignment the cache mask is laid on: where hits end, or (before 0.29.0,
        ``cache_mask_hit_alignment`` off) the scheduler block even under fine-grained
        hits."""
        if self.cache_mask_hit_alignment:
            return self.cache_hit_alignment_tokens
        return self.scheduler_block_size

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        num_prompt_tokens: int | None = None,
        *,
        reachable_boundaries: Sequence[int] | None = None,
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Which of blocks ``[start_block, end_block)`` can ever serve a hit
        (None: all of them); unreachable blocks are not cached.

        Under sparse retention the windowed kinds keep the tails before each of
        ``reachable_boundaries`` (token positions a replay resumes at; vLLM 0.33.0's
        argument), or, when it is None, before vLLM 0.25.1's one replay boundary
        ``num_prompt_tokens - 1``. ``dcp_world_size`` and ``final_segment_end_block``
        (the end of the request's last segment, for callers that cache ahead of
        prefill) are 0.33.0's; full attention keeps every block whatever they say."""
        return None

    # ------------------------------------------------------------ freeing

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and return its blocks in allocation order, without
        freeing them (the caller frees them, tail first)."""
        self.num_cached_block.pop(request_id, None)
        if self._partial_hit_reqs:
            self._partial_hit_reqs.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first so tails are evicted first.

        NOTE: released before the table entry is dropped (vLLM drops first), so a
        pool failure leaves the blocks owned by the table rather than leaked.
        """
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            self.block_pool.release_blocks(blocks[::-1])
        self.pop_blocks_for_free(request_id)

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the leading blocks no future token attends to (none for full attention)."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        # The removal scans right to left up to the first null block (nothing new
        # to free when the last skipped position is null, the common case).
        start, stop = kv_cache_math.skipped_blocks_to_free(
            blocks, self._null_block, num_skipped_tokens // self.block_size
        )
        if start < stop:
            # Release first, then null out: a pool failure leaks nothing.
            self.block_pool.release_blocks(blocks[start:stop][::-1])
            blocks[start:stop] = [self._null_block] * (stop - start)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future token attends to (0: keep everything)."""
        return 0

    def new_step_starts(self) -> None:
        """Hook called once per scheduler step (no-op by default)."""
        return None

    # ------------------------------------------------------------ per-kind rules

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of ``running_request_id`` shared by every tracked request."""
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Longest cached prefix of at most ``max_length`` tokens, aligned to
        ``alignment_tokens``, common to all ``kv_cache_group_ids``: one block list
        per group (skipped positions hold the null block)."""
        raise NotImplementedError

    @classmethod
    def find_fine_grained_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        hash_block_size: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """A hit that may end inside a block, with its length (``mamba_fine_grained_hits``):
        only full attention and Mamba have one (vLLM 0.33.0's
        ``supports_fine_grained_hash_lookup``)."""
        raise NotImplementedError(f"{cls.__name__} finds no hits inside a block")


@mypyc_attr(allow_interpreted_subclasses=True)
class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every token is attended to, so every block is kept and a
    hit is the longest run of cached leading blocks."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Scan hashes left to right; the chain property makes the first miss final."""
        block_size = kv_cache_spec.block_size * dcp_world_size * pcp_world_size
        max_num_blocks = max_length // block_size
        if len(kv_cache_group_ids) > 1:
            num_blocks = kv_cache_math.full_attention_hit_num_blocks(
                cast(Sequence[BlockHash], block_hashes),
                _CachedInAllGroups(block_pool, kv_cache_group_ids),
                max_num_blocks,
                drop_eagle_block,
                block_size,
                alignment_tokens,
            )
            return _hit_blocks(block_hashes, 0, num_blocks, kv_cache_group_ids, block_pool)
        # One group: the scan of full_attention_hit_num_blocks through the group's
        # own map (hash -> oldest block), one lookup per block, stopping at the
        # first miss (the chain makes every later hash a miss), then its trim.
        m = block_pool.get_cached_block_map(kv_cache_group_ids[0])
        found: list[KVCacheBlock] = []
        for block_hash in itertools.islice(block_hashes, max_num_blocks):
            block = m.get(block_hash)
            if block is None:
                break
            found.append(block)
        if drop_eagle_block or block_size != alignment_tokens:  # else the trim keeps all
            del found[
                kv_cache_math.trim_full_attention_hit(
                    len(found), drop_eagle_block, block_size, alignment_tokens
                ) :
            ]
        return (found,)

    @classmethod
    def find_fine_grained_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        hash_block_size: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """A hit that may end inside a block (``mamba_fine_grained_hits``, blocks larger
        than the hash block): the leading cached blocks, then the longest cached
        hash-block prefix of the next block (a partial entry), at most ``max_length``
        tokens. EAGLE drops one hash block; the block it ends in stays a hit.

        Args:
            block_hashes: The request's hashes at ``hash_block_size`` granularity.

        Returns:
            ``(hit blocks per group, hit length in tokens)``.
        """
        block_size = kv_cache_spec.block_size
        scale = block_size // hash_block_size
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        num_full = min(max_length // block_size, len(block_hashes) // scale)
        for i in range(num_full):
            cached = _blocks_at(block_pool, block_hashes[(i + 1) * scale - 1], kv_cache_group_ids)
            if cached is None:
                break
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        hit_length = len(hits[0]) * block_size
        first = len(hits[0]) * scale
        stop = min(first + scale - 1, max_length // hash_block_size, len(block_hashes))
        for fine_idx in range(stop - 1, first - 1, -1):  # longest partial entry first
            cached = _blocks_at(block_pool, block_hashes[fine_idx], kv_cache_group_ids)
            if cached is not None:
                for group_hits, block in zip(hits, cached, strict=True):
                    group_hits.append(block)
                hit_length = (fine_idx + 1) * hash_block_size
                break
        if drop_eagle_block and hit_length > 0:
            hit_length -= hash_block_size
        num_blocks = cdiv(hit_length, block_size)
        for group_hits in hits:
            del group_hits[num_blocks:]
        return hits, hit_length

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Cache the full blocks, then (``partial_prompt_tail_entries``) the prompt's
        tail that ends inside a block."""
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries)
        if self.partial_prompt_tail_entries:
            self.cache_partial_prompt_tail(request, num_tokens)

    def cache_partial_prompt_tail(self, request: Request, num_tokens: int) -> None:
        """Register the prompt's last hash boundary as a partial entry of the block it
        ends inside (the ``partial_prompt_tail_entries`` switch, for blocks larger
        than the hash block). The boundary is the last one a later lookup of the
        same prompt can reach: ``num_prompt_tokens - 1`` tokens, or the whole
        prompt for an EAGLE group (``prompt_tail_before_last_token``, vLLM 0.32.0;
        before it the whole prompt); nothing when it falls on a block boundary or
        past ``num_tokens``."""
        hash_block_size = self.block_pool.hash_block_size
        if self.block_size == hash_block_size:
            return
        limit = request.num_prompt_tokens
        if self.prompt_tail_before_last_token and not self.use_eagle:
            limit -= 1
        boundary = min(limit // hash_block_size, len(request.block_hashes)) * hash_block_size
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        block_idx = boundary // self.block_size
        if block_idx >= len(blocks):
            return
        self.block_pool.cache_partial_block(
            request, blocks[block_idx], boundary, self.kv_cache_group_id, self.block_size
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks whose ref count equals the number of tracked requests."""
        blocks = self.req_to_blocks[running_request_id]  # may create an entry, as in vLLM
        num_requests = len(self.req_to_blocks)
        num_common = 0
        for block in blocks:
            if block.ref_cnt != num_requests:
                break
            num_common += 1
        return num_common


def _refuse_context_parallel(kind: str, dcp_world_size: int, pcp_world_size: int) -> None:
    """Where vLLM 0.25.1 asserts that a kind's hit search has no context parallelism.

    Raises:
        ContextParallelError: for ``dcp_world_size`` or ``pcp_world_size`` > 1.
    """
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise ContextParallelError(
            f"{kind} prefix-cache lookups do not support context parallelism "
            f"(dcp_world_size={dcp_world_size}, pcp_world_size={pcp_world_size})"
        )


@mypyc_attr(allow_interpreted_subclasses=True)
class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: only the last ``sliding_window`` tokens are
    attended to, so leading blocks become the null block once the window has
    passed them, and a hit needs only the blocks covering the window before the
    hit's end (found by a right-to-left scan)."""

    def __init__(
        self,
        kv_cache_spec: SlidingWindowSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        *,
        needs_kv_cache_zeroing: bool = False,
        profile: Profile | None = None,
    ) -> None:
        # NOTE: explicit arguments, not **kwargs: mypyc-compiled code forwarding
        # **kwargs to super().__init__ passes them wrongly.
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
            needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            profile=profile,
        )
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def _contiguous_blocks_for_hit(cls, window_size: int, block_size: int, use_eagle: bool) -> int:
        """Blocks that must be cached back to back for a hit: those holding the
        ``window_size - 1`` tokens before the next one (+1 for the EAGLE drop)."""
        return kv_cache_math.num_contiguous_blocks_for_hit(window_size, block_size, use_eagle)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Rightmost run of enough cached blocks whose end is aligned; positions
        before the run are the null block. With no full run, the cached run at
        the very start (if any) is the hit.

        Raises:
            ContextParallelError: for ``dcp_world_size`` or ``pcp_world_size`` > 1
                (vLLM 0.25.1 asserts: no context parallelism for sliding windows).
        """
        _refuse_context_parallel("sliding-window", dcp_world_size, pcp_world_size)
        kv_cache_spec = cast(SlidingWindowSpec, kv_cache_spec)
        block_size = kv_cache_spec.block_size
        need = cls._contiguous_blocks_for_hit(
            kv_cache_spec.sliding_window, block_size, drop_eagle_block
        )
        first, num_blocks = kv_cache_math.sliding_window_hit_range(
            cast(Sequence[BlockHash], block_hashes),
            _cached_in(block_pool, kv_cache_group_ids),
            max_length // block_size,
            need,
            drop_eagle_block,
            block_size,
            alignment_tokens,
        )
        return _hit_blocks(block_hashes, first, num_blocks, kv_cache_group_ids, block_pool)

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        num_prompt_tokens: int | None = None,
        *,
        reachable_boundaries: Sequence[int] | None = None,
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """A hit ends on an ``alignment_tokens`` boundary and reads only the
        ``need`` blocks before it (shifted by one with EAGLE), so only those
        tails of each aligned segment are worth caching. With a retention
        interval (not None), only the tails of each ``retention_interval``
        segment (none for 0) and those before each reachable boundary
        (``reachable_boundaries``, else the prompt's replay boundary
        ``num_prompt_tokens - 1``). A block spans ``block_size * dcp_world_size``
        tokens; an alignment finer than that cannot be told apart, so every block
        is kept. Without EAGLE, a request's last, partial segment ending at block
        ``final_segment_end_block`` keeps its tail too."""
        kv_cache_spec = cast(SlidingWindowSpec, kv_cache_spec)
        if alignment_tokens is None:
            return None
        block_size = kv_cache_spec.block_size * dcp_world_size
        if alignment_tokens % block_size != 0:
            return None
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size, use_eagle)
        if retention_interval is None:
            segment_tokens = alignment_tokens
            mask = kv_cache_math.sliding_window_reachable_mask(
                start_block, end_block, need, alignment_tokens // block_size, use_eagle
            )
        else:
            segment_tokens = retention_interval
            if reachable_boundaries is None:
                reachable_boundaries = () if num_prompt_tokens is None else (num_prompt_tokens - 1,)
            mask = kv_cache_math.sliding_window_retention_mask(
                start_block,
                end_block,
                need,
                block_size,
                alignment_tokens,
                retention_interval,
                reachable_boundaries,
                use_eagle,
            )
        if (
            mask is not None
            and segment_tokens
            and final_segment_end_block is not None
            and not use_eagle
        ):
            for i in kv_cache_math.sliding_window_final_segment_tail(
                start_block, end_block, need, segment_tokens // block_size, final_segment_end_block
            ):
                mask[i - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens left of the next token's window: ``computed - window + 1``."""
        return kv_cache_math.num_skipped_tokens_sliding_window(
            num_computed_tokens, self.sliding_window
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: leading positions are null blocks, so cascade attention cannot share them."""
        return 0


@mypyc_attr(allow_interpreted_subclasses=True)
class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: a token sees only its own chunk, so chunks
    before the current one are null blocks, and a hit only needs the cached
    blocks of the chunk it ends in."""

    def __init__(
        self,
        kv_cache_spec: ChunkedLocalAttentionSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        *,
        needs_kv_cache_zeroing: bool = False,
        profile: Profile | None = None,
    ) -> None:
        # NOTE: explicit arguments, not **kwargs: mypyc-compiled code forwarding
        # **kwargs to super().__init__ passes them wrongly.
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
            needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            profile=profile,
        )
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Null blocks up to the chunk holding ``max_length``, then cached blocks
        from there left to right until the first miss."""
        kv_cache_spec = cast(ChunkedLocalAttentionSpec, kv_cache_spec)
        if not drop_eagle_block:  # (vLLM's order of asserts)
            _refuse_context_parallel("chunked local attention", dcp_world_size, pcp_world_size)
        if drop_eagle_block or kv_cache_spec.block_size != alignment_tokens:
            raise NotImplementedError(
                "chunked local attention supports neither EAGLE nor groups of other block sizes"
            )
        first, num_blocks = kv_cache_math.chunked_local_hit_range(
            cast(Sequence[BlockHash], block_hashes),
            _cached_in(block_pool, kv_cache_group_ids),
            max_length,
            kv_cache_spec.attention_chunk_size,
            kv_cache_spec.block_size,
        )
        return _hit_blocks(block_hashes, first, num_blocks, kv_cache_group_ids, block_pool)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the one the next token falls in."""
        return kv_cache_math.num_skipped_tokens_chunked_local(
            num_computed_tokens, self.attention_chunk_size
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: cascade attention does not apply to chunked local attention."""
        return 0


@mypyc_attr(allow_interpreted_subclasses=True)
class MambaManager(SingleTypeKVCacheManager):
    """Mamba state blocks: only the latest state is needed, so everything before
    the last computed token is released; a hit is the rightmost cached state.

    In "align" mode a request holds the running state, the state of the previous
    step (the copy source, freed one step later) and speculative blocks; a state
    cached in the current step cannot be hit by another request until
    ``new_step_starts`` (its KV is written by this step's forward pass).
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        *,
        needs_kv_cache_zeroing: bool = False,
        profile: Profile | None = None,
    ) -> None:
        # NOTE: explicit arguments, not **kwargs: mypyc-compiled code forwarding
        # **kwargs to super().__init__ passes them wrongly.
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
            needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            profile=profile,
        )
        self.cached_blocks_this_step: set[BlockHash] = set()
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self.last_state_block_idx: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()
        # The release's Mamba switches (kvcache.profile).
        profile = self.profile
        self.mamba_frees_processed_states = profile.mamba_frees_processed_states
        self.mamba_caps_new_state_blocks = profile.mamba_caps_new_state_blocks
        self.mamba_partial_prompt_tail = profile.mamba_partial_prompt_tail
        self.mamba_eagle_state_drop = profile.mamba_eagle_state_drop
        self.mamba_tail_engine_eagle = profile.mamba_tail_engine_eagle
        self.mamba_prompt_tail_state = profile.mamba_prompt_tail_state
        # vLLM's name: the prompt-tail state and the prefill checkpoints drop one hash
        # block, as EAGLE's replay does (the engine's use_eagle, with the
        # mamba_eagle_state_drop switch; vLLM's own tests set it directly).
        self.drop_eagle_checkpoint_block = False
        # The mamba_prefill_checkpoints switch, and whether this group takes
        # checkpoints (the switch, 'align' mode and checkpoint blocks in the spec).
        self.mamba_prefill_checkpoints = profile.mamba_prefill_checkpoints
        self.mamba_checkpoint_at_prefill_end = profile.mamba_checkpoint_at_prefill_end
        self.mamba_prompt_checkpoint_kept = profile.mamba_prompt_checkpoint_kept
        self.mamba_checkpoint_hit_alignment = profile.mamba_checkpoint_hit_alignment
        self.mamba_checkpoint_eagle_whole_prompt = profile.mamba_checkpoint_eagle_whole_prompt
        self.mamba_checkpoint_relocates_speculative = (
            profile.mamba_checkpoint_relocates_speculative
        )
        self.mamba_checkpoint_retention_mask = profile.mamba_checkpoint_retention_mask
        self.has_prefill_checkpoint_blocks = (
            self.mamba_prefill_checkpoints
            and self.mamba_cache_mode == "align"
            and getattr(kv_cache_spec, "num_prefill_checkpoint_blocks", 0) > 0
        )
        # Per request: the prefill checkpoint (token position, block index) the last
        # sizing reserved, until the next sizing or the request is freed.
        self._checkpoints: dict[str, tuple[int, int]] = {}
        # Boundary-state offloads (vLLM 0.33.0, with mamba_prefill_checkpoints): record
        # each state this group caches for a KV connector, and per request its own
        # partial prompt-tail state (block, tokens) until a copy or its end hands it on.
        self.offers_boundary_states = (
            self.mamba_prefill_checkpoints and self.mamba_cache_mode == "align"
        )
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}
        # vLLM 0.33.0's enable_mamba_shared_prefix_checkpoint, narrowed by the 0.33
        # drop-in's manager (EAGLE, fine-grained hits, no re-prefilled tail): also key
        # the state at the request's shared_prefix_boundary inside its prompt.
        self.shared_prefix_checkpoint = False
        # Align mode under mamba_frees_processed_states: per request, the block index
        # below which every skipped state has been retired (freed or null).
        self._num_retired_blocks: dict[str, int] = {}

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Rightmost cached state whose end is aligned, preceded by null blocks.

        Raises:
            ContextParallelError: for ``dcp_world_size`` or ``pcp_world_size`` > 1
                (vLLM 0.25.1 asserts).
        """
        _refuse_context_parallel("Mamba", dcp_world_size, pcp_world_size)
        kv_cache_spec = cast(MambaSpec, kv_cache_spec)
        num_blocks = kv_cache_math.mamba_hit_num_blocks(
            cast(Sequence[BlockHash], block_hashes),
            _cached_in(block_pool, kv_cache_group_ids),
            max_length // kv_cache_spec.block_size,
            kv_cache_spec.block_size,
            alignment_tokens,
        )
        first = num_blocks - 1 if num_blocks else 0
        return _hit_blocks(block_hashes, first, num_blocks, kv_cache_group_ids, block_pool)

    @classmethod
    def find_fine_grained_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        hash_block_size: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The rightmost state cached at any hash boundary of at most ``max_length``
        tokens, null blocks before the block holding it (``mamba_fine_grained_hits``;
        no EAGLE drop: draft models have no Mamba layers).

        Returns:
            ``(hit blocks per group, hit length in tokens)``.
        """
        scale = kv_cache_spec.block_size // hash_block_size
        null = block_pool.null_block
        for fine_idx in range(min(max_length // hash_block_size, len(block_hashes)) - 1, -1, -1):
            cached = _blocks_at(block_pool, block_hashes[fine_idx], kv_cache_group_ids)
            if cached is not None:
                nulls = fine_idx // scale
                hits = tuple([null] * nulls + [block] for block in cached)
                return hits, (fine_idx + 1) * hash_block_size
        return tuple([] for _ in kv_cache_group_ids), 0

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        num_prompt_tokens: int | None = None,
        *,
        reachable_boundaries: Sequence[int] | None = None,
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Every state (None) unless a retention interval is set: then the states
        ending on a ``retention_interval`` boundary (none for 0) and those at each
        reachable boundary (``reachable_boundaries``, else the prompt's replay
        boundary ``num_prompt_tokens - 1``). EAGLE does not apply (draft models have
        no Mamba), nor do ``dcp_world_size`` (Mamba state is not sharded) and
        ``final_segment_end_block``."""
        if retention_interval is None or alignment_tokens is None:
            return None
        if reachable_boundaries is None:
            reachable_boundaries = () if num_prompt_tokens is None else (num_prompt_tokens - 1,)
        return kv_cache_math.mamba_retention_mask(
            start_block,
            end_block,
            kv_cache_spec.block_size,
            alignment_tokens,
            retention_interval,
            reachable_boundaries,
        )

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free states before the latest; in align mode also the previous step's state.

        NOTE: as in vLLM 0.25.1, ``num_speculative_blocks`` is subtracted from the
        token count so possibly-rejected draft tokens never free a needed state.
        Under ``mamba_frees_processed_states`` (0.33.0) the caller's count is the
        processed tokens already, nothing is subtracted, and align mode retires
        skipped states past null gaps (``_retire_skipped_states``).
        """
        if self.mamba_frees_processed_states:
            num_computed_tokens = total_computed_tokens
            if self.mamba_cache_mode == "align":
                self._retire_skipped_states(request_id, num_computed_tokens)
            else:
                super().remove_skipped_blocks(request_id, num_computed_tokens, num_prompt_tokens)
        else:
            num_computed_tokens = max(0, total_computed_tokens - self.num_speculative_blocks)
            super().remove_skipped_blocks(request_id, num_computed_tokens, num_prompt_tokens)
        if self.mamba_cache_mode != "align":
            return
        idx = self.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(num_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if blocks[idx] is not self._null_block:
                self.block_pool.release_blocks([blocks[idx]])
                blocks[idx] = self._null_block

    def _retire_skipped_states(self, request_id: str, num_computed_tokens: int) -> None:
        """Align mode under ``mamba_frees_processed_states``: free every live state before
        the latest, from where the last call stopped, right to left, skipping the
        null gaps prefill leaves between states (0.25.1's scan stops at the first
        null), and remember how far the retirement got."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        stop = min(num_skipped_tokens // self.block_size, len(blocks))
        start = self._num_retired_blocks.get(request_id, 0)
        if start >= stop:
            return
        null = self._null_block
        freed = [blocks[i] for i in range(stop - 1, start - 1, -1) if blocks[i] is not null]
        if freed:
            self.block_pool.release_blocks(freed)
            for i in range(start, stop):
                blocks[i] = null
        self._num_retired_blocks[request_id] = stop

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: cascade attention does not apply to Mamba."""
        return 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_local_computed_tokens: int = 0,
        prefill_end: int = 0,
    ) -> int:
        """As the base class, plus speculative blocks; align mode needs at most
        one new state (plus speculative blocks on first prefill), and one more for
        the copy of a state that ends inside its block (``partial_hit_copy_on_write``: a
        hit there, or the request's own prompt-tail entry). A hit on a state
        cached this step reports more blocks than the pool has, deferring the
        request to the next step.

        With prefill checkpoints (``has_prefill_checkpoint_blocks``) the chunk from
        ``total_computed_tokens`` to ``num_tokens_main_model`` may also export a state
        mid-chunk (``_prefill_checkpoint``): one more block is allowed, and outside
        the admission estimate the checkpoint is recorded for ``allocate_new_blocks``
        and ``cache_blocks``."""
        if new_computed_blocks:
            last = new_computed_blocks[-1]
            if last._hash is not None and last._hash in self.cached_blocks_this_step:
                return self.block_pool.num_gpu_blocks + 1
        if self.mamba_cache_mode != "align":
            # NOTE: the spec's block size, as in vLLM 0.25.1: under context
            # parallelism this counts fewer speculative blocks than
            # allocate_new_blocks takes (docs/divergences.md).
            num_tokens += self.kv_cache_spec.block_size * self.num_speculative_blocks
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
                num_local_computed_tokens=num_local_computed_tokens,
                prefill_end=prefill_end,
            )
        # Align mode ignores lookahead slots (draft models have no Mamba layers).
        checkpoint_block = 0
        if self.mamba_prefill_checkpoints:
            position = 0
            if self.has_prefill_checkpoint_blocks:
                position = self._prefill_checkpoint(
                    request_id, total_computed_tokens, num_tokens_main_model, prefill_end
                )
            checkpoint_block = int(position > 0)
            if not apply_admission_cap:
                if position:
                    column = cdiv(num_tokens_main_model, self.block_size) - 2
                    self._checkpoints[request_id] = (position, column)
                elif self._checkpoints:
                    self._checkpoints.pop(request_id, None)
        copy = self.partial_hit_copy_on_write and (
            request_id in self._partial_hit_reqs
            or self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)
        )
        num_new_blocks = kv_cache_math.mamba_align_num_new_blocks(
            num_tokens_main_model,
            self.block_size,
            self.num_speculative_blocks,
            len(new_computed_blocks),
            len(self.req_to_blocks[request_id]),  # may create an entry, as in vLLM
            request_id in self._allocated_block_reqs,
            copy,
            checkpoint_block,
            self.mamba_caps_new_state_blocks,
            not self.mamba_checkpoint_relocates_speculative,
        )
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new_blocks + num_evictable

    def _prefill_checkpoint(
        self, request_id: str, query_start: int, query_end: int, prefill_end: int
    ) -> int:
        """Where the chunk ``[query_start, query_end)`` exports a prefill checkpoint
        (a token position), or 0 for none (vLLM 0.33.0's rules, read from its
        worker's export): the prompt-tail boundary rule applied to the chunk's end
        (``_checkpoint_boundary``); only a chunk reaching ``prefill_end`` (0: any
        chunk; ``mamba_checkpoint_at_prefill_end``, 0.31.0);
        a position the backend can export there (``mamba_prefill_checkpoint_valid``);
        and a column (``cdiv(query_end, block) - 2``, the block before the running
        state) that is past the table, null, or one of the speculative blocks of a
        request allocated before, so the export overwrites no live state."""
        if self.mamba_checkpoint_at_prefill_end and query_end < prefill_end:
            return 0
        position = self._checkpoint_boundary(query_end)
        spec = self.kv_cache_spec
        if not kv_cache_math.mamba_prefill_checkpoint_valid(
            query_start,
            query_end,
            position,
            self.block_pool.hash_block_size,
            self.block_size,
            getattr(spec, "prefill_checkpoint_alignment", None),
        ):
            return 0
        column = cdiv(query_end, self.block_size) - 2
        if column < 0:
            return 0
        blocks = self.req_to_blocks[request_id]
        if (
            column >= len(blocks)
            or blocks[column].is_null
            or (
                request_id in self._allocated_block_reqs
                and column >= len(blocks) - self.num_speculative_blocks
            )
        ):
            return position
        return 0

    def _checkpoint_boundary(self, num_tokens: int) -> int:
        """The reusable boundary a prefill checkpoint of ``num_tokens`` (a chunk's end,
        or the prompt) sits at: the prompt-tail rule (``mamba_prompt_tail_boundary``)
        at the hit alignment (``mamba_checkpoint_hit_alignment``, 0.32.0; before, the
        hash block), with EAGLE one unit lower, the whole of ``num_tokens`` counting
        (``mamba_checkpoint_eagle_whole_prompt``, 0.32.0; before, all but its last
        token)."""
        alignment = (
            self.cache_hit_alignment_tokens
            if self.mamba_checkpoint_hit_alignment
            else self.block_pool.hash_block_size
        )
        eagle = self.drop_eagle_checkpoint_block
        if eagle and not self.mamba_checkpoint_eagle_whole_prompt:
            return max((num_tokens - 1) // alignment * alignment - alignment, 0)
        return kv_cache_math.mamba_prompt_tail_boundary(
            num_tokens, alignment, eagle, self.block_pool.num_hash_lookahead_tokens
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Allocate state blocks. Align mode keeps the running state (and the
        speculative blocks) at the tail, null-pads skipped positions, moves the
        previous speculative blocks forward, and records the previous state's
        index so ``remove_skipped_blocks`` frees it one step later.

        Under ``partial_hit_copy_on_write`` a state ending inside its block also gets a
        fresh copy: a new request's hit block is replaced by it (as the base
        class), while a running request's own prompt-tail entry moves to it (the
        request keeps writing into its block; the copy is hittable next step).

        A prefill checkpoint the sizing reserved (``_checkpoints``) keeps its column a
        real block: the null padding stops one block short of the running state, and
        no speculative block at or past that column moves (none at all, the step
        taking fresh ones, without ``mamba_checkpoint_relocates_speculative``); the
        allocation happens even when the table is long enough."""
        if self.mamba_cache_mode != "align":
            num_tokens += self.block_size * self.num_speculative_blocks
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        req_blocks = self.req_to_blocks[request_id]
        num_spec = self.num_speculative_blocks
        num_required_blocks = cdiv(num_tokens_main_model, self.block_size) + num_spec
        partial = self._partial_hit_reqs.pop(request_id, None) if self._partial_hit_reqs else None
        checkpoint_block = int(bool(self._checkpoints) and request_id in self._checkpoints)
        if num_required_blocks <= len(req_blocks) and partial is None and not checkpoint_block:
            if self.mamba_frees_processed_states:  # 0.33.0: allocated, even with nothing new
                self._allocated_block_reqs.add(request_id)
            return []
        prev_len = len(req_blocks)
        allocated_before = request_id in self._allocated_block_reqs
        if allocated_before:
            self.last_state_block_idx[request_id] = prev_len - 1 - num_spec
        elif prev_len > 0:
            self.last_state_block_idx[request_id] = prev_len - 1  # the hit state
        num_skipped_blocks = num_required_blocks - num_spec - 1
        # The checkpoint's column (just below the running state) stays a real block.
        num_padded = num_skipped_blocks - checkpoint_block
        if prev_len < num_padded:
            req_blocks.extend([self._null_block] * (num_padded - prev_len))
        # A checkpoint step takes fresh speculative blocks up to 0.31.0.
        fresh_spec = not allocated_before or (
            checkpoint_block > 0 and not self.mamba_checkpoint_relocates_speculative
        )
        if not fresh_spec:
            # Reuse last step's speculative blocks instead of allocating new ones.
            for idx in range(prev_len - num_spec, prev_len):
                if idx >= num_padded:
                    break
                self._relocate_speculative_block(req_blocks, idx)
        num_new_blocks = max(num_required_blocks - len(req_blocks), 0)
        max_new_blocks = 1 + checkpoint_block + (num_spec if fresh_spec else 0)
        if partial is None:
            assert num_new_blocks <= max_new_blocks
            req_blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
            self._allocated_block_reqs.add(request_id)
            return req_blocks[prev_len:]
        assert num_new_blocks <= max_new_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks + 1)
        returned = req_blocks[prev_len:]
        block_idx, source = partial
        copy = new_blocks[0]
        if allocated_before:
            assert req_blocks[block_idx] is source
            self.block_pool.move_block_hashes(source, copy)
            self._pending_cow_copies.append((source, copy))
            source.ref_cnt += 1
            tail = (
                self._producer_partial_tail_reqs.pop(request_id, None)
                if self._producer_partial_tail_reqs
                else None
            )
            if tail is not None:
                # The request's own prompt-tail state now lives on in the copy.
                assert tail[0] is source
                self._pending_boundary_state_offloads.append(
                    (request_id, self.kv_cache_group_id, copy, tail[1])
                )
            if copy._hash is not None:
                # Filled by this step's copy: no hit on it before the next step.
                self.cached_blocks_this_step.add(copy._hash)
        else:
            self._copy_partial_hit(request_id, block_idx, source, copy)
            returned.insert(0, copy)
        req_blocks.extend(new_blocks[1:])
        self._allocated_block_reqs.add(request_id)
        returned.extend(new_blocks[1:])
        return returned

    def _relocate_speculative_block(self, req_blocks: list[KVCacheBlock], block_idx: int) -> None:
        """Align mode: move the speculative block at ``block_idx`` to the table's end
        (it becomes the next step's scratch block) and leave the null block in its place.

        Under ``mamba_frees_processed_states`` (0.33.0) the block must be writable by this
        request alone: not the null block, one reference, no hash.

        Raises:
            AssertionError: under ``mamba_frees_processed_states``, the block at
                ``block_idx`` is shared, cached or null (vLLM 0.33.0 asserts).
        """
        block = req_blocks[block_idx]
        if self.mamba_frees_processed_states and (
            block.is_null or block.ref_cnt != 1 or block._hash is not None
        ):
            raise AssertionError(
                f"speculative Mamba block {block.block_id} at index {block_idx} must be "
                f"exclusively owned and unhashed before relocation (ref_cnt={block.ref_cnt}, "
                f"hashed={block._hash is not None}, null={block.is_null})"
            )
        req_blocks.append(block)
        req_blocks[block_idx] = self._null_block

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request, including align-mode bookkeeping."""
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        if self._checkpoints:
            self._checkpoints.pop(request_id, None)
        if self._producer_partial_tail_reqs:
            self._producer_partial_tail_reqs.pop(request_id, None)
        if self._pending_boundary_state_offloads:
            # Its blocks go back to the pool: offers of them would name blocks
            # another request may be handed next.
            self._pending_boundary_state_offloads = [
                entry for entry in self._pending_boundary_state_offloads if entry[0] != request_id
            ]
        return super().pop_blocks_for_free(request_id)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """All but the last computed token: only the latest state is needed."""
        return kv_cache_math.num_skipped_tokens_mamba(num_computed_tokens)

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Cache as the base class and remember states cached in this step; in
        'align' mode key a reserved prefill checkpoint (``_cache_checkpoint_state``)
        or else the prompt-tail state."""
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries)
        after = self.num_cached_block.get(request.request_id, 0)
        if self.mamba_cache_mode == "align" and (
            self.mamba_prompt_tail_state or self.mamba_partial_prompt_tail
        ):
            key = self._cache_partial_tail_block(request, num_tokens, retention_interval)
            if key is not None:
                self.cached_blocks_this_step.add(get_block_hash(key))
        if after <= before:
            return
        offers = self.offers_boundary_states
        for block in self.req_to_blocks[request.request_id][before:after]:
            if not block.is_null and block._hash is not None:
                self.cached_blocks_this_step.add(block._hash)
                if offers:
                    num_state_tokens = block._block_hash_num_tokens
                    assert num_state_tokens is not None
                    self._pending_boundary_state_offloads.append(
                        (request.request_id, self.kv_cache_group_id, block, num_state_tokens)
                    )

    def _cache_partial_tail_block(
        self, request: Request, num_tokens: int, retention_interval: int | None = None
    ) -> BlockHashWithGroupId | None:
        """'align' mode's state keyed off the full-block grid (vLLM 0.33.0's name): the
        prefill checkpoint this step reserved (``_cache_checkpoint_state``), else the
        prompt-tail state or shared-prefix junction (``_cache_prompt_tail_state``).

        Returns:
            The pool key of the entry made, or None."""
        checkpoint = self._checkpoints.get(request.request_id) if self._checkpoints else None
        if checkpoint is not None:
            return self._cache_checkpoint_state(
                request, checkpoint, retention_interval, num_tokens
            )
        return self._cache_prompt_tail_state(request, num_tokens)

    def _cache_checkpoint_state(
        self,
        request: Request,
        checkpoint: tuple[int, int],
        retention_interval: int | None,
        num_tokens: int,
    ) -> BlockHashWithGroupId | None:
        """Key the block a prefill checkpoint was exported into at the checkpoint's
        position, replacing whatever keys it had (the full-block hash just given to
        that column covers a later state than the one written there), unless the
        checkpoint is transient (the next chunk overwrites the block), when the
        block's keys are dropped instead. Never transient: the prompt's own
        checkpoint (``_checkpoint_boundary`` of the prompt;
        ``mamba_prompt_checkpoint_kept``, 0.31.0) and the request's
        ``shared_prefix_boundary``. Otherwise transient, under
        ``mamba_checkpoint_retention_mask`` (0.32.0), unless the retention mask keeps
        it (a position on a block boundary); before, under latest-only retention
        (interval 0) when caching stops before the prompt's end (``num_tokens``).

        Returns:
            The pool key, or None when nothing was keyed."""
        position, column = checkpoint
        blocks = self.req_to_blocks[request.request_id]
        assert 0 <= column < len(blocks)
        block = blocks[column]
        kept = self.mamba_prompt_checkpoint_kept and position == self._checkpoint_boundary(
            request.num_prompt_tokens
        )
        junction: int = getattr(request, "shared_prefix_boundary", 0) or 0
        if self.mamba_checkpoint_retention_mask:
            is_retained = False
            if position % self.block_size == 0:
                block_idx = position // self.block_size - 1
                mask = self.reachable_block_mask(
                    block_idx,
                    block_idx + 1,
                    self.cache_mask_alignment_tokens(),
                    self.kv_cache_spec,
                    self.drop_eagle_checkpoint_block,
                    retention_interval,
                    reachable_boundaries=(),
                )
                is_retained = mask is None or mask[0]
            transient = not kept and not is_retained and position != junction
        else:
            transient = (
                retention_interval == 0
                and num_tokens < request.num_prompt_tokens
                and not kept
                and position != junction
            )
        if transient:
            self.block_pool._maybe_evict_cached_block(block)
            return None
        if block._block_hash_num_tokens == position:
            return None
        return self.block_pool.cache_state_entry(
            request, block, position, self.kv_cache_group_id, replace=True
        )

    def _cache_prompt_tail_state(
        self, request: Request, num_tokens: int
    ) -> BlockHashWithGroupId | None:
        """Key the state block holding the prompt's tail when caching reaches exactly
        there (a state the pool lost, e.g. by ``evict_blocks``, is keyed again), by
        the release's rule:

        - ``mamba_prompt_tail_state`` (0.32.0): the prompt's last reusable hash
          boundary, leaving one token for the logits (or the lookahead tokens its
          hash covers, when more), or with EAGLE one whole hash block less; on a
          block boundary or, under ``partial_hit_copy_on_write``, inside a block;
        - else ``mamba_partial_prompt_tail`` (0.26.0-0.31.0): the prompt's last hash
          boundary (the whole prompt rounded down), only inside a block; one hash
          block less with EAGLE: from ``mamba_eagle_state_drop`` (0.30.0) for an
          EAGLE group, from ``mamba_tail_engine_eagle`` (0.31.0) when the engine
          runs EAGLE (``drop_eagle_checkpoint_block``).

        A boundary inside a block makes the request count the block as not cached
        yet, and its next allocation moves the entry to a copy. With
        ``shared_prefix_checkpoint`` the request's shared-prefix junction is keyed
        the same way (``_is_shared_prefix_junction``)."""
        hash_block_size = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hash_block_size:
            return None
        inside = num_tokens % self.block_size != 0
        if self.mamba_prompt_tail_state:
            boundary = kv_cache_math.mamba_prompt_tail_boundary(
                request.num_prompt_tokens,
                hash_block_size,
                self.drop_eagle_checkpoint_block,
                self.block_pool.num_hash_lookahead_tokens,
            )
        elif inside:
            boundary = request.num_prompt_tokens // hash_block_size * hash_block_size
            eagle = (
                self.drop_eagle_checkpoint_block
                if self.mamba_tail_engine_eagle
                else self.mamba_eagle_state_drop and self.use_eagle
            )
            if eagle:
                boundary = max(boundary - hash_block_size, 0)
        else:
            return None
        if num_tokens != boundary and not (
            self.shared_prefix_checkpoint and self._is_shared_prefix_junction(request, num_tokens)
        ):
            return None
        if inside and not self.partial_hit_copy_on_write:
            return None
        blocks = self.req_to_blocks[request.request_id]
        block_idx = cdiv(num_tokens, self.block_size) - 1
        if block_idx >= len(blocks):
            return None
        block = blocks[block_idx]
        if block.is_null or block._block_hash_num_tokens == num_tokens:
            return None
        key = self.block_pool.cache_state_entry(
            request, block, num_tokens, self.kv_cache_group_id
        )
        if key is not None and inside:
            self._partial_hit_reqs[request.request_id] = (block_idx, block)
            self.num_cached_block[request.request_id] = block_idx
            if self.offers_boundary_states:
                self._producer_partial_tail_reqs[request.request_id] = (block, num_tokens)
        return key

    @staticmethod
    def _is_shared_prefix_junction(request: Request, num_tokens: int) -> bool:
        """Whether ``num_tokens`` is the request's ``shared_prefix_boundary`` (where a
        sibling's hit stopped) and inside the prompt chunk being computed: past the
        computed tokens, at most the prompt (in decode the running state is
        overwritten in place, so its key would promise a later state)."""
        junction: int = getattr(request, "shared_prefix_boundary", 0) or 0
        return (
            junction == num_tokens
            and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens
        )

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """A finishing request's own partial prompt-tail state (``offers_boundary_states``):
        ``(group id, block, tokens)`` when no later token was computed into the block
        (nothing in flight, computed tokens at the boundary), once; else None."""
        if not self._producer_partial_tail_reqs:
            return None
        tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if tail is None:
            return None
        block, num_tokens = tail
        if num_in_flight_tokens != 0 or num_computed_tokens != num_tokens:
            return None
        return self.kv_cache_group_id, block, num_tokens

    def new_step_starts(self) -> None:
        """States cached in the previous step become hittable."""
        self.cached_blocks_this_step.clear()


@mypyc_attr(allow_interpreted_subclasses=True)
class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross attention: blocks for the encoder output, allocated once from
    ``num_encoder_tokens``; request-specific, so never cached or shared."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """No hits exist for cross attention; nothing to add."""
        assert not new_computed_blocks

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Connectors do not load cross-attention KV; nothing to allocate."""
        return

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Never valid: cross-attention blocks are not cached (vLLM raises too)."""
        raise ValueError("cross-attention blocks are never cached (prefix caching must be off)")

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: encoder states are per request."""
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Never valid: cross attention has no prefix cache."""
        raise NotImplementedError("CrossAttentionManager does not support caching")


@mypyc_attr(allow_interpreted_subclasses=True)
class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention (``RSWASpec``): full attention whose gap
    blocks, lying wholly between the prompt's last block and the decode window
    (the last ``rswa_window`` computed tokens), are released and become the null
    block, so a request holds about ``prompt + rswa_window`` tokens of blocks.

    NOTE: as in vLLM 0.25.1, the gap is released only when ``remove_skipped_blocks``
    is given ``num_prompt_tokens`` (``allocate_slots`` always gives it); without it
    nothing is released. Hits, caching and block counts are full attention's: no
    token counts as skipped, so a hit's gap blocks are touched and kept, and there
    is no admission cap (the pool is sized as for full attention).
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        *,
        needs_kv_cache_zeroing: bool = False,
        profile: Profile | None = None,
    ) -> None:
        # NOTE: explicit arguments, not **kwargs (mypyc forwards **kwargs wrongly).
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
            needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            profile=profile,
        )
        self.rswa_window: int = cast(Any, kv_cache_spec).rswa_window

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Release the gap blocks (right to left, up to a null an earlier call left)
        and put the null block in their place; nothing without ``num_prompt_tokens``.

        NOTE: an unknown request gets no table entry here (vLLM's range removal
        checks membership first).
        """
        if num_prompt_tokens is None:
            return  # full attention's rule: nothing is skipped
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        first, last = kv_cache_math.rswa_gap_blocks(
            num_prompt_tokens, total_computed_tokens, self.rswa_window, self.block_size
        )
        start, stop = kv_cache_math.gap_blocks_to_free(blocks, self._null_block, first, last)
        if start < stop:
            # Release first, then null out: a pool failure leaks nothing.
            self.block_pool.release_blocks(blocks[start:stop][::-1])
            blocks[start:stop] = [self._null_block] * (stop - start)


@mypyc_attr(allow_interpreted_subclasses=True)
class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with sink tokens (``SinkFullAttentionSpec``): at construction
    the manager takes ``sink_len // block_size`` blocks off the front of the free
    queue for the sinks (``sink_blocks``) and keeps them for good; otherwise it is
    full attention.

    NOTE: vLLM 0.25.1's constructor is kept as it is, quirks included
    (docs/divergences.md): it has no ``scheduler_block_size`` parameter, so the
    coordinator's keyword call raises ``TypeError`` (no ``KVCacheManager`` can hold
    a sink group), and its fifth and sixth positional arguments land in the base
    class's ``scheduler_block_size`` and ``dcp_world_size``. The sink blocks keep
    ref count 0 outside the free queue, so they count as used: ``get_usage`` counts
    them and ``reset_prefix_cache`` is refused for good.

    Raises:
        KVCacheSpecValueError: ``sink_len`` is not a positive multiple of the block
            size (vLLM asserts); nothing is taken from the pool then.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> None:
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            dcp_world_size,  # vLLM passes it where the base class takes scheduler_block_size
            pcp_world_size,
        )
        sink_len = getattr(kv_cache_spec, "sink_len", None)
        if not isinstance(sink_len, int) or sink_len <= 0 or sink_len % self.block_size:
            raise KVCacheSpecValueError(
                f"sink_len={sink_len!r} must be a positive multiple of block_size="
                f"{self.block_size}"
            )
        self.sink_blocks: list[KVCacheBlock] = block_pool.free_block_queue.popleft_n(
            sink_len // self.block_size
        )


@mypyc_attr(allow_interpreted_subclasses=True)
class CircularBufferManager(FullAttentionManager):
    """A ring buffer (``CircularBufferSpec``, vLLM 0.33.0): each request claims one
    block at its first allocation (or external load) and keeps it, whatever its
    length, until it is freed. The block is private scratch: never a prefix hit,
    never cached or hashed, never recorded for zeroing, and nothing is skipped.

    ``needs_kv_cache_zeroing`` is accepted (vLLM 0.33.0's argument) and changes
    nothing: a ring only reads slots its own request wrote.
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        needs_kv_cache_zeroing: bool = False,
        *,
        profile: Profile | None = None,
    ) -> None:
        # NOTE: explicit arguments, not **kwargs (mypyc forwards **kwargs wrongly).
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
            needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            profile=profile,
        )
        self._tracks_new_block_ids = False

    @property
    def records_new_block_ids(self) -> bool:
        """False: a ring block is never zeroed."""
        return False

    def _claim_ring_block(self, request_id: str) -> list[KVCacheBlock]:
        """The request's ring block if it has none yet (one block), else nothing."""
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        req_blocks.extend(new_blocks)
        return new_blocks

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_local_computed_tokens: int = 0,
        prefill_end: int = 0,
    ) -> int:
        """1 until the request holds its ring block, then 0 (hits and lengths do not
        matter). ``num_local_computed_tokens`` and ``prefill_end`` are vLLM 0.33.0's
        arguments, accepted by keyword and unused."""
        return 0 if self.req_to_blocks.get(request_id) else 1

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Nothing: a ring has no hits (the lookup gives it none)."""
        return None

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Claim the ring block for a request a KV connector loads (the ring itself is
        not transferred); ``record_for_zeroing`` changes nothing (never zeroed)."""
        self._claim_ring_block(request_id)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """The ring block on the request's first allocation; nothing afterwards."""
        return self._claim_ring_block(request_id)

    def cache_blocks(
        self,
        request: object,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Nothing: a ring block is never cached (``replay_boundaries`` is vLLM
        0.33.0's argument, unused)."""
        return None

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: a ring block is rewritten in place, so cascade attention cannot share it
        (vLLM 0.29.0-0.31.0 say so; 0.32.0 on count 0 for every group)."""
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """No hit: an empty list per group."""
        return tuple([] for _ in kv_cache_group_ids)


_TRACKING_SPECS = frozenset(
    {"FullAttentionSpec", "TQFullAttentionSpec", "MLAAttentionSpec", "HiddenStateCacheSpec"}
)
"""Spec classes whose groups report newly allocated block ids (0.25.1's rule)."""


def tracks_new_block_ids(
    kv_cache_spec: KVCacheSpec, profile: Profile, needs_kv_cache_zeroing: bool
) -> bool:
    """Whether a group of ``kv_cache_spec`` reports its newly allocated block ids
    (for zeroing) under ``profile``: in 0.25.1 the groups of the exact spec classes
    ``_TRACKING_SPECS``, whatever the layout; under ``new_block_ids_zeroing_only``
    none when the layout ``needs_kv_cache_zeroing`` is False; under
    ``zero_every_attention_group`` every attention kind but a ring buffer when it
    is True (``records_blocks_for_zeroing``)."""
    by_class = spec_exact_class_name(kv_cache_spec) in _TRACKING_SPECS
    if needs_kv_cache_zeroing and profile.zero_every_attention_group:
        return by_class or records_blocks_for_zeroing(kv_cache_spec)
    if not needs_kv_cache_zeroing and profile.new_block_ids_zeroing_only:
        return False
    return by_class

_MANAGER_FOR_SPEC: dict[str, type[SingleTypeKVCacheManager]] = {
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
}
"""Manager per spec class name, as vLLM 0.25.1 registers them (MLA is full
attention, sliding-window MLA is sliding window to the manager)."""

_NO_MANAGER = frozenset({"UniformTypeKVCacheSpecs", "EncoderOnlyAttentionSpec"})
"""Spec classes vLLM 0.25.1 registers no manager for: a uniform-type spec is
worker-side (the scheduler's config holds one of its layers' specs instead) and
encoder-only layers keep no KV cache."""


_HISPARSE_MANAGERS = {
    HISPARSE_SOURCE_ROLE: "HiSparseSourceManager",
    "HiSparseResidentSpec": "HiSparseResidentManager",
    "HiSparseHotSpec": "HiSparseHotManager",
}
"""vLLM 0.33.0's HiSparse managers by group role or spec class name: in
``kvcache.hisparse``, an interpreted module (their vLLM 0.33.0 argument order of
``get_num_blocks_to_allocate`` differs from the compiled base class's)."""


def _hisparse_manager_class(name: str) -> type[SingleTypeKVCacheManager]:
    """The HiSparse manager class for a role or spec class name of ``_HISPARSE_MANAGERS``
    (imported on first use: ``kvcache.hisparse`` imports this module)."""
    module = importlib.import_module("kvcache.hisparse")
    return cast(type[SingleTypeKVCacheManager], getattr(module, _HISPARSE_MANAGERS[name]))


def get_manager_class_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, role: object = None
) -> type[SingleTypeKVCacheManager]:
    """The manager class for a spec: a registration in ``KVCacheSpecRegistry``
    (``kvcache.kv_cache_spec_registry``: the group ``role``'s manager, else the
    nearest registered class of the spec's MRO) first; then the built-in role
    ``hisparse_source`` (``HiSparseSourceManager``, vLLM 0.33.0); else the nearest
    class in its MRO that is one of kvcache's or vLLM's spec classes decides, so
    vLLM's own spec objects and subclasses of either family are accepted.

    Raises:
        NotImplementedError: for a spec kind kvcache does not support, or one vLLM
            registers no manager for (naming the class).
    """
    registered = KVCacheSpecRegistry.registered_manager_class(kv_cache_spec, role)
    if registered is not None:
        return cast(type[SingleTypeKVCacheManager], registered)
    if getattr(role, "value", role) == HISPARSE_SOURCE_ROLE:
        return _hisparse_manager_class(HISPARSE_SOURCE_ROLE)  # vLLM 0.33.0's role manager
    for cls in type(kv_cache_spec).__mro__:
        if cls.__module__ not in SPEC_MODULES:
            continue
        if cls.__name__ in _NO_MANAGER:
            raise NotImplementedError(
                f"kv_cache_spec of type {type(kv_cache_spec).__name__} ({cls.__name__}) has no "
                "KV-cache manager: vLLM 0.25.1 registers none for it (a scheduler's config "
                "holds the per-layer specs of a UniformTypeKVCacheSpecs instead)"
            )
        manager_cls = _MANAGER_FOR_SPEC.get(cls.__name__)
        if manager_cls is not None:
            return manager_cls
        if cls.__name__ in _HISPARSE_MANAGERS:
            return _hisparse_manager_class(cls.__name__)
    raise NotImplementedError(
        f"kv_cache_spec of type {type(kv_cache_spec).__name__} is not supported"
    )


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    max_num_batched_tokens: int,
    max_model_len: int,
    role: object = None,
    **kwargs: object,
) -> SingleTypeKVCacheManager:
    """Build the manager for a group's spec (and ``role``, vLLM 0.33.0's group role:
    see ``get_manager_class_for_kv_cache_spec``); windowed kinds get their admission cap.

    Raises:
        NotImplementedError: for a spec kind kvcache does not support.
    """
    manager_cls = get_manager_class_for_kv_cache_spec(kv_cache_spec, role)
    if is_spec_kind(kv_cache_spec, "SlidingWindowSpec", "ChunkedLocalAttentionSpec"):
        spec = cast(SlidingWindowSpec | ChunkedLocalAttentionSpec, kv_cache_spec)
        # Positional: vLLM 0.33.0's specs name the first argument max_in_flight_tokens.
        kwargs["max_admission_blocks_per_request"] = spec.max_admission_blocks_per_request(
            max_num_batched_tokens, max_model_len
        )
    elif is_spec_kind(kv_cache_spec, "HiSparseResidentSpec"):
        resident = cast(HiSparseResidentSpec, kv_cache_spec)
        kwargs["max_admission_blocks_per_request"] = resident.max_admission_blocks_per_request(
            max_num_batched_tokens, max_model_len
        )
    return manager_cls(kv_cache_spec, **kwargs)  # type: ignore[arg-type]


# vLLM spec class -> (kvcache manager, the vLLM class its layers group with).
_VLLM_REGISTRATIONS: tuple[tuple[str, type[SingleTypeKVCacheManager], str], ...] = (
    ("FullAttentionSpec", FullAttentionManager, "FullAttentionSpec"),
    ("SlidingWindowSpec", SlidingWindowManager, "SlidingWindowSpec"),
    ("SlidingWindowMLASpec", SlidingWindowManager, "SlidingWindowMLASpec"),
    ("MambaSpec", MambaManager, "MambaSpec"),
    ("ChunkedLocalAttentionSpec", ChunkedLocalAttentionManager, "ChunkedLocalAttentionSpec"),
    ("CrossAttentionSpec", CrossAttentionManager, "CrossAttentionSpec"),
    ("TQFullAttentionSpec", FullAttentionManager, "FullAttentionSpec"),
    ("MLAAttentionSpec", FullAttentionManager, "FullAttentionSpec"),
    ("RSWASpec", RSWAManager, "FullAttentionSpec"),
    ("HiddenStateCacheSpec", FullAttentionManager, "FullAttentionSpec"),
    ("SinkFullAttentionSpec", SinkFullAttentionManager, "FullAttentionSpec"),
    ("CircularBufferSpec", CircularBufferManager, "CircularBufferSpec"),
)


def register_all_kvcache_specs(vllm_config: object = None) -> None:
    """vLLM's spec-registration hook, for callers that run it before building a
    scheduler or grouping layers.

    kvcache itself needs no registration (managers are found by spec class name).
    When vLLM is installed, vLLM's ``KVCacheSpecRegistry`` gets vLLM's spec classes
    with kvcache's managers and vLLM's grouping base classes, so vLLM's own
    layer-grouping helpers (which consult that registry) work beside kvcache. A class
    vLLM already registered keeps its registration. Without vLLM this does nothing.
    """
    # NOTE: vLLM's registry is imported under another name: in the compiled build a
    # function's import of a name the module also imports rebinds the module's global.
    try:
        from vllm.v1 import kv_cache_interface as vllm_specs
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry as VllmSpecRegistry
    except ImportError:
        return
    hisparse = tuple(
        (name, _hisparse_manager_class(name), name)
        for name in ("HiSparseResidentSpec", "HiSparseHotSpec")
    )
    for spec_name, manager_cls, base_name in (*_VLLM_REGISTRATIONS, *hisparse):
        spec_cls = getattr(vllm_specs, spec_name, None)
        base_cls = getattr(vllm_specs, base_name, None)
        if spec_cls is None or base_cls is None:
            continue
        try:
            VllmSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=base_cls)
        except AssertionError:
            continue  # registered before with vLLM's own manager
