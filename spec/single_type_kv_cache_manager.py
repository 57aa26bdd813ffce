"""Per-group managers: the block table of every request in one KV-cache group.

A group kind (sliding window, Mamba, ...) is a subclass that overrides
``get_num_skipped_tokens``, ``find_longest_cache_hit`` and
``get_num_common_prefix_blocks``; the bookkeeping here is shared.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvcache.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from kvcache.kv_cache_utils import BlockHashList
from kvcache.request import Request
from spec.block_pool import NULL_BLOCK, BlockPool


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group.

    ``req_to_blocks[r][i]`` holds tokens ``[i*block_size, (i+1)*block_size)`` of request
    ``r`` (0 where skipped). vLLM keeps it in a ``defaultdict``, so some reads create an
    empty entry: ``_blocks_of`` marks them. ``num_cached_block[r]`` counts the leading
    blocks already cached; only ``add_local_computed_blocks`` and a ``cache_blocks``
    that caches something set it, and a request in it is running (no more hits).
    ``new_block_ids`` collects fresh ids until ``take_new_block_ids``.
    """

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
        kv_cache_group_id: int, scheduler_block_size: int,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:  # fmt: skip
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.use_eagle = False
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.new_block_ids: list[int] = []
        # vLLM reports new ids only for exact full-attention-like spec types.
        self.records_new_block_ids = type(kv_cache_spec) is FullAttentionSpec

    def _blocks_of(self, request_id: str) -> list[int]:
        """The request's table, created empty if unknown (vLLM's defaultdict read)."""
        return self.req_to_blocks.setdefault(request_id, [])

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[int],
        total_computed_tokens: int, num_tokens_main_model: int, apply_admission_cap: bool = False,
    ) -> int:  # fmt: skip
        """Free blocks needed for ``num_tokens`` slots, counting the prefix hits that
        sit in the free queue (touching them takes them out of it).

        Raises:
            ValueError: if a running request is given new computed blocks.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required_blocks = min(num_required_blocks, self.max_admission_blocks_per_request)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise ValueError(f"request_id={request_id!r} is running: new_computed_blocks "
                                 f"must be empty, got {list(new_computed_blocks)}")  # fmt: skip
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, num_local_blocks), 0)
        hits = new_computed_blocks[max(0, num_skipped_blocks - num_req_blocks) :]
        return num_new_blocks + sum(
            self.block_pool.ref_cnt[b] == 0 and b != NULL_BLOCK for b in hits
        )

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[int],
        num_local_computed_tokens: int, num_external_computed_tokens: int,
    ) -> None:  # fmt: skip
        """Give a request without blocks its prefix hits (touched), nulls where skipped.

        Raises:
            ValueError: if the request holds blocks, or caching is off and there are hits.
        """
        req_blocks = self._blocks_of(request_id)
        if req_blocks:
            raise ValueError(f"request_id={request_id!r} already holds blocks {req_blocks}; "
                             "computed blocks only go to a request without blocks")  # fmt: skip
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(num_total) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"new_computed_blocks={list(new_computed_blocks)} with caching off")
        req_blocks.extend([NULL_BLOCK] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> None:
        """Allocate fresh blocks for the tokens a KV connector computed (unless skipped)."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                num_total - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self._blocks_of(request_id)
        new_ids = self.block_pool.get_new_blocks(cdiv(num_total, self.block_size) - len(req_blocks))
        req_blocks.extend(new_ids)
        if self.records_new_block_ids:
            self.new_block_ids.extend(new_ids)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[int]:
        """Append fresh blocks until the request has ``num_tokens`` slots; return them."""
        req_blocks = self._blocks_of(request_id)
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_ids = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_ids)
        if self.records_new_block_ids:
            self.new_block_ids.extend(new_ids)
        return new_ids

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids allocated since the last call."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens."""
        rid = request.request_id
        num_cached_blocks = self.num_cached_block.get(rid, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request, self._blocks_of(rid), num_cached_blocks, num_full_blocks,
            self.block_size, self.kv_cache_group_id,
        )  # fmt: skip
        self.num_cached_block[rid] = num_full_blocks

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forget the request; return its blocks in allocation order, still referenced."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first, so tails are evicted before heads."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of the request shared by every request with a table."""
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: BlockHashList, max_length: int, kv_cache_group_ids: list[int],
        block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[list[int], ...]:  # fmt: skip
        """Per group, the longest prefix of at most ``max_length`` tokens cached in all groups."""
        raise NotImplementedError

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the blocks attention no longer reads, tail first, leaving nulls."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self._blocks_of(request_id)
        freed: list[int] = []
        for i in reversed(range(min(num_skipped_tokens // self.block_size, len(blocks)))):
            if blocks[i] == NULL_BLOCK:
                break  # the rest was nulled by an earlier call
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no longer read once ``num_computed_tokens`` are computed (none)."""
        return 0

    def new_step_starts(self) -> None:
        """Hook run once per scheduler step (nothing to do by default)."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept until the request ends."""

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: BlockHashList, max_length: int, kv_cache_group_ids: list[int],
        block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[list[int], ...]:  # fmt: skip
        """Walk the hash chain left to right and stop at the first miss; drop the last
        hit for EAGLE (its hidden states must be recomputed), then trim to a multiple
        of ``alignment_tokens``."""
        hits: tuple[list[int], ...] = tuple([] for _ in kv_cache_group_ids)
        block_size = kv_cache_spec.block_size
        for block_hash in itertools.islice(block_hashes, max_length // block_size):
            cached_ids = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if not cached_ids:
                break
            for group_hits, block_id in zip(hits, cached_ids, strict=True):
                group_hits.append(block_id)
        if drop_eagle_block and hits[0]:
            for group_hits in hits:
                group_hits.pop()
        while block_size != alignment_tokens and len(hits[0]) * block_size % alignment_tokens:
            for group_hits in hits:
                group_hits.pop()
        return hits

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks whose ref count equals the number of tables (empty ones count)."""
        blocks = self._blocks_of(running_request_id)
        num_common = 0
        for block_id in blocks:
            if self.block_pool.ref_cnt[block_id] != len(self.req_to_blocks):
                break
            num_common += 1
        return num_common


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
    kv_cache_group_id: int, scheduler_block_size: int,
) -> SingleTypeKVCacheManager:  # fmt: skip
    """The manager of the spec's group kind (only full attention so far)."""
    if type(kv_cache_spec) is not FullAttentionSpec:
        raise NotImplementedError(f"no spec manager for {type(kv_cache_spec).__name__}")
    return FullAttentionManager(
        kv_cache_spec, block_pool, enable_caching, kv_cache_group_id, scheduler_block_size
    )
